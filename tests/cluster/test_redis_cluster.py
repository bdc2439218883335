"""The index on a real Redis Cluster (3 masters, 3 replicas on loopback, started once here).

The contract suite runs against it, a gateway pointed at one cluster node routes by it, and a
master is killed under load: its replica takes over, no lookup fails, degraded mode comes and
goes, and the index is consistent after the resync. A last drill, on a cluster of its own,
loses a whole shard (master and replica) under load and gets it back empty.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
import structlog
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test
from redis.asyncio.cluster import RedisCluster

from prefixgate.bench import index_bench
from prefixgate.cachetier import open_index
from prefixgate.cachetier.index import BlockIndex, StoreOp
from prefixgate.cachetier.redis_clients import connect_cluster
from prefixgate.cachetier.redis_index import RedisIndex
from prefixgate.cachetier.resilient import ResilientIndex
from tests.cachetier.cancel_storm import LOST, cancel_storm, serves, settled, unhandled
from tests.cachetier.support import RedisClusterHarness, test_prefix
from tests.contract.test_index_contract import CAPACITY, IndexContract
from tests.faults.cluster import Cluster, Tally, drive
from tests.faults.drills import REPORT
from tests.shared_index.test_shared_index import doc_body, index_log_events, post

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[RedisClusterHarness]:
    harness = RedisClusterHarness().start()
    try:
        yield harness
    finally:
        harness.stop()


async def test_a_plain_url_to_any_node_finds_the_cluster(redis_cluster: RedisClusterHarness) -> None:
    url = f"redis://127.0.0.1:{redis_cluster.ports[-1]}"  # a replica, even
    index = open_index(url, prefix=test_prefix(), lookup_timeout=1.0)
    assert isinstance(index, ResilientIndex) and isinstance(index.primary, RedisIndex)
    try:
        nodes = [f"node-{i}" for i in range(12)]
        assert await index.store([StoreOp(n, (1, 2, 3)) for n in nodes]) == [True] * 12
        client = index.primary.client
        assert isinstance(client, RedisCluster)
        owners = {getattr(client.get_node_from_key(index.primary.keys.meta(n)), "name", "") for n in nodes}
        assert len(owners) == 3  # the nodes really are spread over the three shards
        assert await index.lookup([1, 2, 9], nodes) == dict.fromkeys(nodes, 2)
        for port in redis_cluster.master_ports():  # NOSCRIPT everywhere: reloaded by itself
            redis_cluster.cli(port, "script", "flush")
        assert await index.lookup([1, 2, 3], nodes[:4]) == dict.fromkeys(nodes[:4], 3)
        assert (await index.stats()).total_blocks == 36
        assert index.counters.failed_calls == 0 and not index.degraded
    finally:
        await index.primary.purge()
        await index.close()


async def test_calls_cancelled_at_random_points_lose_nothing_on_the_cluster(
    redis_cluster: RedisClusterHarness,
) -> None:
    """As on a single Redis (``tests/cachetier/test_redis_cancel.py``): no cancellation lost, no
    connection churned, every shard serves afterwards."""

    def received() -> int:
        return sum(
            int(line.split(":", 1)[1])
            for port in redis_cluster.master_ports()
            for line in redis_cluster.cli(port, "info", "stats").splitlines()
            if line.startswith("total_connections_received:")
        )

    client = connect_cluster(redis_cluster.url, max_connections=16, timeout=1.0)
    prefix = test_prefix()
    try:
        await client.initialize()
        await serves(client, prefix, 16)
        opened = received()
        with unhandled() as errors:
            outcomes = await cancel_storm(client, prefix, cluster=True)
            await settled(client)
        assert not errors, errors[:3]
        assert outcomes["cancelled"] + outcomes["timeout"] + outcomes[LOST] > 60, outcomes
        assert outcomes[LOST] == 0, f"cancellations lost: {outcomes}"
        await serves(client, prefix, 16)
        # at most the pools filling up (16 a shard), not one connection per cancelled command
        assert received() - opened <= 16 * 3 + 3, outcomes  # + the cli's
    finally:
        for key in [k async for k in client.scan_iter(match=prefix + "*")]:
            await client.delete(key)
        await client.aclose()


def test_index_contract_on_the_cluster(redis_cluster: RedisClusterHarness) -> None:
    async def plain() -> BlockIndex:
        return RedisIndex.from_url(redis_cluster.url, prefix=test_prefix(), default_capacity=CAPACITY)

    async def packed() -> BlockIndex:
        return RedisIndex.from_url(
            redis_cluster.url, prefix=test_prefix(), layout="packed", default_capacity=CAPACITY
        )

    async def resilient() -> BlockIndex:
        return open_index(
            redis_cluster.url, prefix=test_prefix(), default_capacity=CAPACITY, lookup_timeout=2.0
        )

    for name, factory, examples in (
        ("cluster", plain, 20),
        ("cluster-packed", packed, 12),
        ("resilient-cluster", resilient, 8),
    ):
        machine = type(f"IndexContract_{name}", (IndexContract,), {"factory": staticmethod(factory)})
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=examples,
                stateful_step_count=30,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
                database=None,
            ),
        )


def test_a_gateway_pointed_at_one_cluster_node_routes_by_the_shared_index(
    redis_cluster: RedisClusterHarness,
) -> None:
    prefix = f"prefixgate-test-{uuid.uuid4().hex[:8]}:"
    c = Cluster.create(
        2,
        2,
        ["--time-scale", "0.05"],
        gateway_args=["--redis", f"redis://127.0.0.1:{redis_cluster.ports[1]}"],
        gateway_env={"PREFIXGATE_REDIS_PREFIX": prefix},
    )
    c.start()
    try:
        for seed in range(2):
            first = post(c.url, doc_body(seed, question="first question"))
            time.sleep(0.3)  # the writer batches off the hot path
            again = post(c.url, doc_body(seed, question="another question"))
            assert again.headers["x-prefixgate-prefill-node"] == first.headers["x-prefixgate-prefill-node"]
            assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        view = httpx.get(c.url + "/admin/cache", timeout=5).json()
        assert view["index"]["total_blocks"] > 0 and not view["index"]["degraded"]
        assert c.metric("prefixgate_index_faults", kind="failed_calls") == 0
        results = asyncio.run(drive(c.url, [doc_body(50 + i % 5, 1500, f"q{i}") for i in range(24)], 8))
        assert all(r.status == 200 for r in results)
    finally:
        assert c.stop() == 0
        cleanup = RedisIndex.from_url(redis_cluster.url, prefix=prefix)
        asyncio.run(_purge(cleanup))


async def _purge(index: RedisIndex) -> None:
    try:
        await index.purge()
    finally:
        await index.close()


async def test_index_bench_measures_both_layouts_on_the_cluster(redis_cluster: RedisClusterHarness) -> None:
    """``bench index --cluster URL --layout zset,packed``: one row per layout, same answers as
    the in-memory index (the bench checks), and the packed layout well under 100 B/block."""
    workload = ["--nodes", "2", "--blocks-per-node", "2000", "--sizes", "64,256", "--samples", "20"]
    args = index_bench.parse_args(
        ["--redis", "", "--cluster", redis_cluster.url, *workload, "--write-rate", "5000"]
    )
    res = await index_bench.run(args)
    rows = {b.backend: b for b in res.backends}
    assert set(rows) == {"redis-cluster zset", "redis-cluster packed"}
    assert all(b.blocks_held == 4000 and b.blocks_per_s > 0 for b in rows.values())
    packed, zset = rows["redis-cluster packed"].bytes_per_block, rows["redis-cluster zset"].bytes_per_block
    assert packed is not None and zset is not None and packed < 40 < zset
    assert rows["redis-cluster packed"].loaded_p99_ms is not None


async def test_failover_drill_master_killed_under_load(redis_cluster: RedisClusterHarness) -> None:
    """Runs last in the module: it leaves the cluster with one master fewer in reserve."""
    nodes = [f"node-{i}" for i in range(12)]
    depth = dict.fromkeys(nodes, 0)  # node n holds chain(n)[:depth[n]]: what its snapshot says

    def chain(node: str, k: int) -> tuple[int, ...]:
        base = (nodes.index(node) + 1) << 32
        return tuple(range(base + 1, base + k + 1))

    resynced: list[frozenset[str]] = []

    async def resync(names: frozenset[str], reason: str) -> None:
        """What the gateway does: each node's snapshot replaces its set in the index."""
        resynced.append(names)
        for n in names:
            await index.replace_node(n, [chain(n, depth[n])])

    index = open_index(redis_cluster.url, prefix=test_prefix(), call_timeout=0.5, probe_interval=0.1)
    assert isinstance(index, ResilientIndex) and isinstance(index.primary, RedisIndex)
    index.check_interval = 0.2
    index.on_resync = resync
    lookups = failures = 0
    stop = asyncio.Event()

    async def lookup_load() -> None:
        nonlocal lookups, failures
        while not stop.is_set():
            n = nodes[lookups % len(nodes)]
            try:
                await index.lookup(chain(n, 64), nodes)
            except Exception:  # would be a request failure in the gateway
                failures += 1
            lookups += 1
            await asyncio.sleep(0.002)

    async def write_load() -> None:
        i = 0
        while not stop.is_set():
            n = nodes[i % len(nodes)]
            depth[n] += 4
            await index.store([StoreOp(n, chain(n, depth[n]))])
            i += 1
            await asyncio.sleep(0.005)

    try:
        with structlog.testing.capture_logs() as logs:
            tasks = [asyncio.create_task(lookup_load()), asyncio.create_task(write_load())]
            await asyncio.sleep(0.5)
            victim = redis_cluster.master_ports()[0]
            redis_cluster.kill(victim)
            t0 = time.monotonic()
            while time.monotonic() - t0 < 20 and not (
                index.counters.recoveries >= 1
                and not index.degraded
                and victim not in redis_cluster.master_ports()
            ):
                await asyncio.sleep(0.1)
            took = time.monotonic() - t0
            await asyncio.sleep(0.5)  # load goes on after the failover
            stop.set()
            await asyncio.gather(*tasks)
            await asyncio.sleep(1.0)  # the last checks and resyncs
            assert not index.degraded
            for n in nodes:  # consistent: Redis holds what every node holds
                assert await index.primary.node_hashes(n) == set(chain(n, depth[n])), n
        events = [e["event"] for e in logs]
        assert failures == 0 and lookups > 100
        assert events.count("index.degraded") >= 1 and events.count("index.recovered") >= 1, events
        assert resynced, "the nodes that missed writes were resynced"
        REPORT.append(
            Tally(
                "Redis Cluster master killed (index lookups)",
                sent=lookups,
                succeeded=lookups - failures,
                failed=failures,
                note=f"replica promoted; degraded {index.counters.degraded_periods}x, recovered after "
                f"{took:.1f}s; {index.counters.dropped_writes} writes dropped, "
                f"{sum(len(r) for r in resynced)} node resyncs, index consistent",
            )
        )
    finally:
        await index.primary.purge()
        await index.close()


@pytest.mark.drill
async def test_whole_shard_lost_drill_master_and_replica_killed_under_load() -> None:
    """A shard gone entirely (its master and its replica killed, ~3 s: far past the lookup
    deadline) while a gateway serves requests and an index takes lookups and writes. Without
    full slot coverage the cluster refuses everything, so routing runs without the shared index
    (degraded mode); no request fails. The shard comes back empty: the recovery resyncs the
    nodes whose writes were dropped, the epoch check finds the nodes whose data the shard lost,
    and the index ends up holding exactly what every node holds. Own cluster: it takes a shard
    down, which the module's cluster must not see."""
    harness = await asyncio.to_thread(lambda: RedisClusterHarness().start())
    prefix = f"prefixgate-test-{uuid.uuid4().hex[:8]}:"
    gateway = Cluster.create(
        2,
        2,
        ["--time-scale", "0.05"],
        gateway_args=["--redis", harness.url],
        gateway_env={"PREFIXGATE_REDIS_PREFIX": prefix},
    )
    nodes = [f"node-{i}" for i in range(12)]
    depth = dict.fromkeys(nodes, 0)  # node n holds chain(n)[:depth[n]]: what its snapshot says

    def chain(node: str, k: int) -> tuple[int, ...]:
        base = (nodes.index(node) + 1) << 32
        return tuple(range(base + 1, base + k + 1))

    resynced: list[tuple[frozenset[str], str]] = []

    async def resync(names: frozenset[str], reason: str) -> None:
        """What the gateway does: each node's snapshot replaces its set in the index."""
        resynced.append((names, reason))
        for n in names:
            await index.replace_node(n, [chain(n, depth[n])])

    index = open_index(harness.url, prefix=test_prefix(), call_timeout=0.5, probe_interval=0.1)
    assert isinstance(index, ResilientIndex) and isinstance(index.primary, RedisIndex)
    index.check_interval = 0.2
    index.on_resync = resync
    lookups = failures = 0
    stop = asyncio.Event()

    async def lookup_load() -> None:
        nonlocal lookups, failures
        while not stop.is_set():
            n = nodes[lookups % len(nodes)]
            try:
                await index.lookup(chain(n, 64), nodes)
            except Exception:  # would be a request failure in the gateway
                failures += 1
            lookups += 1
            await asyncio.sleep(0.002)

    async def write_load() -> None:
        i = 0
        while not stop.is_set():
            n = nodes[i % len(nodes)]
            depth[n] += 4
            await index.store([StoreOp(n, chain(n, depth[n]))])
            i += 1
            await asyncio.sleep(0.005)

    try:
        await asyncio.to_thread(gateway.start)
        with structlog.testing.capture_logs() as logs:
            tasks = [asyncio.create_task(lookup_load()), asyncio.create_task(write_load())]
            bodies = [doc_body(300 + i % 12, 1500, f"q{i}") for i in range(160)]
            requests = asyncio.create_task(drive(gateway.url, bodies, 4))
            await asyncio.sleep(0.5)

            # The shard holding most of the gateway's own keys (they sit on a few hash tags, so a
            # shard picked blindly may hold none of them, and the gateway would not notice).
            def gateway_keys(port: int) -> int:
                return len(harness.cli(port, "--scan", "--pattern", prefix + "*").split())

            victim = max(harness.master_ports(), key=gateway_keys)
            shard = [victim, *harness.replicas_of(victim)]
            for port in shard:
                harness.kill(port)
            t0 = time.monotonic()
            while time.monotonic() - t0 < 10 and not index.degraded:
                await asyncio.sleep(0.05)
            assert index.degraded, "a lost shard must put the index in degraded mode"
            await asyncio.sleep(max(0.0, 3.0 - (time.monotonic() - t0)))  # the shard stays gone
            down = time.monotonic() - t0
            for port in shard:  # back, empty: same identity and slots, no data
                await asyncio.to_thread(harness.restart, port)
            await asyncio.to_thread(harness.wait_ok)
            t1 = time.monotonic()
            while time.monotonic() - t1 < 20 and (index.degraded or index.counters.recoveries < 1):
                await asyncio.sleep(0.1)
            took = time.monotonic() - t1
            results = await requests
            stop.set()
            await asyncio.gather(*tasks)
            deadline = time.monotonic() + 10  # the last checks and resyncs
            consistent = False
            while time.monotonic() < deadline and not consistent:
                await asyncio.sleep(0.3)
                held = {n: await index.primary.node_hashes(n) for n in nodes}
                consistent = all(held[n] == set(chain(n, depth[n])) for n in nodes)
            assert not index.degraded
            for n in nodes:  # consistent: Redis holds what every node holds
                assert await index.primary.node_hashes(n) == set(chain(n, depth[n])), n
        events = [e["event"] for e in logs]
        assert failures == 0 and lookups > 100
        assert events.count("index.degraded") >= 1 and events.count("index.recovered") >= 1, events
        reasons = {why for _, why in resynced}
        assert "recovered" in reasons  # nodes whose writes were dropped while degraded
        assert events.count("index.data_lost") >= 1  # nodes whose data the empty shard lost
        ok = sum(1 for r in results if r.status == 200 and r.finish)
        assert ok == len(results), [r.error for r in results if r.status != 200][:5]
        # The gateway recovers on its own probe schedule, which may end after its last request.
        deadline = time.monotonic() + 15
        gateway_events = index_log_events(gateway)
        while time.monotonic() < deadline and gateway_events.get("index.recovered", 0) < 1:
            await asyncio.sleep(0.2)
            gateway_events = index_log_events(gateway)
        assert gateway_events.get("index.degraded", 0) >= 1 and gateway_events.get("index.recovered", 0) >= 1
        REPORT.append(
            Tally(
                "Redis Cluster shard lost (master + replica)",
                sent=len(results) + lookups,
                succeeded=ok + lookups - failures,
                failed=len(results) - ok + failures,
                note=f"{len(results)} requests + {lookups} index lookups; shard down {down:.1f}s, "
                f"recovered {took:.1f}s after it returned empty; gateway {gateway_events}; "
                f"{index.counters.dropped_writes} writes dropped, "
                f"{sum(len(r) for r, _ in resynced)} node resyncs ({', '.join(sorted(reasons))}), "
                "index consistent",
            )
        )
    finally:
        assert gateway.stop() == 0
        with contextlib.suppress(Exception):
            await index.primary.purge()
        await index.close()
        harness.stop()
