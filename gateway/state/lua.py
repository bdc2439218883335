"""The Lua scripts of ``RedisState``: each change of shared state is one script, so it is atomic.

Every script touches one key family, and every key of a family carries the family's hash tag
(``{docs}``, ``{pins}``, ``{nodes}``, ``{usage}``), so on a Redis Cluster a family lives in one
slot and its scripts run there. Keys a script reaches by name (another tenant's keys during
clean-up) are in the same slot. Times are the server's (``TIME``, milliseconds): every replica
reads the same clock; the rate limits' scripts alone take the caller's, as their pure twin does.
"""

from __future__ import annotations

_NOW = """
local _t = redis.call('TIME')
local now = tonumber(_t[1]) * 1000 + math.floor(tonumber(_t[2]) / 1000)
"""

# Documents. KEYS: 1 d:<tenant> (id -> text), 2 c:<tenant> (id -> cost), 3 bytes (tenant ->
# bytes), 4 seen (tenant -> expiry ms), 5 total (bytes of all tenants).
# A tenant's documents expire together ``ttl`` after they were last registered or used; the
# first put after that forgets them (and their bytes). The keys themselves expire ``grace``
# later, should no put come.
_DOC_TOUCH = """
local function touch(tenant, ttl, grace)
  local exp = now + ttl
  redis.call('ZADD', KEYS[4], exp, tenant)
  redis.call('PEXPIREAT', KEYS[1], exp + grace)
  redis.call('PEXPIREAT', KEYS[2], exp + grace)
  local last = redis.call('ZRANGE', KEYS[4], -1, -1, 'WITHSCORES')
  local until_all = tonumber(last[2]) + grace
  redis.call('PEXPIREAT', KEYS[3], until_all)
  redis.call('PEXPIREAT', KEYS[4], until_all)
  if redis.call('EXISTS', KEYS[5]) == 1 then redis.call('PEXPIREAT', KEYS[5], until_all) end
end
"""

# ARGV: tenant, id, text, cost, count limit, tenant bytes limit, total limit, ttl ms, grace ms,
# tenant overhead, key prefix of the family (to clear expired tenants).
DOC_PUT = (
    _NOW
    + _DOC_TOUCH
    + """
local function forget(t)
  local b = tonumber(redis.call('HGET', KEYS[3], t) or '0')
  redis.call('DECRBY', KEYS[5], b)
  redis.call('HDEL', KEYS[3], t)
  redis.call('ZREM', KEYS[4], t)
  redis.call('DEL', ARGV[11] .. 'd:' .. t, ARGV[11] .. 'c:' .. t)
end
for _, t in ipairs(redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now, 'LIMIT', 0, 32)) do forget(t) end
local tenant, id, cost = ARGV[1], ARGV[2], tonumber(ARGV[4])
local own = redis.call('ZSCORE', KEYS[4], tenant)
if own and tonumber(own) <= now then forget(tenant) end
local old = redis.call('HGET', KEYS[2], id)
local freed = tonumber(old or '0')
if cost > tonumber(ARGV[6]) then return {'too_large', cost} end
local held = redis.call('HLEN', KEYS[2])
local count = held
if not old then count = held + 1 end
if count > tonumber(ARGV[5]) then return {'count', held} end
local prior = tonumber(redis.call('HGET', KEYS[3], tenant) or '0')
local base = prior
if base == 0 then base = tonumber(ARGV[10]) end
local tenant_bytes = base - freed + cost
if tenant_bytes > tonumber(ARGV[6]) then return {'bytes', tenant_bytes} end
local stored = tonumber(redis.call('GET', KEYS[5]) or '0')
local total = stored - prior + tenant_bytes
if total > tonumber(ARGV[7]) then return {'full', stored} end
redis.call('HSET', KEYS[1], id, ARGV[3])
redis.call('HSET', KEYS[2], id, cost)
redis.call('HSET', KEYS[3], tenant, tenant_bytes)
redis.call('SET', KEYS[5], total)
touch(tenant, tonumber(ARGV[8]), tonumber(ARGV[9]))
return {'ok', 0}
"""
)

# ARGV: tenant, ttl ms, grace ms, ids... -> texts (false where absent); a hit keeps them alive.
DOC_GET = (
    _NOW
    + _DOC_TOUCH
    + """
local ids = {}
for i = 4, #ARGV do ids[#ids + 1] = ARGV[i] end
local exp = redis.call('ZSCORE', KEYS[4], ARGV[1])
if not exp or tonumber(exp) <= now then  -- expired (or never registered): none of them
  local none = {}
  for i = 1, #ids do none[i] = false end
  return none
end
local vals = redis.call('HMGET', KEYS[1], unpack(ids))
for _, v in ipairs(vals) do
  if v then
    touch(ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]))
    break
  end
end
return vals
"""
)

# ARGV: tenant, id -> 1 deleted, 0 absent.
DOC_DELETE = """
local tenant, id = ARGV[1], ARGV[2]
local cost = redis.call('HGET', KEYS[2], id)
if not cost then return 0 end
redis.call('HDEL', KEYS[1], id)
redis.call('HDEL', KEYS[2], id)
if redis.call('HLEN', KEYS[2]) == 0 then
  local b = tonumber(redis.call('HGET', KEYS[3], tenant) or '0')
  redis.call('DECRBY', KEYS[5], b)
  redis.call('HDEL', KEYS[3], tenant)
  redis.call('ZREM', KEYS[4], tenant)
  redis.call('DEL', KEYS[1], KEYS[2])
else
  redis.call('HINCRBY', KEYS[3], tenant, -tonumber(cost))
  redis.call('DECRBY', KEYS[5], tonumber(cost))
end
return 1
"""

# Pins. KEYS: 1 t:<tenant> (ZSET "node|hash" -> until ms), 2 tenants (ZSET tenant -> last until).
# ARGV: tenant, seconds ms, total limit, node count n, n pairs (node, limit), hashes...
# -> {'ok', until, previous until or '' per node per hash} | {'node'|'total', node, after, limit,
# first expiry or -1, now}.
PIN_RESERVE = (
    _NOW
    + """
local key = KEYS[1]
local until_ms = now + tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
local all = redis.call('ZRANGE', key, 0, -1, 'WITHSCORES')
local held, per, first = {}, {}, {}
local total, first_all = 0, nil
for i = 1, #all, 2 do
  local m, sc = all[i], tonumber(all[i + 1])
  held[m] = sc
  local node = string.match(m, '^(.*)|[^|]*$')
  per[node] = (per[node] or 0) + 1
  if not first[node] or sc < first[node] then first[node] = sc end
  if not first_all or sc < first_all then first_all = sc end
  total = total + 1
end
local nn = tonumber(ARGV[4])
local h0 = 5 + 2 * nn
for j = 0, nn - 1 do
  local node, limit = ARGV[5 + 2 * j], tonumber(ARGV[6 + 2 * j])
  local before = per[node] or 0
  local after = before
  for i = h0, #ARGV do
    if not held[node .. '|' .. ARGV[i]] then after = after + 1 end
  end
  if after > limit then return {'node', node, after, limit, tostring(first[node] or -1), tostring(now)} end
  total = total + after - before
end
if total > tonumber(ARGV[3]) then
  return {'total', '', total, tonumber(ARGV[3]), tostring(first_all or -1), tostring(now)}
end
local out = {'ok', tostring(until_ms)}
for j = 0, nn - 1 do
  local node = ARGV[5 + 2 * j]
  for i = h0, #ARGV do
    local m = node .. '|' .. ARGV[i]
    local old = held[m]
    if old then out[#out + 1] = tostring(old) else out[#out + 1] = '' end
    if not old or old < until_ms then redis.call('ZADD', key, until_ms, m) end
  end
end
local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
local max_until = tonumber(last[2])
redis.call('PEXPIREAT', key, max_until)
local cur = tonumber(redis.call('ZSCORE', KEYS[2], ARGV[1]) or '0')
if max_until > cur then redis.call('ZADD', KEYS[2], max_until, ARGV[1]) end
local last_t = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')
redis.call('PEXPIREAT', KEYS[2], tonumber(last_t[2]))
return out
"""
)

# KEYS: 1 t:<tenant>. ARGV: node, granted until ms, then (hash, previous until or '') pairs.
# Only entries still at the granted time go back: a later pin of the tenant holds the others.
PIN_CANCEL = """
for i = 3, #ARGV, 2 do
  local m = ARGV[1] .. '|' .. ARGV[i]
  local cur = redis.call('ZSCORE', KEYS[1], m)
  if cur and tonumber(cur) == tonumber(ARGV[2]) then
    if ARGV[i + 1] == '' then
      redis.call('ZREM', KEYS[1], m)
    else
      redis.call('ZADD', KEYS[1], ARGV[i + 1], m)
    end
  end
end
return 1
"""

# KEYS: 1 tenants. ARGV: key prefix of tenant keys, tenant ('' with ARGV[3]=='0': every tenant),
# only-this-tenant flag -> flat (tenant, node, blocks, last until, first until)...
PIN_LIST = (
    _NOW
    + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local tenants
if ARGV[3] == '1' then tenants = {ARGV[2]} else tenants = redis.call('ZRANGE', KEYS[1], 0, -1) end
local out = {}
for _, tn in ipairs(tenants) do
  local all = redis.call('ZRANGEBYSCORE', ARGV[1] .. tn, '(' .. now, '+inf', 'WITHSCORES')
  local agg, order = {}, {}
  for i = 1, #all, 2 do
    local node = string.match(all[i], '^(.*)|[^|]*$')
    local sc = tonumber(all[i + 1])
    local a = agg[node]
    if not a then
      a = {0, sc, sc}
      agg[node] = a
      order[#order + 1] = node
    end
    a[1] = a[1] + 1
    if sc > a[2] then a[2] = sc end
    if sc < a[3] then a[3] = sc end
  end
  for _, node in ipairs(order) do
    local a = agg[node]
    out[#out + 1] = tn
    out[#out + 1] = node
    out[#out + 1] = a[1]
    out[#out + 1] = tostring(a[2])
    out[#out + 1] = tostring(a[3])
  end
end
return out
"""
)

# Membership. KEYS: 1 members (address -> JSON). ARGV: address, record, ttl ms, max entries.
MEMBER_PUT = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 and redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[4]) then
  return 0
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""

# ARGV: ttl ms. Every live replica reads them, which keeps them alive; once no replica is left
# they go after ``ttl``.
MEMBERS_GET = """
local all = redis.call('HGETALL', KEYS[1])
if #all > 0 then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
return all
"""

# Runtime switches. KEYS: 1 the record (JSON). ARGV: record, ttl ms. Kept alive by the replicas
# reading it (SWITCHES_GET), as the membership records are.
SWITCHES_PUT = """
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

# ARGV: ttl ms.
SWITCHES_GET = """
local record = redis.call('GET', KEYS[1])
if record then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
return record
"""

# Usage. KEYS: 1 tenants (SET). ARGV: key prefix of tenant keys, ttl ms, max tenants, then
# (tenant, model, requests, prompt, cached, output) groups -> groups refused (too many tenants).
USAGE_ADD = """
local dropped = 0
for i = 4, #ARGV, 6 do
  local tn = ARGV[i]
  if redis.call('SISMEMBER', KEYS[1], tn) == 0 and redis.call('SCARD', KEYS[1]) >= tonumber(ARGV[3]) then
    dropped = dropped + 1
  else
    redis.call('SADD', KEYS[1], tn)
    local k, m = ARGV[1] .. tn, ARGV[i + 1]
    redis.call('HINCRBY', k, m .. '|requests', ARGV[i + 2])
    redis.call('HINCRBY', k, m .. '|prompt_tokens', ARGV[i + 3])
    redis.call('HINCRBY', k, m .. '|cached_tokens', ARGV[i + 4])
    redis.call('HINCRBY', k, m .. '|output_tokens', ARGV[i + 5])
    redis.call('PEXPIRE', k, ARGV[2])
  end
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return dropped
"""

# ARGV: key prefix of tenant keys, tenant, only-this-tenant flag -> flat (tenant, field, value)...
USAGE_READ = """
local tenants
if ARGV[3] == '1' then tenants = {ARGV[2]} else tenants = redis.call('SMEMBERS', KEYS[1]) end
local out = {}
for _, tn in ipairs(tenants) do
  local all = redis.call('HGETALL', ARGV[1] .. tn)
  for i = 1, #all, 2 do
    out[#out + 1] = tn
    out[#out + 1] = all[i]
    out[#out + 1] = all[i + 1]
  end
end
return out
"""

# Rate limits (``gateway.scheduling.token_limits``, the same arithmetic). KEYS: the counters of
# one request (HASH second -> amount; one hash tag, one slot). ARGV: now ms (the caller's wall
# clock), window seconds, ttl ms, then (limit, cost) per key. Buckets older than the window are
# dropped first; then every counter is checked and, only if all fit, every one is charged.
# -> {1, bucket, used after...} | {0, index (1-based), used, retry ms or -1}.
_LIMIT_WINDOW = """
local now = tonumber(ARGV[1])
local window = tonumber(ARGV[2])
local sec = math.floor(now / 1000)
local first = sec - window + 1
local function load(key)
  local all = redis.call('HGETALL', key)
  local seconds, vals, used, stale = {}, {}, 0, {}
  for i = 1, #all, 2 do
    local b, v = tonumber(all[i]), tonumber(all[i + 1])
    if b < first then
      stale[#stale + 1] = all[i]
    else
      seconds[#seconds + 1] = b
      vals[b] = v
      used = used + v
    end
  end
  if #stale > 0 then redis.call('HDEL', key, unpack(stale)) end
  table.sort(seconds)
  return seconds, vals, used
end
"""

LIMIT_RESERVE = (
    _LIMIT_WINDOW
    + """
local worst, worst_used, worst_wait = 0, 0, -1
local used_all = {}
for i = 1, #KEYS do
  local limit, cost = tonumber(ARGV[2 + 2 * i]), tonumber(ARGV[3 + 2 * i])
  local seconds, vals, used = load(KEYS[i])
  used_all[i] = used
  if used + cost > limit then
    if cost > limit then return {0, i, used, -1} end
    local left = used
    local wait = -1
    for _, b in ipairs(seconds) do
      left = left - vals[b]
      if left + cost <= limit then
        wait = (b + window) * 1000 - now
        break
      end
    end
    if worst == 0 or wait > worst_wait then
      worst, worst_used, worst_wait = i, used, wait
    end
  end
end
if worst > 0 then return {0, worst, worst_used, worst_wait} end
local out = {1, sec}
for i = 1, #KEYS do
  redis.call('HINCRBY', KEYS[i], sec, ARGV[3 + 2 * i])
  redis.call('PEXPIRE', KEYS[i], ARGV[3])
  out[#out + 1] = used_all[i] + tonumber(ARGV[3 + 2 * i])
end
return out
"""
)

# KEYS: counters. ARGV: now ms, window seconds, bucket, then a delta per key: added to the bucket
# while it is in the window, never below 0.
LIMIT_SETTLE = """
local sec = math.floor(tonumber(ARGV[1]) / 1000)
local bucket = ARGV[3]
if tonumber(bucket) < sec - tonumber(ARGV[2]) + 1 then return 0 end
for i = 1, #KEYS do
  local delta = tonumber(ARGV[3 + i])
  local cur = redis.call('HGET', KEYS[i], bucket)
  if cur and delta ~= 0 then
    local v = tonumber(cur) + delta
    if v < 0 then v = 0 end
    redis.call('HSET', KEYS[i], bucket, v)
  end
end
return 1
"""

# KEYS: counters. ARGV: now ms, window seconds -> the use of each in the window.
LIMIT_USED = (
    _LIMIT_WINDOW
    + """
local out = {}
for i = 1, #KEYS do
  local _, _, used = load(KEYS[i])
  out[i] = used
end
return out
"""
)
