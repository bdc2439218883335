"""Key schema and Lua scripts of the Redis index (pure: names and text, no I/O).

Keys, under a configurable prefix ``P`` (``prefixgate:`` by default) and the layout version
``v2:`` (``V = P + "v2:"``); ``{node}`` is a Redis Cluster hash tag, so all of one node's keys
live in one slot:

- ``V{node}:b:<i>`` — bucket ``i`` of the node's blocks: a ZSET small enough to stay
  listpack-encoded (≈ 48 members on average), member = the block hash as 8 bytes
  little-endian, score = the node's LRU tick (higher = more recent). A block's bucket is
  chosen by linear hashing on the low bits of its hash: the node starts with one bucket and
  splits one bucket at a time as it grows, so no write ever rehashes the whole node.
- ``V{node}:z`` — ZSET of the non-empty buckets, score = a **lower bound** of the bucket's
  least recent tick. Chain stores only raise ticks, so they leave every bound valid and touch
  this key once (new buckets); fragments lower bounds with one ``ZADD LT``. Eviction pops the
  bucket with the lowest bound and tightens bounds lazily: exact global LRU order without
  updating a per-bucket minimum on every write.
- ``V{node}:m`` — HASH: ``c`` capacity in blocks, ``t`` the rising tick (chains from the root),
  ``l`` the falling tick (fragments enter as least recent), ``e`` the node's epoch (a random
  token written when the hash is created; another token, or none, means the node's data was
  lost), ``n`` blocks held, ``L``/``s`` the linear-hashing level and split pointer (``2^L + s``
  buckets), ``r`` the time every bucket's TTL was last refreshed.
- ``Vnodes`` — ZSET registry of known nodes: member = node name, score = unix time of the last
  write; entries older than the TTL are ignored and pruned.

TTLs: every write refreshes the meta hash (``ttl``) and the touched keys; buckets and the
bucket ZSET get ``ttl * 5/4`` and all of a node's buckets are refreshed at least every
``ttl / 4``, so a bucket never expires before its node's meta. A node created afresh (no
epoch) first deletes any buckets left over from an expired meta.

The previous layout (one ZSET ``P{node}:z`` per node, meta ``P{node}:m``, registry ``Pnodes``)
is never read: its keys expire by their own TTL, and ``legacy_pattern`` lets an operator drop
them at once. Block hashes already embed model, tenant salt and block size (``hashing.py``),
so tenants never share a member even though they share the keys of a node.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_PREFIX = "prefixgate:"
LAYOUT = "v2:"
BUCKET_FILL = 48  # average blocks per bucket before a split; Redis keeps ZSETs <= 128 as listpacks

_LE64 = struct.Struct("<Q")


def pack_hash(h: int) -> bytes:
    return _LE64.pack(h)


def pack_hashes(hashes: Sequence[int]) -> bytes:
    """Block hashes as one blob of 8-byte little-endian members (what the scripts slice)."""
    return struct.pack(f"<{len(hashes)}Q", *hashes)


def unpack_hash(member: bytes) -> int:
    value: int = _LE64.unpack(member)[0]
    return value


def bucket_of(h: int, level: int, split: int) -> int:
    """Linear hashing: the bucket of hash ``h`` among ``2**level + split`` buckets."""
    low = h & 0xFFFFFFFF
    a = low % (1 << level)
    return low % (2 << level) if a < split else a


def _glob_escape(text: str) -> str:
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)


@dataclass(frozen=True, slots=True)
class KeySchema:
    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if "{" in self.prefix or "}" in self.prefix:
            raise ValueError("the key prefix must not contain '{' or '}' (they are the node's hash tag)")

    @property
    def versioned(self) -> str:
        return self.prefix + LAYOUT

    def meta(self, node: str) -> str:
        return f"{self.versioned}{{{node}}}:m"

    def order(self, node: str) -> str:
        """The node's ZSET of buckets by (a lower bound of) their least recent tick."""
        return f"{self.versioned}{{{node}}}:z"

    def bucket(self, node: str, i: int) -> str:
        return f"{self.versioned}{{{node}}}:b:{i}"

    @property
    def registry(self) -> str:
        return f"{self.versioned}nodes"

    @property
    def pattern(self) -> str:
        """SCAN pattern matching every key of this prefix, any layout (glob characters escaped)."""
        return _glob_escape(self.prefix) + "*"

    def is_legacy(self, key: str) -> bool:
        """A key of this prefix written by an earlier layout (never read by this one)."""
        return key.startswith(self.prefix) and not key.startswith(self.versioned)


# -- Lua ------------------------------------------------------------------------------------
# Bucket of an 8-byte member under linear hashing: the low 32 bits of the hash modulo
# 2^L, or 2^(L+1) for buckets already split in this round (below the split pointer s).
# ``bucket_name`` gives the id as a string, memoized: Lua turns numbers into strings with a
# slow "%.14g" (implicitly in ``..`` and in redis.call arguments), which would dominate a store.
_BUCKET_FN = """
local function bucket_in(mem, size, s)
  local b1, b2, b3, b4 = string.byte(mem, 1, 4)
  local v = b1 + 256 * (b2 + 256 * (b3 + 256 * b4))
  local a = v % size
  if a < s then a = v % (size * 2) end
  return a
end
local names = {}
local function bucket_name(a)
  local name = names[a]
  if not name then
    name = string.format('%d', a)
    names[a] = name
  end
  return name
end
"""

# Leading run per node by binary search over the prompt's blob (prefix-closed sets).
# ``blob``: packed hashes; ``metas``: the nodes' meta keys. Returns one integer per node.
_LOOKUP_BODY = (
    _BUCKET_FN
    + """
local n = #blob / 8
local out = {}
for k = 1, #metas do
  local meta = metas[k]
  local run = 0
  local f = redis.call('HMGET', meta, 'L', 's')
  if n > 0 and f[1] then
    local stem = string.sub(meta, 1, -2) .. 'b:'
    local size, s = 2 ^ tonumber(f[1]), tonumber(f[2]) or 0
    local function held(j)
      local mem = string.sub(blob, j * 8 - 7, j * 8)
      return redis.call('ZSCORE', stem .. bucket_name(bucket_in(mem, size, s)), mem)
    end
    if held(1) then
      local lo, hi = 1, n
      while lo < hi do
        local mid = math.floor((lo + hi + 1) / 2)
        if held(mid) then lo = mid else hi = mid - 1 end
      end
      run = lo
    end
  end
  out[k] = run
end
return out
"""
)

# Single Redis: KEYS the nodes' meta hashes, ARGV[1] packed hashes.
LOOKUP_LUA = "local blob = ARGV[1]\nlocal metas = KEYS\n" + _LOOKUP_BODY

# Cluster, one call per shard: ARGV[1] packed hashes, ARGV[2..] the meta keys of the nodes
# whose slots this shard serves (several slots: they cannot be declared as KEYS, and a key of
# another shard fails the call, which the caller treats like any failed lookup).
LOOKUP_SHARD_LUA = (
    "#!lua flags=no-writes,allow-cross-slot-keys\nlocal blob = ARGV[1]\nlocal metas = {unpack(ARGV, 2)}\n"
    + _LOOKUP_BODY
)

# What every write script shares: KEYS[1] the node's meta hash, KEYS[2] its bucket ZSET; the
# buckets are derived from the meta key (same hash tag, so same slot).
_NODE_PRELUDE = (
    _BUCKET_FN
    + f"""
local FILL = {BUCKET_FILL}
local m, o = KEYS[1], KEYS[2]
local stem = string.sub(m, 1, -2) .. 'b:'
local st = {{}}

local function bkey(id) return stem .. bucket_name(id) end
local function bucket_of(mem) return bucket_in(mem, st.size, st.s) end
local function nbuckets() return st.size + st.s end

-- ZADD/ZREM/ZMSCORE with at most ``step`` arguments per call (Lua's unpack limit)
local function chunked(cmd, key, flag, args, step)
  if #args <= step then
    if flag then return redis.call(cmd, key, flag, unpack(args)) end
    return redis.call(cmd, key, unpack(args))
  end
  local total, res = 0, {{}}
  for c = 1, #args, step do
    local part = {{}}
    if flag then part[1] = flag end
    for k = c, math.min(c + step - 1, #args) do part[#part + 1] = args[k] end
    local r = redis.call(cmd, key, unpack(part))
    if type(r) == 'table' then
      for k = 1, #r do res[#res + 1] = r[k] end
    else
      total = total + r
    end
  end
  if cmd == 'ZMSCORE' then return res end
  return total
end

-- Read the node's state. ``epoch`` set: create the node if it has no epoch (dropping buckets
-- left over from an expired meta); otherwise return false for a node that does not exist.
local function open_node(ttl, cap, epoch)
  local now = tonumber(redis.call('TIME')[1])
  if epoch then
    redis.call('HSETNX', m, 'c', cap)
    if redis.call('HSETNX', m, 'e', epoch) == 1 then
      local old = redis.call('ZRANGE', o, 0, -1)
      for i = 1, #old do redis.call('DEL', stem .. old[i]) end
      redis.call('DEL', o)
      redis.call('HSET', m, 'L', 0, 's', 0, 'n', 0, 'r', now)
    end
  end
  local f = redis.call('HMGET', m, 'L', 's', 'n', 'c', 'r', 'e')
  if not f[6] then return false end
  st.L, st.s, st.n = tonumber(f[1]) or 0, tonumber(f[2]) or 0, tonumber(f[3]) or 0
  st.cap = tonumber(f[4]) or 0
  st.size = 2 ^ st.L
  st.ttl = ttl
  st.bttl = ttl + math.ceil(ttl / 4)
  st.now = now
  st.refresh = (now - (tonumber(f[5]) or 0)) * 4 >= ttl
  return true
end

local function close_node()
  redis.call('HSET', m, 'L', st.L, 's', st.s, 'n', st.n)
  if st.refresh then
    for id = 0, nbuckets() - 1 do redis.call('EXPIRE', bkey(id), st.bttl) end
    redis.call('HSET', m, 'r', st.now)
  end
  redis.call('EXPIRE', m, st.ttl)
  redis.call('EXPIRE', o, st.bttl)
end

local function clear_buckets()
  for id = 0, nbuckets() - 1 do redis.call('DEL', bkey(id)) end
  redis.call('DEL', o)
  local n = st.n
  st.L, st.s, st.n, st.size = 0, 0, 0, 1
  return n
end

-- Split bucket s into s and s + 2^L while ``expected`` blocks would fill the buckets beyond
-- FILL on average. Called before a chain is added (with the chain counted as new), so even one
-- large store into a small node never overfills a bucket past the listpack limit.
local function grow_for(expected)
  local guard = 0
  while expected > nbuckets() * FILL and guard < 100000 do
    guard = guard + 1
    local src, dst, big = st.s, st.s + st.size, st.size * 2
    local all = redis.call('ZRANGE', bkey(src), 0, -1, 'WITHSCORES')
    local move, gone, low = {{}}, {{}}, nil
    for k = 1, #all, 2 do
      local mem = all[k]
      if bucket_in(mem, big, 0) ~= src then
        move[#move + 1] = all[k + 1]
        move[#move + 1] = mem
        gone[#gone + 1] = mem
        local sc = tonumber(all[k + 1])
        if not low or sc < low then low = sc end
      end
    end
    if #gone > 0 then
      chunked('ZADD', bkey(dst), nil, move, 1000)
      chunked('ZREM', bkey(src), nil, gone, 1000)
      redis.call('EXPIRE', bkey(dst), st.bttl)
      redis.call('ZADD', o, 'LT', string.format('%d', low), bucket_name(dst))
      if #gone * 2 == #all then redis.call('ZREM', o, bucket_name(src)) end
    end
    st.s = st.s + 1
    if st.s == st.size then st.L, st.s, st.size = st.L + 1, 0, big end
  end
end

-- Add grouped members: ``groups`` bucket -> {{score, member, ...}}, ``mins`` bucket -> lowest
-- score offered. One ZADD per touched bucket; the bucket ZSET learns new buckets (which get a
-- TTL) and lowered bounds in one ZADD LT. Updates the count.
local function add(groups, mins, flag)
  local ids, names_, bounds = {{}}, {{}}, {{}}
  for id in pairs(groups) do
    ids[#ids + 1] = id
    names_[#names_ + 1] = bucket_name(id)
  end
  local known = chunked('ZMSCORE', o, nil, names_, 1000)
  for k, id in ipairs(ids) do
    local key = bkey(id)
    st.n = st.n + chunked('ZADD', key, flag, groups[id], 1000)
    if not known[k] then redis.call('EXPIRE', key, st.bttl) end
    bounds[#bounds + 1] = string.format('%d', mins[id])
    bounds[#bounds + 1] = names_[k]
  end
  chunked('ZADD', o, 'LT', bounds, 1000)
end

-- Evict the k least recent blocks. The bucket with the lowest bound is checked: empty, it
-- leaves the bucket ZSET; a bound below its true minimum is raised and the search repeats;
-- otherwise its head is the node's least recent block, and so is every next member below the
-- second lowest bound.
local function evict(k)
  local guard = 0
  while k > 0 and guard < 1000000 do
    guard = guard + 1
    local e = redis.call('ZRANGE', o, 0, 1, 'WITHSCORES')
    if #e == 0 then break end
    local id, bound = e[1], tonumber(e[2])
    local nextb = e[4] and tonumber(e[4])
    local key = stem .. id
    local head = redis.call('ZRANGE', key, 0, math.min(k, 7), 'WITHSCORES')
    if #head == 0 then
      redis.call('ZREM', o, id)
    elseif tonumber(head[2]) > bound then
      redis.call('ZADD', o, head[2], id)
    else
      local c = 1
      while c < k and 2 * c < #head and (not nextb or tonumber(head[2 * c + 2]) < nextb) do c = c + 1 end
      redis.call('ZREMRANGEBYRANK', key, 0, c - 1)
      k, st.n = k - c, st.n - c
      local nxt = head[2 * c + 2]
      if not nxt then nxt = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')[2] end
      if nxt then redis.call('ZADD', o, nxt, id) else redis.call('ZREM', o, id) end
    end
  end
end
"""
)

# Store chains on one node, in order; mirrors ``NodeBlocks.store`` exactly.
# A chain from the root takes scores from the rising tick ``t`` (root highest, so a parent is
# always more recent than its children); a fragment after a parent adds only its new blocks,
# below every score, from the falling tick ``l``.
# KEYS[1] meta HASH, KEYS[2] bucket ZSET. ARGV[1] capacity if the node has none yet, ARGV[2]
# TTL seconds, ARGV[3] 'r' = replace (clear first) or 's', ARGV[4] epoch token if the node has
# none yet, ARGV[5..] pairs (parent member or '' for the root, packed chain).
# Returns 1/0 per pair, then the node's epoch.
STORE_LUA = (
    _NODE_PRELUDE
    + """
open_node(tonumber(ARGV[2]), ARGV[1], ARGV[4])
if ARGV[3] == 'r' then clear_buckets() end
local out = {}
for i = 5, #ARGV, 2 do
  local parent, blob = ARGV[i], ARGV[i + 1]
  if parent ~= '' and not redis.call('ZSCORE', bkey(bucket_of(parent)), parent) then
    out[#out + 1] = 0
  else
    out[#out + 1] = 1
    if st.cap > 0 then
      local n = math.min(#blob / 8, st.cap)
      local protect = 0
      if n > 0 then
        local groups, mins, flag, score = {}, {}, nil, 0
        if parent == '' then
          score = redis.call('HINCRBY', m, 't', n) + 1  -- block j (root = 1) gets top - j + 1
          protect = n
        else
          flag = 'NX'  -- held blocks keep their place; new ones enter least recent, deepest lowest
          score = redis.call('HINCRBY', m, 'l', -n) + n
        end
        grow_for(st.n + n)
        for j = 1, n do
          score = score - 1
          local mem = string.sub(blob, j * 8 - 7, j * 8)
          local id = bucket_of(mem)
          local g = groups[id]
          if not g then
            g = {}
            groups[id] = g
            mins[id] = score
          end
          g[#g + 1] = string.format('%d', score)
          g[#g + 1] = mem
          if score < mins[id] then mins[id] = score end
        end
        add(groups, mins, flag)
      end
      -- evict least recent first (leaves before parents), never the chain just stored
      evict(math.min(st.n - st.cap, st.n - protect))
    end
  end
end
close_node()
out[#out + 1] = redis.call('HGET', m, 'e')
return out
"""
)

# KEYS[1] meta HASH, KEYS[2] bucket ZSET; ARGV[1] capacity (>= 0), ARGV[2] TTL seconds,
# ARGV[3] epoch token if the node has none yet. Returns the node's epoch.
SET_CAPACITY_LUA = (
    _NODE_PRELUDE
    + """
local cap = tonumber(ARGV[1])
open_node(tonumber(ARGV[2]), cap, ARGV[3])
redis.call('HSET', m, 'c', cap)
st.cap = cap
evict(st.n - cap)
close_node()
return redis.call('HGET', m, 'e')
"""
)

# KEYS[1] meta HASH, KEYS[2] bucket ZSET; ARGV[1] TTL seconds, ARGV[2] packed hashes (a closed
# set, no duplicates). Returns how many of them the node held.
REMOVE_LUA = (
    _NODE_PRELUDE
    + """
if not open_node(tonumber(ARGV[1]), nil, nil) then return 0 end
local blob = ARGV[2]
local groups = {}
for j = 1, #blob / 8 do
  local mem = string.sub(blob, j * 8 - 7, j * 8)
  local id = bucket_of(mem)
  local g = groups[id]
  if not g then
    g = {}
    groups[id] = g
  end
  g[#g + 1] = mem
end
local removed = 0
for id, g in pairs(groups) do
  removed = removed + chunked('ZREM', bkey(id), nil, g, 1000)
  if redis.call('EXISTS', bkey(id)) == 0 then redis.call('ZREM', o, bucket_name(id)) end
end
st.n = st.n - removed
close_node()
return removed
"""
)

# KEYS[1] meta HASH, KEYS[2] bucket ZSET. Forget every block (capacity and epoch stay).
# Returns how many blocks the node held.
CLEAR_LUA = (
    _NODE_PRELUDE
    + """
if not open_node(3600, nil, nil) then return 0 end
local n = clear_buckets()
redis.call('HSET', m, 'L', 0, 's', 0, 'n', 0)
return n
"""
)

# KEYS[1] meta HASH, KEYS[2] bucket ZSET. Every member the node holds (read-only).
NODE_HASHES_LUA = (
    _NODE_PRELUDE
    + """
if not open_node(3600, nil, nil) then return {} end
local out = {}
for id = 0, nbuckets() - 1 do
  local part = redis.call('ZRANGE', bkey(id), 0, -1)
  for k = 1, #part do out[#out + 1] = part[k] end
end
return out
"""
)

# Epoch check of one node. KEYS[1] meta HASH; ARGV[1] '1' to also prove that Redis accepts
# writes (a same-value HSET: refused under maxmemory + noeviction like any real write).
# Returns the node's epoch, or false when the node's data is gone.
EPOCH_LUA = """
local e = redis.call('HGET', KEYS[1], 'e')
if e and ARGV[1] == '1' then redis.call('HSET', KEYS[1], 'e', e) end
return e
"""
