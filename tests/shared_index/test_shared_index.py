"""The Redis index shared by gateway replicas, fed by node events, surviving Redis outages.

One Redis for the module (a drill that kills it starts it again on the same port) and one
2 prefill + 2 decode cluster on it for the drills that need no other nodes or settings; the
others start a cluster of their own. Drills on the shared cluster read counters as deltas and
the gateway's log from where they began."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from prefixgate.bench.redis_cluster import start_redis
from prefixgate.cachetier.hashing import Namespace, block_hashes
from prefixgate.cachetier.index import IndexStats, StoreOp
from prefixgate.cachetier.redis_index import RedisIndex, connect
from prefixgate.cachetier.tokenizer import Bytes4Tokenizer
from prefixgate.gateway.cluster.events import index_capacity
from prefixgate.gateway.ops.processes import Child
from prefixgate.openai.normalize import Document, render_chat
from tests.faults.cluster import Cluster, Outcome, Tally, drive
from tests.faults.drills import REPORT
from tests.helpers import free_port, spawn

MODEL = "prefixgate-sim"


def doc_body(seed: int, tokens: int = 3000, question: str = "Summarize.") -> dict[str, Any]:
    words = "kappa lambda sigma omega theta zeta".split()
    text = " ".join(words[(seed * 7 + i * 3) % len(words)] + str(i % 97) for i in range(tokens * 4 // 9))
    return {
        "model": MODEL,
        "max_tokens": 2,
        "messages": [{"role": "user", "content": question}],
        "documents": [{"id": f"doc-{seed}", "text": text}],
    }


@pytest.fixture(scope="module")
def redis_server() -> Iterator[tuple[int, list[Child]]]:
    """The module's Redis: the list's last process is the live one (a drill that restarts it
    appends the new one)."""
    port = free_port()
    procs = [start_redis(port)]
    try:
        yield port, procs
    finally:
        for p in procs:
            p.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def shared(
    redis_server: tuple[int, list[Child]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """2 prefill + 2 decode nodes (4096 blocks each) behind a gateway on the module's Redis, its
    output also in ``gateway.log`` (``log_mark`` / ``index_events_since``)."""
    port, _ = redis_server
    c = Cluster.create(
        2,
        2,
        ["--time-scale", "0.05", "--capacity-blocks", "4096"],
        gateway_args=["--redis", f"redis://127.0.0.1:{port}/0"],
        gateway_env={"PREFIXGATE_REDIS_PREFIX": f"prefixgate-test-{uuid.uuid4().hex[:8]}:"},
        log_dir=tmp_path_factory.mktemp("shared-index"),
    )
    c.start()
    try:
        yield c
    finally:
        assert c.stop() == 0


def _gateway_log(c: Cluster) -> Path:
    assert c.log_dir is not None
    return c.log_dir / "gateway.log"


def log_mark(c: Cluster) -> int:
    """Where the gateway's log ends now."""
    return _gateway_log(c).stat().st_size


def index_events_since(c: Cluster, mark: int) -> dict[str, int]:
    """``index_log_events`` of the lines the gateway logged after ``mark``."""
    with _gateway_log(c).open("rb") as f:
        f.seek(mark)
        return _index_events(f.read().decode(errors="replace").splitlines())


def post(url: str, body: dict[str, Any]) -> httpx.Response:
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r


def test_two_gateways_route_as_one(redis_server: tuple[int, list[Child]], shared: Cluster) -> None:
    port, _ = redis_server
    c = shared
    prefix = c.gateway_env["PREFIXGATE_REDIS_PREFIX"]
    second: Child | None = None
    try:
        b_port = free_port()
        args = ["gateway", "--port", str(b_port), "--redis", f"redis://127.0.0.1:{port}/0"]
        for n in c.prefill:
            args += ["--prefill", n.address]
        for n in c.decode:
            args += ["--decode", n.address]
        second = spawn(args, env={"PREFIXGATE_REDIS_PREFIX": prefix})
        b_url = f"http://127.0.0.1:{b_port}"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if httpx.get(b_url + "/readyz", timeout=1).json().get("prefill") == 2:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        for seed in range(4):  # several prefixes, so "same node" is not luck
            first = post(c.url, doc_body(seed, question="first question"))
            time.sleep(0.3)  # the writer batches off the hot path
            again = post(b_url, doc_body(seed, question="another question"))
            assert again.headers["x-prefixgate-prefill-node"] == first.headers["x-prefixgate-prefill-node"]
            assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        if second is not None:
            assert second.stop() == 0


def test_redis_outage_fails_no_request_and_routing_returns(
    redis_server: tuple[int, list[Child]], shared: Cluster
) -> None:
    port, procs = redis_server
    c = shared
    prefix = c.gateway_env["PREFIXGATE_REDIS_PREFIX"]
    killed = False
    try:
        before = c.metric("prefixgate_retries_total")

        def during(done: int) -> None:
            nonlocal killed
            if done == 30:
                procs[-1].stop(signal.SIGKILL)
                killed = True
            if done == 90:
                procs.append(start_redis(port))
                killed = False

        results = asyncio.run(
            drive(c.url, [doc_body(100 + i % 10, 1500, f"q{i}") for i in range(150)], 8, during=during)
        )
        t = Tally("Redis killed and restarted (Redis index)", len(results))
        t.succeeded = sum(1 for r in results if r.status == 200 and r.finish)
        t.failed = sum(1 for r in results if r.status != 200)
        t.retried = int(c.metric("prefixgate_retries_total") - before)
        assert t.failed == 0 and t.succeeded == 150
        # Back on Redis without a restart: a new prefix sent now lands in Redis.
        deadline = time.monotonic() + 15
        in_redis = False
        while time.monotonic() < deadline and not in_redis:
            post(c.url, doc_body(999, 1500))
            time.sleep(0.5)
            out = subprocess.run(
                ["redis-cli", "-p", str(port), "--scan", "--pattern", prefix + "*"],
                capture_output=True,
                text=True,
            ).stdout.split()
            in_redis = any(k.endswith(":z") for k in out)
        t.note = "index back on Redis by itself" if in_redis else "index did NOT return to Redis"
        REPORT.append(t)
        assert in_redis
        assert c.metric("prefixgate_index_degraded") == 0
    finally:
        if killed:  # the drills after this one find the module's Redis up
            procs.append(start_redis(port))


def test_node_side_eviction_reaches_the_index_within_a_second(
    redis_server: tuple[int, list[Child]],
) -> None:
    port, _ = redis_server
    prefix = f"prefixgate-test-{uuid.uuid4().hex[:8]}:"
    c = Cluster.create(
        1,
        1,
        ["--time-scale", "0.05", "--capacity-blocks", "96"],
        gateway_args=["--redis", f"redis://127.0.0.1:{port}/0"],
        gateway_env={"PREFIXGATE_REDIS_PREFIX": prefix},
    )
    c.start()
    try:
        first, second = doc_body(1, 4000), doc_body(2, 4000)
        r = post(c.url, first)
        node = r.headers["x-prefixgate-prefill-node"]
        layout = render_chat(first["messages"], documents=[Document("doc-1", first["documents"][0]["text"])])
        hashes = block_hashes(
            Bytes4Tokenizer().encode(layout.text), 64, Namespace(MODEL, block_size=64).root()
        )

        async def held() -> set[int]:
            idx = RedisIndex(connect(f"redis://127.0.0.1:{port}/0"), prefix=prefix)
            try:
                return await idx.node_hashes(node)
            finally:
                await idx.close()

        # Events are applied as they arrive: wait for them (bounded), do not guess how long.
        deadline = time.monotonic() + 10
        while not set(hashes[:40]) <= asyncio.run(held()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert set(hashes[:40]) <= asyncio.run(held())
        post(c.url, second)  # 60+ new blocks on a 96-block pool: the first document's leaves go
        deadline = time.monotonic() + 10
        gone = False
        while time.monotonic() < deadline:
            if hashes[-1] not in asyncio.run(held()):
                gone = True
                break
            time.sleep(0.05)
        assert gone, "evicted blocks still in the index after 10 s"
    finally:
        assert c.stop() == 0


def test_a_node_whose_hits_keep_missing_the_prediction_is_resynced(
    redis_server: tuple[int, list[Child]],
) -> None:
    """Entries the node does not hold (events lost, say) are caught by predicted vs reported."""
    port, _ = redis_server
    prefix = f"prefixgate-test-{uuid.uuid4().hex[:8]}:"
    c = Cluster.create(
        1,
        1,
        ["--time-scale", "0.05"],
        gateway_args=["--redis", f"redis://127.0.0.1:{port}/0"],
        gateway_env={"PREFIXGATE_REDIS_PREFIX": prefix},
    )
    c.start()
    try:
        node = c.prefill[0].node_id
        bodies = [doc_body(500 + i, 2000) for i in range(4)]

        def chain(body: dict[str, Any]) -> list[int]:
            docs = [Document(d["id"], d["text"]) for d in body["documents"]]
            text = render_chat(body["messages"], documents=docs).text
            return block_hashes(Bytes4Tokenizer().encode(text), 64, Namespace(MODEL, block_size=64).root())

        async def plant_and_read(chains: list[list[int]]) -> set[int]:
            idx = RedisIndex(connect(f"redis://127.0.0.1:{port}/0"), prefix=prefix)
            try:
                if chains:
                    await idx.store([StoreOp(node, tuple(ch)) for ch in chains])
                return await idx.node_hashes(node)
            finally:
                await idx.close()

        ghost = chain(bodies[3])  # never sent: only a wrong index would hold it
        asyncio.run(plant_and_read([chain(b) for b in bodies[:3]] + [ghost]))
        before = c.metric("prefixgate_index_resyncs_total", reason="mispredicted")
        for b in bodies[:3]:
            r = post(c.url, b)
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # predicted, not there

        def resynced() -> bool:
            return c.metric("prefixgate_index_resyncs_total", reason="mispredicted") >= before + 1

        # The resync runs beside the requests: wait for it (bounded) rather than guess how long.
        deadline = time.monotonic() + 10
        held = asyncio.run(plant_and_read([]))
        while time.monotonic() < deadline and (ghost[0] in held or not resynced()):
            time.sleep(0.1)
            held = asyncio.run(plant_and_read([]))
        assert c.metric("prefixgate_index_resyncs_total", reason="mispredicted") == before + 1
        assert ghost[0] not in held, "the resync should have replaced the node's set with what it holds"
    finally:
        assert c.stop() == 0


def index_stats(port: int, prefix: str) -> IndexStats:
    async def read() -> IndexStats:
        idx = RedisIndex(connect(f"redis://127.0.0.1:{port}/0"), prefix=prefix)
        try:
            return await idx.stats()
        finally:
            await idx.close()

    return asyncio.run(read())


def settled_index_stats(port: int, prefix: str, timeout: float = 10.0) -> IndexStats:
    """The index's stats once its block count has held for a second: the nodes' KV events for
    the requests just answered arrive after their answers, later on a loaded machine."""
    stats = index_stats(port, prefix)
    held_since = time.monotonic()
    deadline = held_since + timeout
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = index_stats(port, prefix)
        if now.total_blocks != stats.total_blocks:
            held_since = time.monotonic()
        elif time.monotonic() - held_since >= 1.0:
            return now
        stats = now
    raise AssertionError(f"the index kept changing for {timeout} s ({stats.total_blocks} blocks)")


def tally_redis(name: str, results: list[Outcome], c: Cluster, note: str) -> Tally:
    t = Tally(name, len(results))
    t.succeeded = sum(1 for r in results if r.status == 200 and r.finish)
    t.failed = sum(1 for r in results if r.status != 200)
    t.note = note
    REPORT.append(t)
    return t


def index_log_events(c: Cluster) -> dict[str, int]:
    """How many times the gateway logged each index event (in the lines it keeps)."""
    assert c.gateway is not None
    return _index_events(list(c.gateway.lines))


def _index_events(lines: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for line in lines:
        for event in ("index.write_failed", "index.degraded", "index.recovered", "index.data_lost"):
            if f'"{event}"' in line:
                counts[event] = counts.get(event, 0) + 1
    return counts


def test_redis_restarted_empty_is_noticed_and_the_index_rebuilt(
    redis_server: tuple[int, list[Child]], shared: Cluster
) -> None:
    """An idle restart used to leave the index empty (and capacities at the default) unnoticed."""
    port, procs = redis_server
    c = shared
    prefix = c.gateway_env["PREFIXGATE_REDIS_PREFIX"]
    mark = log_mark(c)
    resynced0 = c.metric("prefixgate_index_resyncs_total", reason="index_data_lost")
    results = asyncio.run(drive(c.url, [doc_body(700 + i, 1500, f"q{i}") for i in range(30)], 8))
    before = settled_index_stats(port, prefix)
    assert before.total_blocks > 0
    assert {o.capacity for o in before.nodes.values()} == {index_capacity(4096)}
    procs[-1].stop(signal.SIGKILL)
    procs.append(start_redis(port))  # idle: no request in flight
    t0 = time.monotonic()
    rebuilt = index_stats(port, prefix)
    while time.monotonic() - t0 < 10 and rebuilt.total_blocks < before.total_blocks:
        time.sleep(0.1)
        rebuilt = index_stats(port, prefix)
    took = time.monotonic() - t0
    assert rebuilt.total_blocks == before.total_blocks, (before, rebuilt)
    assert {o.capacity for o in rebuilt.nodes.values()} == {index_capacity(4096)}  # not 1,048,576
    view = httpx.get(c.url + "/admin/cache", timeout=5).json()
    assert view["index"]["total_blocks"] == before.total_blocks and not view["index"]["degraded"]
    results += asyncio.run(drive(c.url, [doc_body(700 + i, 1500, f"r{i}") for i in range(30)], 8))
    resynced = c.metric("prefixgate_index_resyncs_total", reason="index_data_lost") - resynced0
    events = index_events_since(c, mark)
    t = tally_redis(
        "Redis restarted empty (data loss)",
        results,
        c,
        f"index rebuilt in {took:.1f}s ({int(resynced)} nodes resynced); {events}",
    )
    assert t.failed == 0 and t.succeeded == 60
    assert resynced == 4 and events.get("index.data_lost", 0) >= 1


def test_redis_out_of_memory_is_degraded_mode_and_fails_no_request(
    redis_server: tuple[int, list[Child]], shared: Cluster
) -> None:
    """maxmemory + noeviction: reads work, every index write is refused; that used to look healthy."""
    port, _ = redis_server
    c = shared
    mark = log_mark(c)
    failed_writes0 = c.metric("prefixgate_index_faults", kind="failed_writes")

    def cli(*args: str) -> str:
        return subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True, text=True).stdout

    try:
        results = asyncio.run(drive(c.url, [doc_body(800 + i, 1500, f"q{i}") for i in range(10)], 4))
        used = next(ln for ln in cli("info", "memory").splitlines() if ln.startswith("used_memory:"))
        cli("config", "set", "maxmemory-policy", "noeviction")
        cli("config", "set", "maxmemory", used.split(":")[1].strip())  # full from now on
        results += asyncio.run(drive(c.url, [doc_body(900 + i, 1500, f"q{i}") for i in range(60)], 8))
        degraded = c.metric("prefixgate_index_degraded")
        failed_writes = c.metric("prefixgate_index_faults", kind="failed_writes") - failed_writes0
        cli("config", "set", "maxmemory", "0")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and c.metric("prefixgate_index_degraded") == 1:
            post(c.url, doc_body(999, 1500))
            time.sleep(0.2)
        recovered = c.metric("prefixgate_index_degraded") == 0
        events = index_events_since(c, mark)
        t = tally_redis(
            "Redis out of memory (noeviction)",
            results,
            c,
            f"{int(failed_writes)} index writes refused, degraded={int(degraded)}, "
            f"{'recovered' if recovered else 'NOT recovered'} after maxmemory raised; {events}",
        )
        assert t.failed == 0 and t.succeeded == 70
        assert degraded == 1 and failed_writes >= 5
        assert recovered and events.get("index.recovered", 0) >= 1
    finally:
        cli("config", "set", "maxmemory", "0")


def test_a_gateway_on_the_packed_layout_routes_by_it(
    redis_server: tuple[int, list[Child]],
) -> None:
    """``PREFIXGATE_REDIS_LAYOUT=packed``: the index lives in the packed keys and still routes."""
    port, _ = redis_server
    prefix = f"prefixgate-test-{uuid.uuid4().hex[:8]}:"
    c = Cluster.create(
        2,
        1,
        ["--time-scale", "0.05"],
        gateway_args=["--redis", f"redis://127.0.0.1:{port}/0"],
        gateway_env={"PREFIXGATE_REDIS_PREFIX": prefix, "PREFIXGATE_REDIS_LAYOUT": "packed"},
    )
    c.start()
    try:
        for seed in range(2):
            first = post(c.url, doc_body(seed, question="first question"))
            time.sleep(0.3)  # the writer batches off the hot path
            again = post(c.url, doc_body(seed, question="another question"))
            assert again.headers["x-prefixgate-prefill-node"] == first.headers["x-prefixgate-prefill-node"]
            assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        keys = subprocess.run(
            ["redis-cli", "-p", str(port), "--scan", "--pattern", prefix + "*"],
            capture_output=True,
            text=True,
        ).stdout.split()
        # The replicas' shared state (documents, pins, membership, usage) lives beside the index.
        state = tuple(prefix + f for f in ("{docs}", "{pins}", "{nodes}", "{usage}"))
        index_keys = [k for k in keys if not k.startswith(state)]
        assert index_keys and all(k.startswith(prefix + "v2:") for k in index_keys), keys
        assert any(k.endswith(":h") for k in index_keys)
    finally:
        assert c.stop() == 0
