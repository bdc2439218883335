"""Lua scripts of the ``zset`` index layout (pure text, no I/O): one skiplist ZSET per node.

Keys (``KeySchema`` with ``layout="zset"``): ``P{node}:z`` — ZSET, one member per block held
(the 64-bit block hash as 8 bytes little-endian), score = the node's LRU tick, so ZSET order is
LRU order; ``P{node}:m`` — HASH (``c`` capacity, ``t`` rising tick, ``l`` falling tick, ``e``
epoch); ``Pnodes`` — the registry. Writes are one ``ZADD`` per ~500 blocks: the fastest write
path, at ≈ 104 bytes of Redis memory per block (see ``cachetier/README.md``).
"""

from __future__ import annotations

# Leading run per node by binary search over the prompt's blob (prefix-closed sets).
# ``blob``: packed hashes; ``zsets``: the nodes' block ZSETs. Returns one integer per ZSET.
_LOOKUP_BODY = """
local n = #blob / 8
local out = {}
for k = 1, #zsets do
  local z = zsets[k]
  local run = 0
  if n > 0 and redis.call('ZSCORE', z, string.sub(blob, 1, 8)) then
    local lo, hi = 1, n
    while lo < hi do
      local mid = math.floor((lo + hi + 1) / 2)
      if redis.call('ZSCORE', z, string.sub(blob, mid * 8 - 7, mid * 8)) then
        lo = mid
      else
        hi = mid - 1
      end
    end
    run = lo
  end
  out[k] = run
end
return out
"""

# Single Redis: KEYS the nodes' block ZSETs, ARGV[1] packed hashes.
LOOKUP_LUA = "local blob = ARGV[1]\nlocal zsets = KEYS\n" + _LOOKUP_BODY

# Cluster, one call per shard: ARGV[1] packed hashes, ARGV[2..] the block ZSETs of the nodes
# whose slots this shard serves (several slots: they cannot be declared as KEYS, and a key of
# another shard fails the call, which the caller treats like any failed lookup).
LOOKUP_SHARD_LUA = (
    "#!lua flags=no-writes,allow-cross-slot-keys\nlocal blob = ARGV[1]\nlocal zsets = {unpack(ARGV, 2)}\n"
    + _LOOKUP_BODY
)

# Store chains on one node, in order; mirrors ``NodeBlocks.store`` exactly.
# A chain from the root takes scores from the rising tick ``t`` (touched in reverse, root last);
# a fragment after a parent adds only its new blocks, below every score, from the falling tick ``l``.
# KEYS[1] block ZSET, KEYS[2] meta HASH.
# ARGV[1] capacity if the node has none yet, ARGV[2] TTL seconds, ARGV[3] 'r' = replace (clear
# first) or 's', ARGV[4] epoch token if the node has none yet, ARGV[5..] pairs (parent member or
# '' for the root, packed chain). Returns 1/0 per pair, then the node's epoch.
STORE_LUA = """
local z, m = KEYS[1], KEYS[2]
redis.call('HSETNX', m, 'c', ARGV[1])
redis.call('HSETNX', m, 'e', ARGV[4])
local cap = tonumber(redis.call('HGET', m, 'c'))
if ARGV[3] == 'r' then redis.call('DEL', z) end
local out = {}
local function zadd(flag, args)
  if flag then
    redis.call('ZADD', z, flag, unpack(args))
  else
    redis.call('ZADD', z, unpack(args))
  end
end
for i = 5, #ARGV, 2 do
  local parent, blob = ARGV[i], ARGV[i + 1]
  if parent ~= '' and not redis.call('ZSCORE', z, parent) then
    out[#out + 1] = 0
  else
    out[#out + 1] = 1
    if cap > 0 then
      local n = math.min(#blob / 8, cap)
      local protect = 0
      if n > 0 then
        local args = {}
        local flag = nil
        if parent == '' then
          -- touch in reverse (root last): a parent is always more recent than its children
          local top = redis.call('HINCRBY', m, 't', n)
          local score = top - n
          for j = n, 1, -1 do
            score = score + 1
            args[#args + 1] = string.format('%d', score)
            args[#args + 1] = string.sub(blob, j * 8 - 7, j * 8)
            if #args >= 1000 then zadd(flag, args); args = {} end
          end
          protect = n
        else
          -- new blocks enter as the least recent, deepest lowest; held ones keep their score
          flag = 'NX'
          local low = redis.call('HINCRBY', m, 'l', -n)
          local score = low + n
          for j = 1, n do
            score = score - 1
            args[#args + 1] = string.format('%d', score)
            args[#args + 1] = string.sub(blob, j * 8 - 7, j * 8)
            if #args >= 1000 then zadd(flag, args); args = {} end
          end
        end
        if #args > 0 then zadd(flag, args) end
      end
      -- evict least recent first (leaves before parents), never the chain just stored
      local size = redis.call('ZCARD', z)
      local k = math.min(size - cap, size - protect)
      if k > 0 then redis.call('ZPOPMIN', z, k) end
    end
  end
end
redis.call('EXPIRE', z, ARGV[2])
redis.call('EXPIRE', m, ARGV[2])
out[#out + 1] = redis.call('HGET', m, 'e')
return out
"""

# KEYS[1] block ZSET, KEYS[2] meta HASH; ARGV[1] capacity (>= 0), ARGV[2] TTL seconds,
# ARGV[3] epoch token if the node has none yet. Returns the node's epoch.
SET_CAPACITY_LUA = """
local z, m = KEYS[1], KEYS[2]
local cap = tonumber(ARGV[1])
redis.call('HSET', m, 'c', cap)
redis.call('HSETNX', m, 'e', ARGV[3])
local k = redis.call('ZCARD', z) - cap
if k > 0 then redis.call('ZPOPMIN', z, k) end
redis.call('EXPIRE', z, ARGV[2])
redis.call('EXPIRE', m, ARGV[2])
return redis.call('HGET', m, 'e')
"""

# Epoch check of one node. KEYS[1] meta HASH; ARGV[1] '1' to also prove that Redis accepts
# writes (a same-value HSET: refused under maxmemory + noeviction like any real write).
# Returns the node's epoch, or false when the node's data is gone.
EPOCH_LUA = """
local e = redis.call('HGET', KEYS[1], 'e')
if e and ARGV[1] == '1' then redis.call('HSET', KEYS[1], 'e', e) end
return e
"""
