"""Index benchmark: lookup latency, write throughput and Redis memory per block.

``python -m prefixgate.bench.index_bench [--redis URL] [--cluster [URL]] [--json FILE]`` (also
``prefixgate bench index``); ``--redis`` may name any node of a Redis Cluster (the figures are then
the cluster's); ``--cluster`` adds a Redis Cluster run next to the single Redis one, on the
cluster at URL or, without one, on a private 3-master, 3-replica loopback cluster started for
the run (``redis_cluster.py``, the one the cluster tests use), and prints one table of both;
``--layout`` picks the key layouts measured (both by default: ``zset`` and ``packed``, so the
two are compared in one run).
Several nodes each hold a realistic set (background chains plus a random leading part of
each test prompt), so every lookup binary-searches real, large sets. Redis runs use a
private key prefix and delete their keys afterwards. Targets: Redis lookup p99 <= 2 ms at
8,192 blocks, in-memory p99 <= 0.2 ms, <= 100 bytes of Redis memory per block held.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from redis.asyncio.cluster import RedisCluster
from rich.console import Console
from rich.table import Table

from prefixgate.bench.redis_cluster import RedisClusterHarness
from prefixgate.cachetier.index import BlockIndex, StoreOp
from prefixgate.cachetier.memory import MemoryIndex
from prefixgate.cachetier.redis_index import Client, RedisIndex
from prefixgate.cachetier.resilient import ResilientIndex
from prefixgate.cachetier.writer import IndexWriter

TARGET_REDIS_P99_MS = 2.0
TARGET_MEMORY_P99_MS = 0.2
TARGET_BYTES_PER_BLOCK = 100.0
START_CLUSTER = "start"  # --cluster without a URL


@dataclass(slots=True)
class LookupRow:
    backend: str
    blocks: int
    samples: int
    p50_ms: float
    p99_ms: float
    mean_ms: float
    max_ms: float


@dataclass(slots=True)
class WriteRow:
    backend: str
    ops: int
    blocks: int
    seconds: float
    blocks_per_s: float
    dropped: int


@dataclass(slots=True)
class BackendRow:
    """One Redis deployment's figures, side by side in the comparison table."""

    backend: str
    lookup_p50_ms: float = 0.0
    lookup_p99_ms: float = 0.0
    lookup_blocks: int = 0
    blocks_per_s: float = 0.0
    loaded_p50_ms: float | None = None
    loaded_p99_ms: float | None = None
    bytes_per_block: float | None = None
    bytes_per_block_info: float | None = None
    blocks_held: int = 0
    encoding: str = ""


@dataclass(slots=True)
class Results:
    nodes: int
    blocks_per_node: int
    lookups: list[LookupRow] = field(default_factory=list)
    writes: list[WriteRow] = field(default_factory=list)
    redis_bytes_per_block: float | None = None
    redis_bytes_per_block_info: float | None = None
    redis_blocks_held: int = 0
    redis_encoding: str = ""
    backends: list[BackendRow] = field(default_factory=list)
    targets: dict[str, bool] = field(default_factory=dict)


@dataclass(slots=True)
class Workload:
    nodes: list[str]
    prompts: dict[int, list[list[int]]]  # prompt length -> prompts
    ops: list[StoreOp]  # everything the nodes hold, as chain stores


def percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    k = max(0, min(len(sorted_values) - 1, math.ceil(q / 100.0 * len(sorted_values)) - 1))
    return float(sorted_values[k])


def make_workload(rng: random.Random, nodes: int, blocks_per_node: int, sizes: Sequence[int]) -> Workload:
    """Per node: background chains up to ``blocks_per_node`` plus a random prefix of each prompt."""
    names = [f"prefill-{i}" for i in range(nodes)]
    prompts = {s: [[rng.getrandbits(64) for _ in range(s)] for _ in range(4)] for s in sizes}
    ops: list[StoreOp] = []
    for name in names:
        held = 0
        for plist in prompts.values():
            for p in plist:
                k = rng.randint(0, len(p))
                if k:
                    ops.append(StoreOp(name, tuple(p[:k])))
                    held += k
        while held < blocks_per_node:
            n = min(rng.choice((64, 256, 1024, 2048)), blocks_per_node - held)
            ops.append(StoreOp(name, tuple(rng.getrandbits(64) for _ in range(n))))
            held += n
    rng.shuffle(ops)
    return Workload(names, prompts, ops)


async def populate(index: BlockIndex, backend: str, work: Workload, capacity: int) -> WriteRow:
    """Write the workload through the batching writer; blocks/s from first submit to flush."""
    for name in work.nodes:
        await index.set_capacity(name, capacity)
    writer = IndexWriter(index, max_pending_ops=len(work.ops) + 1, max_pending_blocks=1 << 40)
    t0 = time.perf_counter()
    for op in work.ops:
        writer.submit(op)
    await writer.flush(timeout=120)
    dt = time.perf_counter() - t0
    await writer.close()
    blocks = sum(len(op.hashes) for op in work.ops)
    return WriteRow(backend, len(work.ops), blocks, dt, blocks / dt if dt else 0.0, writer.stats.dropped)


async def measure_lookups(
    index: BlockIndex, backend: str, work: Workload, samples: int, rng: random.Random
) -> list[LookupRow]:
    rows = []
    for size, plist in work.prompts.items():
        for p in plist[:2]:  # warm up connections and script cache
            await index.lookup(p, work.nodes)
        times: list[float] = []
        deadline = time.monotonic() + 10.0
        for _ in range(samples):
            p = rng.choice(plist)
            t0 = time.perf_counter_ns()
            await index.lookup(p, work.nodes)
            times.append((time.perf_counter_ns() - t0) / 1e6)
            if time.monotonic() > deadline:
                break
        rows.append(lookup_row(backend, size, times))
    return rows


def lookup_row(backend: str, size: int, times: list[float]) -> LookupRow:
    times = sorted(times)
    p50, p99 = percentile(times, 50), percentile(times, 99)
    return LookupRow(backend, size, len(times), p50, p99, sum(times) / len(times), times[-1])


async def lookups_under_writes(
    index: BlockIndex, backend: str, work: Workload, samples: int, rng: random.Random, rate: int
) -> LookupRow:
    """Lookups of the longest prompts while an IndexWriter re-stores chains at ``rate`` blocks/s."""
    size = max(work.prompts)
    stop = asyncio.Event()
    writer = IndexWriter(index)
    chains = [op for op in work.ops if len(op.hashes) <= 2048]  # request-sized chains

    async def write_load() -> None:
        wrng = random.Random(rng.random())
        t0 = time.monotonic()
        sent = 0
        while not stop.is_set():
            while sent < rate * (time.monotonic() - t0):
                op = wrng.choice(chains)
                writer.submit(op)
                sent += len(op.hashes)
            await asyncio.sleep(0.002)

    load = asyncio.create_task(write_load())
    await asyncio.sleep(0.05)
    times: list[float] = []
    deadline = time.monotonic() + 10.0
    try:
        for _ in range(samples):
            p = rng.choice(work.prompts[size])
            t0 = time.perf_counter_ns()
            await index.lookup(p, work.nodes)
            times.append((time.perf_counter_ns() - t0) / 1e6)
            await asyncio.sleep(0.001)
            if time.monotonic() > deadline:
                break
    finally:
        stop.set()
        await load
        await writer.close()
    return lookup_row(f"{backend} + {rate // 1000}k blk/s writes", size, times)


async def used_memory(client: Client) -> int:
    """``INFO used_memory``, summed over the primaries of a cluster, once the keys of an earlier
    run (``UNLINK``ed, so freed in the background) are gone: bounded wait."""
    deadline = time.monotonic() + 10.0
    while True:
        if isinstance(client, RedisCluster):
            infos = list((await client.info("memory", target_nodes=RedisCluster.PRIMARIES)).values())
        else:
            infos = [await client.info("memory")]
        pending = sum(int(i.get("lazyfree_pending_objects", 0)) for i in infos)
        if pending == 0 or time.monotonic() > deadline:
            return sum(int(i["used_memory"]) for i in infos)
        await asyncio.sleep(0.1)


async def check_answers(index: BlockIndex, reference: MemoryIndex, work: Workload) -> None:
    for plist in work.prompts.values():
        for p in plist:
            got, want = await index.lookup(p, work.nodes), await reference.lookup(p, work.nodes)
            if got != want:
                raise SystemExit(f"lookup mismatch between {index.backend} and memory: {got} != {want}")


async def run_redis(
    url: str,
    layout: str,
    work: Workload,
    memory: MemoryIndex,
    args: argparse.Namespace,
    rng: random.Random,
    res: Results,
) -> BackendRow:
    """Populate, check and measure one Redis deployment (single or Cluster) and key layout
    under a private prefix."""
    capacity = args.blocks_per_node * 2
    rindex = RedisIndex.from_url(url, prefix=f"prefixgate-bench-{uuid.uuid4().hex[:8]}:", layout=layout)
    client = await rindex.connected()  # single Redis or Cluster, as the server says
    name = f"{'redis-cluster' if rindex.cluster else 'redis'} {layout}"
    row = BackendRow(name)
    before = await used_memory(client)
    try:
        wrow = await populate(rindex, name, work, capacity)
        res.writes.append(wrow)
        row.blocks_per_s = wrow.blocks_per_s
        await asyncio.sleep(0.5)
        after = await used_memory(client)
        await check_answers(rindex, memory, work)
        lookups = await measure_lookups(rindex, name, work, args.samples, rng)
        res.lookups += lookups
        big = lookups[-1]
        row.lookup_p50_ms, row.lookup_p99_ms, row.lookup_blocks = big.p50_ms, big.p99_ms, big.blocks
        resilient = ResilientIndex(rindex, mirror=False, lookup_timeout=0.05)
        res.lookups += await measure_lookups(resilient, f"{name}+resilient", work, args.samples, rng)
        if args.write_rate > 0:
            loaded = await lookups_under_writes(rindex, name, work, args.samples, rng, args.write_rate)
            res.lookups.append(loaded)
            row.loaded_p50_ms, row.loaded_p99_ms = loaded.p50_ms, loaded.p99_ms
        usage = held = 0
        encodings: set[str] = set()
        for node in work.nodes:
            node_usage, node_held, encoding = await rindex.memory_usage(node)
            usage += node_usage
            held += node_held
            encodings.add(encoding)
        row.blocks_held = held
        row.encoding = encodings.pop() if len(encodings) == 1 else "mixed"
        row.bytes_per_block = usage / held if held else None
        row.bytes_per_block_info = (after - before) / held if held else None
    finally:
        await rindex.purge()
        await rindex.close()
    return row


async def run(args: argparse.Namespace) -> Results:
    rng = random.Random(args.seed)
    sizes = [int(s) for s in args.sizes.split(",")]
    work = make_workload(rng, args.nodes, args.blocks_per_node, sizes)
    capacity = args.blocks_per_node * 2
    res = Results(args.nodes, args.blocks_per_node)

    memory = MemoryIndex()
    res.writes.append(await populate(memory, "memory", work, capacity))
    res.lookups += await measure_lookups(memory, "memory", work, args.samples, rng)

    urls = [args.redis] if args.redis else []
    harness: RedisClusterHarness | None = None
    if args.cluster == START_CLUSTER:
        harness = RedisClusterHarness().start()
        urls.append(harness.url)
    elif args.cluster:
        urls.append(args.cluster)
    layouts = [x.strip() for x in args.layout.split(",") if x.strip()]
    try:
        for url in urls:
            for layout in layouts:
                res.backends.append(await run_redis(url, layout, work, memory, args, rng, res))
    finally:
        if harness is not None:
            harness.stop()
    if res.backends:
        first = res.backends[0]
        res.redis_bytes_per_block, res.redis_bytes_per_block_info = (
            first.bytes_per_block,
            first.bytes_per_block_info,
        )
        res.redis_blocks_held, res.redis_encoding = first.blocks_held, first.encoding

    def p99(backend: str, size: int) -> float | None:
        return next((r.p99_ms for r in res.lookups if r.backend == backend and r.blocks == size), None)

    big = max(sizes)
    mem_p99 = p99("memory", big)
    if mem_p99 is not None:
        res.targets[f"memory lookup p99 <= {TARGET_MEMORY_P99_MS} ms @ {big}"] = (
            mem_p99 <= TARGET_MEMORY_P99_MS
        )
    for b in res.backends:
        red_p99 = p99(b.backend, big)
        if red_p99 is not None:
            res.targets[f"{b.backend} lookup p99 <= {TARGET_REDIS_P99_MS} ms @ {big}"] = (
                red_p99 <= TARGET_REDIS_P99_MS
            )
    for b in res.backends:
        if b.bytes_per_block is not None:
            res.targets[f"{b.backend} <= {TARGET_BYTES_PER_BLOCK:.0f} B/block"] = (
                b.bytes_per_block <= TARGET_BYTES_PER_BLOCK
            )
    return res


def render(res: Results, console: Console) -> None:
    t = Table(title=f"index lookup latency ({res.nodes} nodes, ~{res.blocks_per_node:,} blocks each)")
    for col in ("backend", "prompt blocks", "samples", "p50 ms", "p99 ms", "mean ms", "max ms"):
        t.add_column(col, justify="left" if col == "backend" else "right")
    for r in res.lookups:
        t.add_row(
            r.backend,
            f"{r.blocks:,}",
            str(r.samples),
            f"{r.p50_ms:.3f}",
            f"{r.p99_ms:.3f}",
            f"{r.mean_ms:.3f}",
            f"{r.max_ms:.3f}",
        )
    console.print(t)
    w = Table(title="index writes through IndexWriter")
    for col in ("backend", "ops", "blocks", "seconds", "blocks/s", "dropped"):
        w.add_column(col, justify="left" if col == "backend" else "right")
    for x in res.writes:
        w.add_row(
            x.backend,
            f"{x.ops:,}",
            f"{x.blocks:,}",
            f"{x.seconds:.2f}",
            f"{x.blocks_per_s:,.0f}",
            str(x.dropped),
        )
    console.print(w)
    for b in res.backends:
        if b.bytes_per_block is not None:
            info = b.bytes_per_block_info or 0.0
            console.print(
                f"{b.backend} memory: {b.bytes_per_block:.1f} B/block (MEMORY USAGE, {b.encoding}), "
                f"{info:.1f} B/block (INFO used_memory delta), {b.blocks_held:,} blocks held"
            )
    if len(res.backends) > 1:
        console.print(comparison(res))
    for name, ok in res.targets.items():
        console.print(f"{'PASS' if ok else 'MISS'}  {name}")


def comparison(res: Results) -> Table:
    """One table: every Redis deployment measured in this run, side by side."""

    def ms(v: float | None) -> str:
        return f"{v:.2f}" if v is not None else "-"

    def bpb(v: float | None) -> str:
        return f"{v:.1f}" if v is not None else "-"

    t = Table(title="Redis deployments and key layouts side by side (same workload, same run)")
    t.add_column("")
    for b in res.backends:
        t.add_column(b.backend, justify="right")
    size = max((b.lookup_blocks for b in res.backends), default=0)
    rows: list[tuple[str, list[str]]] = [
        (
            f"lookup p50 / p99 ms @ {size:,} blocks",
            [f"{ms(b.lookup_p50_ms)} / {ms(b.lookup_p99_ms)}" for b in res.backends],
        ),
        ("writes (blocks/s, IndexWriter)", [f"{b.blocks_per_s:,.0f}" for b in res.backends]),
        (
            "lookup p50 / p99 ms under write load",
            [f"{ms(b.loaded_p50_ms)} / {ms(b.loaded_p99_ms)}" for b in res.backends],
        ),
        (
            "B/block (MEMORY USAGE / INFO delta)",
            [f"{bpb(b.bytes_per_block)} / {bpb(b.bytes_per_block_info)}" for b in res.backends],
        ),
    ]
    for label, cells in rows:
        t.add_row(label, *cells)
    return t


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="prefixgate bench index", description=__doc__.splitlines()[0])
    add_arguments(ap)
    return ap.parse_args(argv)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0", help="Redis URL; '' to skip Redis")
    ap.add_argument(
        "--cluster",
        nargs="?",
        const=START_CLUSTER,
        default="",
        metavar="URL",
        help="also run on a Redis Cluster: any node's URL, or none to start a private loopback cluster",
    )
    ap.add_argument(
        "--layout",
        default="zset,packed",
        help="Redis key layouts to measure, comma-separated: zset (default layout), packed",
    )
    ap.add_argument("--nodes", type=int, default=6)
    ap.add_argument("--blocks-per-node", type=int, default=50_000)
    ap.add_argument("--sizes", default="64,1024,8192", help="prompt lengths in blocks")
    ap.add_argument("--samples", type=int, default=500, help="lookups per prompt length (10 s cap each)")
    ap.add_argument(
        "--write-rate", type=int, default=50_000, help="blocks/s written during the last lookup run (0: skip)"
    )
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json", metavar="FILE", help="also write the figures as JSON")


def main(argv: Sequence[str] | None = None) -> int:
    return run_args(parse_args(argv))


def run_args(args: argparse.Namespace) -> int:
    """Run with parsed arguments (``prefixgate bench index`` parses them itself)."""
    res = asyncio.run(run(args))
    console = Console()
    if not console.is_terminal:
        console = Console(width=120)
    render(res, console)
    if args.json:
        payload: dict[str, Any] = asdict(res)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
