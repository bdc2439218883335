"""``StateStore`` on Redis (single or Cluster): what every gateway replica shares.

Keys (``P`` is ``redis_prefix``; each family has one hash tag, so on a Cluster it lives in one
slot and its Lua scripts, ``gateway.state.lua``, are atomic):

- documents: ``P{docs}:d:<tenant>`` (id -> text), ``P{docs}:c:<tenant>`` (id -> bytes counted),
  ``P{docs}:bytes`` (tenant -> bytes), ``P{docs}:seen`` (tenant -> expiry), ``P{docs}:total``;
  a tenant's documents expire ``document_ttl_s`` after they were last registered or used;
- pins: ``P{pins}:t:<tenant>`` (``node|hash`` -> until), ``P{pins}:tenants``; a pin's entry
  goes when the pin ends, a tenant's key when its last pin does;
- membership: ``P{nodes}:members`` (address -> JSON); kept alive by the replicas reading it,
  gone ``membership_ttl_s`` after the last one stopped; the runtime switches, ``P{nodes}:switches``
  (JSON: the values and the time of the change), likewise;
- usage: ``P{usage}:t:<tenant>`` (``model|counter`` -> count), ``P{usage}:tenants``;
  ``usage_ttl_s`` after the last write;
- rate limits: ``P{rl:<digest of tenant>}:<counter>`` (second -> amount, one hash per counter,
  at most 60 fields): a tenant's counters share one tag, so the one script that checks and
  reserves a request's counters runs in one slot; a counter expires ``LIMIT_TTL_MS`` after its
  last reservation. Their clock is the caller's (wall clock, ``now_ms``), not the server's:
  the replicas' clocks must agree to within a bucket (NTP), as the window's buckets are seconds.

Single Redis or Cluster is asked of the server on first use (``INFO cluster``), as the index does.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import orjson
import redis.asyncio as aioredis
import xxhash
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError, RedisError

from prefixgate.cachetier.redis_clients import connect, connect_cluster, is_cluster
from prefixgate.gateway.core.errors import Unavailable
from prefixgate.gateway.scheduling.token_limits import WINDOW_S, Check, Granted, Outcome, Refused
from prefixgate.gateway.state import lua as state_lua
from prefixgate.gateway.state.documents import (
    TENANT_OVERHEAD,
    DocumentLimits,
    bytes_exceeded,
    count_exceeded,
    store_full,
    too_large,
)
from prefixgate.gateway.state.quotas import PinLimits, node_quota_exceeded, too_long, total_quota_exceeded
from prefixgate.gateway.state.store import (
    DocumentUsage,
    Member,
    PinHold,
    PinRow,
    UsageCounts,
    UsageKey,
)

Client = aioredis.Redis | RedisCluster
GRACE_MS = 60_000  # keys outlive their expiry this long, so the next put clears them itself
MAX_MEMBERS = 4096
MAX_USAGE_TENANTS = 100_000
LIMIT_TTL_MS = (WINDOW_S + 5) * 1000  # an idle counter is gone once its window is empty


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _hex(h: int) -> str:
    return f"{h:016x}"


def _first_expiry(first_ms: str, now_ms: str) -> float | None:
    first = int(float(first_ms))
    return None if first < 0 else max(1.0, (first - int(float(now_ms))) / 1000)


class RedisState:
    backend = "redis"

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "prefixgate:",
        document_ttl_s: float = 7 * 24 * 3600.0,
        membership_ttl_s: float = 60.0,
        usage_ttl_s: float = 90 * 24 * 3600.0,
        max_connections: int = 16,
        timeout: float = 2.0,
    ) -> None:
        self.url = url
        self.prefix = prefix
        self.document_ttl_ms = _ms(document_ttl_s)
        self.membership_ttl_ms = _ms(membership_ttl_s)
        self.usage_ttl_ms = _ms(usage_ttl_s)
        self._max_connections = max_connections
        self._timeout = timeout
        self._client: Client | None = None
        self._lock = asyncio.Lock()
        self._shas = {text: hashlib.sha1(text.encode()).hexdigest() for text in _SCRIPTS}

    # -- keys ----------------------------------------------------------------------------------

    def docs(self, rest: str) -> str:
        return f"{self.prefix}{{docs}}:{rest}"

    def pins_key(self, rest: str) -> str:
        return f"{self.prefix}{{pins}}:{rest}"

    def nodes_key(self, rest: str) -> str:
        return f"{self.prefix}{{nodes}}:{rest}"

    def usage_key(self, rest: str) -> str:
        return f"{self.prefix}{{usage}}:{rest}"

    def limit_key(self, tenant: str, counter: str) -> str:
        """A tenant's counter; the tag is a digest, so no tenant name can break it (a ``}``)."""
        tag = xxhash.xxh64_hexdigest(tenant.encode("utf-8", "surrogatepass"))
        return f"{self.prefix}{{rl:{tag}}}:{counter}"

    def _doc_keys(self, tenant: str) -> list[str]:
        return [
            self.docs(f"d:{tenant}"),
            self.docs(f"c:{tenant}"),
            self.docs("bytes"),
            self.docs("seen"),
            self.docs("total"),
        ]

    # -- connection and scripts ----------------------------------------------------------------

    async def client(self) -> Client:
        """The client, deciding single Redis or Cluster on first use."""
        if self._client is not None:
            return self._client
        async with self._lock:
            if self._client is None:
                # the clients the index uses: commands never cancelled mid-flight
                single = connect(self.url, max_connections=self._max_connections, timeout=self._timeout)
                if await is_cluster(single):
                    await single.aclose()
                    self._client = connect_cluster(
                        self.url, max_connections=self._max_connections, timeout=self._timeout
                    )
                else:
                    self._client = single
        return self._client

    async def _run(self, script: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """One script call; Redis unreachable or failing is ``Unavailable`` (a 503 with
        Retry-After for a request that needed it, a retry later for background work)."""
        try:
            client = await self.client()
            sha = self._shas[script]
            try:
                return await client.evalsha(sha, len(keys), *keys, *args)  # type: ignore[misc]
            except NoScriptError:
                return await client.eval(script, len(keys), *keys, *args)  # type: ignore[misc]
        except (RedisError, OSError, TimeoutError) as e:
            raise Unavailable(f"the shared state store (Redis) failed: {e!r}"[:300], retry_after=2) from e

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # -- documents -----------------------------------------------------------------------------

    async def doc_put(self, tenant: str, doc_id: str, text: str, cost: int, limits: DocumentLimits) -> None:
        args = [
            tenant,
            doc_id,
            text,
            cost,
            limits.per_tenant_count,
            limits.per_tenant_bytes,
            limits.total_bytes,
            self.document_ttl_ms,
            GRACE_MS,
            TENANT_OVERHEAD,
            self.docs(""),
        ]
        verdict, figure = await self._run(state_lua.DOC_PUT, self._doc_keys(tenant), args)
        verdict = verdict.decode() if isinstance(verdict, bytes) else verdict
        if verdict == "too_large":
            raise too_large(int(figure), limits)
        if verdict == "count":
            raise count_exceeded(int(figure))
        if verdict == "bytes":
            raise bytes_exceeded(int(figure), limits)
        if verdict == "full":
            raise store_full(int(figure), limits)

    async def doc_get(self, tenant: str, doc_ids: Sequence[str]) -> list[str | None]:
        if not doc_ids:
            return []
        args = [tenant, self.document_ttl_ms, GRACE_MS, *doc_ids]
        raw = await self._run(state_lua.DOC_GET, self._doc_keys(tenant), args)
        return [v.decode() if isinstance(v, bytes) else None for v in raw]

    async def doc_delete(self, tenant: str, doc_id: str) -> bool:
        return bool(await self._run(state_lua.DOC_DELETE, self._doc_keys(tenant), [tenant, doc_id]))

    async def doc_usage(self, tenant: str) -> DocumentUsage:
        try:
            client = await self.client()
            count = await client.hlen(self.docs(f"c:{tenant}"))  # type: ignore[misc]
            held = await client.hget(self.docs("bytes"), tenant)  # type: ignore[misc]
        except (RedisError, OSError, TimeoutError) as e:
            raise Unavailable(f"the shared state store (Redis) failed: {e!r}"[:300], retry_after=2) from e
        return DocumentUsage(int(count), int(held or 0))

    # -- pins ----------------------------------------------------------------------------------

    async def pin_reserve(
        self,
        tenant: str,
        capacities: Mapping[str, int],
        hashes: Sequence[int],
        seconds: float,
        now: float,
        limits: PinLimits,
    ) -> PinHold:
        """As ``PinLedger.reserve``, against the server's clock (``now`` is not used)."""
        if seconds > limits.max_seconds:
            raise too_long(seconds, limits)
        hold = PinHold(tenant)
        if seconds <= 0 or not hashes or not capacities:
            return hold
        wanted = list(dict.fromkeys(hashes))
        nodes = list(capacities)
        args: list[Any] = [tenant, _ms(seconds), limits.blocks, len(nodes)]
        for node_id in nodes:
            args += [node_id, limits.node_limit(capacities[node_id])]
        args += [_hex(h) for h in wanted]
        keys = [self.pins_key(f"t:{tenant}"), self.pins_key("tenants")]
        out = [
            v.decode() if isinstance(v, bytes) else v
            for v in await self._run(state_lua.PIN_RESERVE, keys, args)
        ]
        if out[0] == "node":
            node_id, after, limit = out[1], int(out[2]), int(out[3])
            retry = _first_expiry(out[4], out[5]) if len(wanted) <= limit else None
            raise node_quota_exceeded(node_id, len(wanted), after, limit, capacities[node_id], limits, retry)
        if out[0] == "total":
            fits = len(wanted) * len(nodes) <= limits.blocks
            raise total_quota_exceeded(int(out[2]), limits, _first_expiry(out[4], out[5]) if fits else None)
        hold.until = int(out[1]) / 1000
        previous = iter(out[2:])
        for node_id in nodes:
            hold.before[node_id] = {
                h: (int(float(p)) / 1000 if p else None) for h, p in zip(wanted, previous, strict=False)
            }
        return hold

    async def pin_cancel(self, hold: PinHold, node_id: str) -> None:
        previous = hold.before.pop(node_id, None)
        if not previous:
            return
        args: list[Any] = [node_id, round(hold.until * 1000)]
        for h, until in previous.items():
            args += [_hex(h), "" if until is None else round(until * 1000)]
        await self._run(state_lua.PIN_CANCEL, [self.pins_key(f"t:{hold.tenant}")], args)

    async def pins(self, tenant: str | None, now: float) -> list[PinRow]:
        args = [self.pins_key("t:"), tenant or "", "1" if tenant is not None else "0"]
        raw = await self._run(state_lua.PIN_LIST, [self.pins_key("tenants")], args)
        vals = [v.decode() if isinstance(v, bytes) else v for v in raw]
        rows = []
        for i in range(0, len(vals), 5):
            t, node, blocks, last, first = vals[i : i + 5]
            rows.append(PinRow(t, node, int(blocks), int(float(last)) / 1000, int(float(first)) / 1000))
        return sorted(rows, key=lambda r: (r.tenant, r.node))

    # -- membership ----------------------------------------------------------------------------

    async def member_put(self, member: Member) -> None:
        fields: dict[str, Any] = {
            "role": member.role,
            "present": member.present,
            "draining": member.draining,
            "at": member.at,
        }
        if member.options:
            fields["options"] = dict(member.options)
        record = orjson.dumps(fields)
        args = [member.address, record, self.membership_ttl_ms, MAX_MEMBERS]
        await self._run(state_lua.MEMBER_PUT, [self.nodes_key("members")], args)

    async def members(self) -> list[Member]:
        raw = await self._run(state_lua.MEMBERS_GET, [self.nodes_key("members")], [self.membership_ttl_ms])
        out = []
        for i in range(0, len(raw), 2):
            address = raw[i].decode() if isinstance(raw[i], bytes) else raw[i]
            try:
                rec = orjson.loads(raw[i + 1])
                options = rec.get("options") or {}
                if not isinstance(options, dict):
                    continue
                out.append(
                    Member(
                        address,
                        str(rec["role"]),
                        bool(rec["present"]),
                        bool(rec["draining"]),
                        float(rec["at"]),
                        options,
                    )
                )
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                continue  # not ours: skipped, never applied
        return out

    # -- runtime switches ----------------------------------------------------------------------

    async def switches_put(self, values: Mapping[str, bool], at: float) -> None:
        record = orjson.dumps({"values": dict(values), "at": at})
        key = self.nodes_key("switches")
        await self._run(state_lua.SWITCHES_PUT, [key], [record, self.membership_ttl_ms])

    async def switches_get(self) -> tuple[dict[str, bool], float] | None:
        raw = await self._run(state_lua.SWITCHES_GET, [self.nodes_key("switches")], [self.membership_ttl_ms])
        if raw is None:
            return None
        try:
            rec = orjson.loads(raw)
            values = {str(k): bool(v) for k, v in dict(rec["values"]).items() if isinstance(v, bool)}
            return values, float(rec["at"])
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            return None  # not a record this gateway wrote: as if none

    # -- usage ---------------------------------------------------------------------------------

    async def usage_add(self, batch: Mapping[UsageKey, UsageCounts]) -> None:
        if not batch:
            return
        args: list[Any] = [self.usage_key("t:"), self.usage_ttl_ms, MAX_USAGE_TENANTS]
        for (tenant, model), c in batch.items():
            args += [tenant, model, *c.values()]
        await self._run(state_lua.USAGE_ADD, [self.usage_key("tenants")], args)

    async def usage(self, tenant: str | None) -> dict[UsageKey, UsageCounts]:
        args = [self.usage_key("t:"), tenant or "", "1" if tenant is not None else "0"]
        raw = await self._run(state_lua.USAGE_READ, [self.usage_key("tenants")], args)
        vals = [v.decode() if isinstance(v, bytes) else v for v in raw]
        out: dict[UsageKey, UsageCounts] = {}
        for i in range(0, len(vals), 3):
            t, field, value = vals[i : i + 3]
            model, _, counter = field.rpartition("|")
            counts = out.setdefault((t, model), UsageCounts())
            if counter in ("requests", "prompt_tokens", "cached_tokens", "output_tokens"):
                setattr(counts, counter, int(value))
        return out

    # -- rate limits ---------------------------------------------------------------------------

    async def limit_reserve(self, tenant: str, checks: Sequence[Check], now_ms: int) -> Outcome:
        keys = [self.limit_key(tenant, c.counter) for c in checks]
        args: list[Any] = [now_ms, WINDOW_S, LIMIT_TTL_MS]
        for c in checks:
            args += [c.limit, c.cost]
        out = [int(v) for v in await self._run(state_lua.LIMIT_RESERVE, keys, args)]
        if out[0] == 1:
            return Granted(out[1], tuple(out[2:]))
        return Refused(out[1] - 1, out[2], None if out[3] < 0 else out[3])

    async def limit_settle(
        self, tenant: str, deltas: Sequence[tuple[str, int]], bucket: int, now_ms: int
    ) -> None:
        if deltas:
            keys = [self.limit_key(tenant, c) for c, _ in deltas]
            args = [now_ms, WINDOW_S, bucket, *(d for _, d in deltas)]
            await self._run(state_lua.LIMIT_SETTLE, keys, args)

    async def limit_used(self, tenant: str, counters: Sequence[str], now_ms: int) -> list[int]:
        if not counters:
            return []
        keys = [self.limit_key(tenant, c) for c in counters]
        return [int(v) for v in await self._run(state_lua.LIMIT_USED, keys, [now_ms, WINDOW_S])]

    async def purge(self) -> int:
        """Delete every key of this prefix (tests, and an operator resetting a deployment); on a
        Cluster every primary is scanned. Returns how many keys went."""
        client = await self.client()
        keys = [k async for k in client.scan_iter(match=f"{self.prefix}*", count=1000)]
        for k in keys:  # one by one: on a Cluster they live in different slots
            await client.delete(k)
        return len(keys)


_SCRIPTS = (
    state_lua.DOC_PUT,
    state_lua.DOC_GET,
    state_lua.DOC_DELETE,
    state_lua.PIN_RESERVE,
    state_lua.PIN_CANCEL,
    state_lua.PIN_LIST,
    state_lua.MEMBER_PUT,
    state_lua.MEMBERS_GET,
    state_lua.SWITCHES_PUT,
    state_lua.SWITCHES_GET,
    state_lua.USAGE_ADD,
    state_lua.USAGE_READ,
    state_lua.LIMIT_RESERVE,
    state_lua.LIMIT_SETTLE,
    state_lua.LIMIT_USED,
)
