"""Lua scripts of the ``packed`` index layout (pure text, no I/O): buckets of packed entries.

Keys, under a configurable prefix ``P`` (``prefixgate:`` by default) and the layout version
``v2:`` (``V = P + "v2:"``); ``{node}`` is a Redis Cluster hash tag, so all of one node's keys
live in one slot:

- ``V{node}:h`` — HASH of the node's blocks in buckets: field = bucket number, value = its
  entries packed, 14 bytes each (the block hash as 8 bytes little-endian, then its LRU tick
  + 2^47 as 6 bytes big-endian), least recent first. A block's bucket is chosen by linear
  hashing on the low bits of its hash: the node starts with one bucket and splits one bucket
  at a time as it grows (``BUCKET_FILL`` blocks per bucket on average), so no write rehashes
  the whole node. A store reads and writes all the buckets it touches in one HMGET and one
  HSET: a handful of calls per store instead of one per bucket.
- ``V{node}:z`` — ZSET of the non-empty buckets, score = a **lower bound** of the bucket's
  least recent tick. Chain stores only raise ticks, so they leave every bound valid and only
  add new buckets; fragments lower bounds with one ``ZADD LT``. Eviction reads the bucket with
  the lowest bound and raises stale bounds lazily: exact global LRU order without updating a
  per-bucket minimum on every write.
- ``V{node}:m`` — HASH: ``c`` capacity in blocks, ``t`` the rising tick (chains from the root),
  ``l`` the falling tick (fragments enter as least recent), ``e`` the node's epoch (a random
  token written when the hash is created; another token, or none, means the node's data was
  lost), ``n`` blocks held, ``L``/``s`` the linear-hashing level and split pointer (``2^L + s``
  buckets).
- ``Vnodes`` — ZSET registry of known nodes: member = node name, score = unix time of the last
  write; entries older than the TTL are ignored and pruned.

Every write refreshes the TTL of the node's three keys and of the registry, so an abandoned
node's keys expire; a node created afresh (no epoch) first drops anything left of it.

Chosen with ``layout="packed"``; the ``zset`` layout's keys (``P{node}:z``, ``P{node}:m``,
``Pnodes``) are never read, and ``RedisIndex.purge_other_layout`` drops them.
"""

from __future__ import annotations

from prefixgate.cachetier.redis_schema import BUCKET_FILL

# -- Lua ------------------------------------------------------------------------------------
# An entry is 14 bytes: the 8-byte member, then its tick + 2^47 as 6 bytes big-endian. A bucket
# (one field of the node's blocks HASH) holds its entries sorted by tick, least recent first.
# Bucket of a member under linear hashing: the low 32 bits of the hash modulo 2^L, or 2^(L+1)
# for buckets already split in this round (below the split pointer s). Names are memoized:
# Lua turns numbers into strings with a slow "%.14g" (in ``..`` and redis.call arguments).
_COMMON = r"""
local ENTRY = 14
local OFFSET = 140737488355328
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
-- position of ``mem``'s entry in ``blob`` (entry-aligned), or nil
local function find_entry(blob, mem)
  local from = 1
  while true do
    local p = string.find(blob, mem, from, true)
    if not p then return nil end
    if (p - 1) % ENTRY == 0 then return p end
    from = p + 1
  end
end
local function tick_at(blob, p)
  local a, b, c, d, e, f = string.byte(blob, p + 8, p + 13)
  return ((((a * 256 + b) * 256 + c) * 256 + d) * 256 + e) * 256 + f - OFFSET
end
"""

# Leading run per node by binary search over the prompt's blob (prefix-closed sets).
# ``blob``: packed hashes; ``metas``: the nodes' meta keys. Returns one integer per node.
_LOOKUP_BODY = (
    _COMMON
    + """
local n = #blob / 8
local out = {}
for k = 1, #metas do
  local meta = metas[k]
  local run = 0
  local f = redis.call('HMGET', meta, 'L', 's')
  if n > 0 and f[1] then
    local h = string.sub(meta, 1, -2) .. 'h'
    local size, s = 2 ^ tonumber(f[1]), tonumber(f[2]) or 0
    local function held(j)
      local mem = string.sub(blob, j * 8 - 7, j * 8)
      local b = redis.call('HGET', h, bucket_name(bucket_in(mem, size, s)))
      return b and find_entry(b, mem)
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

# What every write script shares: KEYS[1] the node's meta HASH, KEYS[2] its blocks HASH,
# KEYS[3] its bucket ZSET (one hash tag: one slot).
_NODE_PRELUDE = (
    _COMMON
    + f"""
local FILL = {BUCKET_FILL}
local m, h, o = KEYS[1], KEYS[2], KEYS[3]
local st = {{}}

local function bucket_of(mem) return bucket_in(mem, st.size, st.s) end
local function nbuckets() return st.size + st.s end

-- A tick's 6 bytes as two short strings (the high 4 change rarely within a store): pushed
-- next to the member into one table.concat, no per-entry string is built.
local hi_key, hi_str = nil, nil
local function tick_parts(tick)
  local v = tick + OFFSET
  local lo = v % 65536
  local hi = (v - lo) / 65536
  if hi ~= hi_key then
    local x = hi
    local d = x % 256; x = (x - d) / 256
    local c = x % 256; x = (x - c) / 256
    local b = x % 256; x = (x - b) / 256
    hi_key, hi_str = hi, string.char(x % 256, b, c, d)
  end
  local l2 = lo % 256
  return hi_str, string.char((lo - l2) / 256, l2)
end

-- redis.call with at most 1000 variable arguments per call (Lua's unpack limit); the replies
-- of a multi-bulk command are concatenated, integer replies summed.
local function chunked(cmd, key, args)
  if #args <= 1000 then return redis.call(cmd, key, unpack(args)) end
  local total, res = 0, {{}}
  for c = 1, #args, 1000 do
    local r = redis.call(cmd, key, unpack(args, c, math.min(c + 999, #args)))
    if type(r) == 'table' then
      for k = 1, #r do res[#res + 1] = r[k] end
    else
      total = total + r
    end
  end
  if cmd == 'HMGET' then return res end
  return total
end

-- Read the node's state. ``epoch`` set: create the node if it has no epoch (dropping blocks
-- left over from an expired meta); otherwise return false for a node that does not exist.
local function open_node(ttl, cap, epoch)
  if epoch then
    redis.call('HSETNX', m, 'c', cap)
    if redis.call('HSETNX', m, 'e', epoch) == 1 then
      redis.call('DEL', h, o)
      redis.call('HSET', m, 'L', 0, 's', 0, 'n', 0)
    end
  end
  local f = redis.call('HMGET', m, 'L', 's', 'n', 'c', 'e')
  if not f[5] then return false end
  st.L, st.s, st.n = tonumber(f[1]) or 0, tonumber(f[2]) or 0, tonumber(f[3]) or 0
  st.cap = tonumber(f[4]) or 0
  st.size = 2 ^ st.L
  st.ttl = ttl
  return true
end

local function close_node()
  redis.call('HSET', m, 'L', st.L, 's', st.s, 'n', st.n)
  redis.call('EXPIRE', m, st.ttl)
  redis.call('EXPIRE', h, st.ttl)
  redis.call('EXPIRE', o, st.ttl)
end

local function clear_buckets()
  redis.call('DEL', h, o)
  local n = st.n
  st.L, st.s, st.n, st.size = 0, 0, 0, 1
  return n
end

-- Write a bucket back: its entries, and its head tick as its bound (exact); empty, it goes.
local function put(name, blob)
  if #blob == 0 then
    redis.call('HDEL', h, name)
    redis.call('ZREM', o, name)
  else
    redis.call('HSET', h, name, blob)
    redis.call('ZADD', o, string.format('%d', tick_at(blob, 1)), name)
  end
end

-- Split bucket s into s and s + 2^L while ``expected`` blocks would fill the buckets beyond
-- FILL on average (called before a chain is added, the chain counted as new). Entries keep
-- their order, so both halves stay sorted by tick.
local function grow_for(expected)
  local guard = 0
  while expected > nbuckets() * FILL and guard < 100000 do
    guard = guard + 1
    local src, dst, big = st.s, st.s + st.size, st.size * 2
    local blob = redis.call('HGET', h, bucket_name(src))
    if blob then
      local stay, move = {{}}, {{}}
      for p = 1, #blob, ENTRY do
        local e = string.sub(blob, p, p + ENTRY - 1)
        if bucket_in(e, big, 0) == src then stay[#stay + 1] = e else move[#move + 1] = e end
      end
      if #move > 0 then
        put(bucket_name(src), table.concat(stay))
        put(bucket_name(dst), table.concat(move))
      end
    end
    st.s = st.s + 1
    if st.s == st.size then st.L, st.s, st.size = st.L + 1, 0, big end
  end
end

-- Evict the k least recent blocks. The bucket with the lowest bound is read: a bound below
-- its head is raised and the search repeats; otherwise its head is the node's least recent
-- block, and so is every next entry below the second lowest bound.
local function evict(k)
  local guard = 0
  while k > 0 and guard < 1000000 do
    guard = guard + 1
    local e = redis.call('ZRANGE', o, 0, 1, 'WITHSCORES')
    if #e == 0 then break end
    local name, bound = e[1], tonumber(e[2])
    local nextb = e[4] and tonumber(e[4])
    local blob = redis.call('HGET', h, name)
    if not blob or #blob == 0 then
      redis.call('ZREM', o, name)
    else
      local head = tick_at(blob, 1)
      if head > bound and nextb and head > nextb then
        redis.call('ZADD', o, string.format('%d', head), name)
      else
        local p = 1 + ENTRY
        k = k - 1
        while k > 0 and p <= #blob and (not nextb or tick_at(blob, p) < nextb) do
          p = p + ENTRY
          k = k - 1
        end
        st.n = st.n - (p - 1) / ENTRY
        put(name, string.sub(blob, p))
      end
    end
  end
end
"""
)

# Store chains on one node, in order; mirrors ``NodeBlocks.store`` exactly.
# A chain from the root takes ticks from the rising ``t`` (root highest, so a parent is always
# more recent than its children): its entries leave their place and are appended to their
# buckets. A fragment after a parent adds only its new blocks, below every tick, from the
# falling ``l``: prepended, deepest first.
# KEYS[1] meta HASH, KEYS[2] blocks HASH, KEYS[3] bucket ZSET. ARGV[1] capacity if the node has
# none yet, ARGV[2] TTL seconds, ARGV[3] 'r' = replace (clear first) or 's', ARGV[4] epoch token
# if the node has none yet, ARGV[5..] pairs (parent member or '' for the root, packed chain).
# Returns 1/0 per pair, then the node's epoch.
STORE_LUA = (
    _NODE_PRELUDE
    + """
open_node(tonumber(ARGV[2]), ARGV[1], ARGV[4])
if ARGV[3] == 'r' then clear_buckets() end
local out = {}
for i = 5, #ARGV, 2 do
  local parent, blob = ARGV[i], ARGV[i + 1]
  local pb = parent ~= '' and redis.call('HGET', h, bucket_name(bucket_of(parent)))
  if parent ~= '' and not (pb and find_entry(pb, parent)) then
    out[#out + 1] = 0
  else
    out[#out + 1] = 1
    if st.cap > 0 then
      local n = math.min(#blob / 8, st.cap)
      local protect = 0
      if n > 0 then
        grow_for(st.n + n)
        local chain = parent == ''
        local base
        if chain then
          base = redis.call('HINCRBY', m, 't', n) + 1  -- block j (root = 1) gets base - j
          protect = n
        else
          base = redis.call('HINCRBY', m, 'l', -n) + n  -- block j gets base - j: deepest lowest
        end
        local groups, order, seen = {}, {}, {}
        local size, split = st.size, st.s
        for j = n, 1, -1 do  -- ascending ticks
          local pos = j * 8 - 7
          local mem = string.sub(blob, pos, pos + 7)
          if not seen[mem] then  -- a hash twice in one chain (never from chained hashes): once
            seen[mem] = true
            local b1, b2, b3, b4 = string.byte(blob, pos, pos + 3)  -- bucket_of, inlined
            local v = b1 + 256 * (b2 + 256 * (b3 + 256 * b4))
            local a = v % size
            if a < split then a = v % (size * 2) end
            local name = names[a] or bucket_name(a)
            local g = groups[name]
            if not g then
              g = {}
              groups[name] = g
              order[#order + 1] = name
            end
            g[#g + 1] = mem
            g[#g + 1] = base - j
          end
        end
        local blobs = chunked('HMGET', h, order)
        local writes, bounds = {}, {}
        for q, name in ipairs(order) do
          local old = blobs[q] or ''
          local g, parts, cuts, np = groups[name], {}, {}, 0
          for x = 1, #g, 2 do
            local mem = g[x]
            local p = string.find(old, mem, 1, true)
            while p and (p - 1) % ENTRY ~= 0 do p = string.find(old, mem, p + 1, true) end
            if chain or not p then  -- a fragment: held blocks keep their place
              if p then cuts[#cuts + 1] = p else st.n = st.n + 1 end
              local hi6, lo6 = tick_parts(g[x + 1])
              parts[np + 1], parts[np + 2], parts[np + 3] = mem, hi6, lo6
              np = np + 3
            end
          end
          local new
          if not chain then
            parts[np + 1] = old
            new = table.concat(parts)
          elseif #cuts == 0 then
            new = old .. table.concat(parts)
          else  -- the re-touched entries leave their place: one concatenation of what stays
            table.sort(cuts)
            local pieces, from = {}, 1
            for _, p in ipairs(cuts) do
              pieces[#pieces + 1] = string.sub(old, from, p - 1)
              from = p + ENTRY
            end
            pieces[#pieces + 1] = string.sub(old, from)
            for k = 1, np do pieces[#pieces + 1] = parts[k] end
            new = table.concat(pieces)
          end
          writes[#writes + 1] = name
          writes[#writes + 1] = new
          if not chain or #old == 0 then  -- a chain only raises ticks: other bounds stay valid
            bounds[#bounds + 1] = string.format('%d', tick_at(new, 1))
            bounds[#bounds + 1] = name
          end
        end
        chunked('HSET', h, writes)
        for c = 1, #bounds, 1000 do
          redis.call('ZADD', o, 'LT', unpack(bounds, c, math.min(c + 999, #bounds)))
        end
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

# KEYS[1] meta HASH, KEYS[2] blocks HASH, KEYS[3] bucket ZSET; ARGV[1] capacity (>= 0), ARGV[2]
# TTL seconds, ARGV[3] epoch token if the node has none yet. Returns the node's epoch.
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

# KEYS[1] meta HASH, KEYS[2] blocks HASH, KEYS[3] bucket ZSET; ARGV[1] TTL seconds, ARGV[2]
# packed hashes (a closed set, no duplicates). Returns how many of them the node held.
REMOVE_LUA = (
    _NODE_PRELUDE
    + """
if not open_node(tonumber(ARGV[1]), nil, nil) then return 0 end
local blob = ARGV[2]
local groups, order = {}, {}
for j = 1, #blob / 8 do
  local mem = string.sub(blob, j * 8 - 7, j * 8)
  local name = bucket_name(bucket_of(mem))
  local g = groups[name]
  if not g then
    g = {}
    groups[name] = g
    order[#order + 1] = name
  end
  g[#g + 1] = mem
end
local blobs = chunked('HMGET', h, order)
local removed = 0
for q, name in ipairs(order) do
  local old = blobs[q]
  if old then
    local before = #old
    for _, mem in ipairs(groups[name]) do
      local p = find_entry(old, mem)
      if p then
        old = string.sub(old, 1, p - 1) .. string.sub(old, p + ENTRY)
        removed = removed + 1
      end
    end
    if #old ~= before then
      if #old == 0 then
        redis.call('HDEL', h, name)
        redis.call('ZREM', o, name)
      else
        redis.call('HSET', h, name, old)  -- the bound stays a lower bound: only blocks left
      end
    end
  end
end
st.n = st.n - removed
close_node()
return removed
"""
)

# KEYS[1] meta HASH, KEYS[2] blocks HASH, KEYS[3] bucket ZSET. Forget every block (capacity and
# epoch stay). Returns how many blocks the node held.
CLEAR_LUA = (
    _NODE_PRELUDE
    + """
if not open_node(3600, nil, nil) then return 0 end
local n = clear_buckets()
redis.call('HSET', m, 'L', 0, 's', 0, 'n', 0)
return n
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
