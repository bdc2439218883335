"""Key schema and Lua scripts of the Redis index (pure: names and text, no I/O).

Keys, under a configurable prefix ``P`` (``prefixgate:`` by default); ``{node}`` is a Redis Cluster
hash tag, so all of one node's keys live in one slot:

- ``P{node}:z:<b>`` — ZSET bucket ``b`` of the node's blocks: member = the block hash as 8 bytes
  little-endian, score = the node's LRU tick (higher = more recent); plus a sentinel member
  ``''`` at ``+inf`` so the bucket never empties (Redis would delete it, TTL and all). ``b`` is
  the hash modulo the node's bucket count ``n`` (a power of two sized from the capacity), so
  every bucket stays small enough for the compact listpack encoding (≈ 20 B/block instead of
  ≈ 104 in a skiplist).
- ``P{node}:b`` — ZSET of bucket minima: member = bucket id, score = a lower bound of the lowest
  tick in that bucket (``+inf`` when it holds no block; writes only lower it, eviction makes it
  exact before trusting it), so its head leads to the node's least recent block. It lists every
  bucket of the node (creation, clear, TTL refresh, listing).
- ``P{node}:m`` — HASH: ``c`` capacity in blocks, ``k`` blocks held, ``n`` bucket count, ``t``
  the rising LRU tick (chains from the root), ``l`` the falling tick (fragments enter as least
  recent), ``e`` unix time of the last TTL refresh of every bucket.
- ``Pnodes`` — ZSET registry of known nodes: member = node name, score = unix time of the last
  write; entries older than the TTL are ignored and pruned.

TTL: a bucket gets it when created, the minima ZSET at every write, and every bucket together
with the meta hash at most every ``ttl/8`` s. The meta hash thus never outlives a bucket: a node
whose meta is gone counts as empty, and the next write deletes what is left, so a partly
expired node is never visible. Block hashes already embed model, tenant salt and block size
(see ``hashing.py``), so tenants never share a member even though they share a node's keys.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_PREFIX = "prefixgate:"
DEFAULT_BUCKET_BLOCKS = 64
"""Blocks per bucket at full capacity (at most; 32-64): well under Redis'
``zset-max-listpack-entries`` (128 by default), so buckets stay listpack-encoded."""

_LE64 = struct.Struct("<Q")


def pack_hash(h: int) -> bytes:
    return _LE64.pack(h)


def pack_hashes(hashes: Sequence[int]) -> bytes:
    """Block hashes as one blob of 8-byte little-endian members (what the scripts slice)."""
    return struct.pack(f"<{len(hashes)}Q", *hashes)


def unpack_hash(member: bytes) -> int:
    value: int = _LE64.unpack(member)[0]
    return value


def bucket_count(capacity: int, bucket_blocks: int = DEFAULT_BUCKET_BLOCKS) -> int:
    """Buckets for a capacity: the smallest power of two >= capacity / bucket_blocks (1..65536).

    Mirrors ``nbuckets`` in the scripts; here for tests and tools.
    """
    want = -(-max(0, capacity) // max(1, bucket_blocks))
    n = 1
    while n < want and n < 65536:
        n *= 2
    return n


def bucket_of(h: int, buckets: int) -> int:
    """The bucket of a block hash (its low bits; ``buckets`` is a power of two <= 65536)."""
    return h & (buckets - 1)


def _escape(text: str) -> str:
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)


@dataclass(frozen=True, slots=True)
class KeySchema:
    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if "{" in self.prefix or "}" in self.prefix:
            raise ValueError("the key prefix must not contain '{' or '}' (they are the node's hash tag)")

    def bucket(self, node: str, b: int) -> str:
        return f"{self.prefix}{{{node}}}:z:{b}"

    def minima(self, node: str) -> str:
        return f"{self.prefix}{{{node}}}:b"

    def meta(self, node: str) -> str:
        return f"{self.prefix}{{{node}}}:m"

    def node_keys(self, node: str) -> tuple[str, str]:
        """The keys a node's scripts declare (the buckets derive from the meta key's name)."""
        return self.meta(node), self.minima(node)

    @property
    def registry(self) -> str:
        return f"{self.prefix}nodes"

    @property
    def pattern(self) -> str:
        """SCAN pattern matching every key of this prefix (glob characters escaped)."""
        return _escape(self.prefix) + "*"

    def node_pattern(self, node: str) -> str:
        """SCAN pattern matching every key of one node."""
        return _escape(f"{self.prefix}{{{node}}}:") + "*"


# Shared by every script: a node's key names derive from its meta key ``P{node}:m``
# (``P{node}:z:<b>`` buckets, ``P{node}:b`` minima); all share the ``{node}`` hash tag.
_COMMON = """
local function bucket_of(member, nb)
  local b1, b2 = string.byte(member, 1, 2)
  return (b1 + 256 * b2) % nb
end
local function node_base(m)
  return string.sub(m, 1, -2) .. 'z:'
end
"""

# Helpers of the write scripts. KEYS[1] meta HASH, KEYS[2] minima ZSET.
_WRITE = (
    _COMMON
    + """
local m, bz = KEYS[1], KEYS[2]
local base = node_base(m)
local function nbuckets(cap, per)
  local want = math.ceil(cap / per)
  local nb = 1
  while nb < want and nb < 65536 do nb = nb * 2 end
  return nb
end
local function drop_all()
  for _, id in ipairs(redis.call('ZRANGE', bz, 0, -1)) do redis.call('DEL', base .. id) end
  redis.call('DEL', bz)
end
-- a node without meta (new, expired, or written by the one-ZSET layout): delete leftovers
local function ensure(default_cap, per)
  if not redis.call('HGET', m, 'n') then
    drop_all()
    redis.call('DEL', string.sub(m, 1, -2) .. 'z')
    redis.call('HSETNX', m, 'c', default_cap)
    local cap = tonumber(redis.call('HGET', m, 'c'))
    redis.call('HSET', m, 'k', 0, 'n', nbuckets(cap, per), 'e', 0)
  end
end
-- A bucket is created once with a sentinel member '' at +inf, so it never empties (Redis would
-- delete it, TTL and all) and its TTL is set once; the minima ZSET lists every bucket (+inf when
-- it holds no block), which is how a write knows the bucket exists.
local function create_missing(ids, ttl)
  for i = 1, #ids, 500 do
    local chunk = {unpack(ids, i, math.min(i + 499, #ids))}
    local scores = redis.call('ZMSCORE', bz, unpack(chunk))
    for j, id in ipairs(chunk) do
      if not scores[j] then
        local key = base .. id
        redis.call('ZADD', key, 'NX', 'inf', '')
        redis.call('EXPIRE', key, ttl)
        redis.call('ZADD', bz, 'NX', 'inf', id)
      end
    end
  end
end
-- Members grouped by bucket: put() files (score, member) for ZADD or a bare member for ZREM;
-- apply() sends one command per bucket, in chunks (Lua's unpack has a stack limit). After
-- ZADD it lowers each bucket's entry in the minima ZSET to its lowest new score (one ZADD LT
-- for all buckets), so that entry stays a lower bound of the bucket's minimum; eviction checks
-- it before trusting it. Scores go to Redis as Lua numbers: integers, exact in a double.
local function new_batch()
  return {groups = {}, ids = {}, lows = {}}
end
local function put(batch, nb, score, member)
  local b1, b2 = string.byte(member, 1, 2)
  local id = (b1 + 256 * b2) % nb
  local g = batch.groups[id]
  if not g then
    g = {}
    batch.groups[id] = g
    batch.ids[#batch.ids + 1] = id
    batch.lows[id] = score
  end
  if score then
    g[#g + 1] = score
    if score < batch.lows[id] then batch.lows[id] = score end
  end
  g[#g + 1] = member
end
local function apply(batch, cmd, flag, ttl)
  local changed = 0
  if cmd == 'ZADD' then create_missing(batch.ids, ttl) end
  local args = {}
  for _, id in ipairs(batch.ids) do
    local key, g = base .. id, batch.groups[id]
    for i = 1, #g, 1000 do
      local chunk = g
      if #g > 1000 then chunk = {unpack(g, i, math.min(i + 999, #g))} end
      if flag then
        changed = changed + redis.call(cmd, key, flag, unpack(chunk))
      else
        changed = changed + redis.call(cmd, key, unpack(chunk))
      end
    end
    if cmd == 'ZADD' then
      args[#args + 1] = batch.lows[id]
      args[#args + 1] = id
      if #args >= 1000 then redis.call('ZADD', bz, 'LT', unpack(args)); args = {} end
    end
  end
  if #args > 0 then redis.call('ZADD', bz, 'LT', unpack(args)) end
  return changed
end
-- pop the `count` least recent blocks of the node: the bucket at the head of the minima ZSET
-- once its entry is exact (else correct it and look again), as long as its head stays below
-- the next bucket's entry
local function evict(count)
  local popped = 0
  while count > 0 do
    local low = redis.call('ZRANGE', bz, 0, 1, 'WITHSCORES')
    if not low[1] or tonumber(low[2]) == math.huge then break end
    local id, key = low[1], base .. low[1]
    local head = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
    if not head[1] then
      redis.call('ZREM', bz, id)
    elseif tonumber(head[2]) ~= tonumber(low[2]) then
      redis.call('ZADD', bz, head[2], id)
    else
      local bound = low[4] and tonumber(low[4]) or math.huge
      repeat
        redis.call('ZPOPMIN', key, 1)
        count = count - 1
        popped = popped + 1
        head = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
      until count == 0 or not head[1] or head[1] == '' or tonumber(head[2]) > bound
      if head[1] then redis.call('ZADD', bz, head[2], id) else redis.call('ZREM', bz, id) end
    end
  end
  return popped
end
-- TTL: the minima every write; every bucket (each got one when created) and the meta together,
-- at most every ttl/8 s, so the meta never outlives a bucket
local function expire_all(ttl, force)
  local now = tonumber(redis.call('TIME')[1])
  local last = tonumber(redis.call('HGET', m, 'e') or '0')
  if force or now - last >= math.floor(ttl / 8) then
    for _, id in ipairs(redis.call('ZRANGE', bz, 0, -1)) do redis.call('EXPIRE', base .. id, ttl) end
    redis.call('HSET', m, 'e', now)
    redis.call('EXPIRE', m, ttl)
  end
  redis.call('EXPIRE', bz, ttl)
end
"""
)

# Leading run per node by binary search over the prompt's blob (prefix-closed sets): each
# probe is one ZSCORE on the member's bucket. A node without meta counts 0.
# KEYS: the nodes' meta HASHes. ARGV[1]: packed hashes. Returns one integer per key.
LOOKUP_LUA = (
    _COMMON
    + """
local blob = ARGV[1]
local n = #blob / 8
local out = {}
for k = 1, #KEYS do
  local nb = tonumber(redis.call('HGET', KEYS[k], 'n') or '0')
  local run = 0
  if n > 0 and nb > 0 then
    local base = node_base(KEYS[k])
    local function held(i)
      local member = string.sub(blob, i * 8 - 7, i * 8)
      return redis.call('ZSCORE', base .. bucket_of(member, nb), member)
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

# Store chains on one node, in order; mirrors ``NodeBlocks.store`` exactly.
# A chain from the root takes scores from the rising tick ``t`` (touched in reverse, root last);
# a fragment after a parent adds only its new blocks, below every score, from the falling tick ``l``.
# ARGV[1] default capacity, ARGV[2] TTL seconds, ARGV[3] 'r' = replace (clear first) or 's',
# ARGV[4] blocks per bucket, ARGV[5..] pairs (parent member or '' for the root, packed chain).
# Returns 1/0 per pair.
STORE_LUA = (
    _WRITE
    + """
local ttl = tonumber(ARGV[2])
ensure(ARGV[1], tonumber(ARGV[4]))
local cap = tonumber(redis.call('HGET', m, 'c'))
local nb = tonumber(redis.call('HGET', m, 'n'))
local size = tonumber(redis.call('HGET', m, 'k'))
if ARGV[3] == 'r' then drop_all(); size = 0 end
local out = {}
for i = 5, #ARGV, 2 do
  local parent, blob = ARGV[i], ARGV[i + 1]
  if parent ~= '' and not redis.call('ZSCORE', base .. bucket_of(parent, nb), parent) then
    out[#out + 1] = 0
  else
    out[#out + 1] = 1
    if cap > 0 then
      local n = math.min(#blob / 8, cap)
      local protect = 0
      if n > 0 then
        local batch = new_batch()
        if parent == '' then
          -- touch in reverse (root last): a parent is always more recent than its children
          local top = redis.call('HINCRBY', m, 't', n)
          local score = top - n
          for j = n, 1, -1 do
            score = score + 1
            put(batch, nb, score, string.sub(blob, j * 8 - 7, j * 8))
          end
          size = size + apply(batch, 'ZADD', nil, ttl)
          protect = n
        else
          -- new blocks enter as the least recent, deepest lowest; held ones keep their score
          local low = redis.call('HINCRBY', m, 'l', -n)
          local score = low + n
          for j = 1, n do
            score = score - 1
            put(batch, nb, score, string.sub(blob, j * 8 - 7, j * 8))
          end
          size = size + apply(batch, 'ZADD', 'NX', ttl)
        end
      end
      -- evict least recent first (leaves before parents), never the chain just stored
      local k = math.min(size - cap, size - protect)
      if k > 0 then size = size - evict(k) end
    end
  end
end
redis.call('HSET', m, 'k', size)
expire_all(ttl, false)
return out
"""
)

# ARGV[1] capacity (>= 0), ARGV[2] TTL seconds, ARGV[3] default capacity, ARGV[4] blocks per
# bucket. Evicts the overflow, then re-buckets if the bucket count changes. Returns the evicted.
SET_CAPACITY_LUA = (
    _WRITE
    + """
local cap, ttl, per = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[4])
ensure(ARGV[3], per)
redis.call('HSET', m, 'c', cap)
local size = tonumber(redis.call('HGET', m, 'k'))
local k = size - cap
if k > 0 then size = size - evict(k) end
redis.call('HSET', m, 'k', size)
local nb = nbuckets(cap, per)
if nb ~= tonumber(redis.call('HGET', m, 'n')) then
  local batch = new_batch()
  for _, id in ipairs(redis.call('ZRANGE', bz, 0, -1)) do
    local pairs_ = redis.call('ZRANGE', base .. id, 0, -1, 'WITHSCORES')
    for j = 1, #pairs_, 2 do
      if pairs_[j] ~= '' then put(batch, nb, tonumber(pairs_[j + 1]), pairs_[j]) end
    end
  end
  drop_all()
  redis.call('HSET', m, 'n', nb)
  apply(batch, 'ZADD', nil, ttl)
end
expire_all(ttl, true)
return math.max(k, 0)
"""
)

# ARGV[1] TTL seconds, ARGV[2] packed hashes (distinct). Returns the number removed.
REMOVE_LUA = (
    _WRITE
    + """
local nb = tonumber(redis.call('HGET', m, 'n') or '0')
if nb == 0 then return 0 end
local blob, batch = ARGV[2], new_batch()
for j = 1, #blob / 8 do put(batch, nb, nil, string.sub(blob, j * 8 - 7, j * 8)) end
local removed = apply(batch, 'ZREM', nil, 0)
redis.call('HINCRBY', m, 'k', 0 - removed)  -- not -removed: Lua prints -0
expire_all(tonumber(ARGV[1]), false)
return removed
"""
)

# Drops every block of the node (capacity and ticks stay). Returns the number dropped.
CLEAR_LUA = (
    _WRITE
    + """
local held = tonumber(redis.call('HGET', m, 'k') or '0')
drop_all()
if redis.call('HGET', m, 'n') then redis.call('HSET', m, 'k', 0) else held = 0 end
return held
"""
)

# Every member the node holds (any order); none when its meta is gone.
MEMBERS_LUA = (
    _WRITE
    + """
local out = {}
if not redis.call('HGET', m, 'n') then return out end
for _, id in ipairs(redis.call('ZRANGE', bz, 0, -1)) do
  for _, member in ipairs(redis.call('ZRANGE', base .. id, 0, -1)) do
    if member ~= '' then out[#out + 1] = member end
  end
end
return out
"""
)
