"""Tiny-engine benchmark: real prefill, prefix reuse and KV transfer between two node processes.

``python -m prefixgate.bench.tiny_bench [--sizes 1024,4096,16384] [--engine tiny] [--json FILE]``

Starts a prefill node and a decode node (``python -m prefixgate.backends --engine tiny``, separate
processes on loopback) and, for each prompt size, runs the split path twice: cold (nothing
cached) and with a prefix hit (a follow-up sharing all but the last ``--new-tokens`` tokens).
Each run is Prefill on the prefill node (which pushes every KV page to the decode node over
gRPC TransferKV) then Decode on the decode node. Reported per run: TTFT as the gateway sees it
(Prefill returned + first Decode chunk), the node's prefill time, KV bytes shipped and transfer
time, and decode time per token; each case runs ``--repeat`` times and the median is shown.

The figures are fitted to a cost profile (``prefill_tokens_per_s`` and ``attention_coeff_s``
from the prefill times, decode figures from time per token, the loopback transfer rate): that
is the ``cpu`` profile in ``backends.profiles``, so the simulated engine can stand in for a
tiny node and the router's estimates for tiny nodes are right.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from rich.console import Console
from rich.table import Table

from prefixgate.cachetier.hashing import Namespace, block_hashes
from prefixgate.gateway.ops import processes
from prefixgate.gateway.ops.processes import Child
from prefixgate.v1 import node_pb2, node_pb2_grpc

SIZES = (1_024, 4_096, 16_384)
BLOCK_SIZE = 64
NEW_TOKENS = 128  # uncached suffix of the prefix-hit follow-up
DECODE_TOKENS = 32
REPEAT = 3
RPC_TIMEOUT_S = 300.0
START_TIMEOUT_S = 60.0
MB = 1 << 20


@dataclass(slots=True)
class Run:
    prompt_tokens: int
    case: str  # "cold" | "hit"
    cached_tokens: int
    ttft_s: float  # Prefill returned (first token, KV on the decode node) + first Decode chunk
    prefill_rpc_s: float
    prefill_s: float  # the prefill node's own figure (compute + pool work)
    kv_bytes: int
    transfer_s: float
    decode_tokens: int
    decode_per_token_s: float

    @property
    def transfer_mb_s(self) -> float:
        return self.kv_bytes / MB / self.transfer_s if self.transfer_s > 0 else 0.0


@dataclass(slots=True)
class Fit:
    prefill_tokens_per_s: float
    attention_coeff_s: float
    decode_base_s: float
    decode_per_context_token_s: float
    transfer_bytes_per_s: float


def node_command(role: str, engine: str, block_size: int) -> list[str]:
    """``python -m prefixgate.backends`` on a free port, printing its address in its ready line."""
    return [
        sys.executable, "-m", "prefixgate.backends", "--role", role, "--engine", engine,
        "--block-size", str(block_size), "--port", "0", "--log-level", "warning",
        "--capacity-blocks", "16384",
    ]  # fmt: skip


def make_prompt(n: int, seed: int, prefix: bytes = b"") -> bytes:
    rng = np.random.default_rng(seed)
    body = rng.integers(0, 1 << 32, n - len(prefix) // 4, dtype=np.uint32).astype("<u4").tobytes()
    return prefix + body


async def run_split(
    p: Any, d: Any, decode_address: str, tokens: bytes, block_size: int, decode_tokens: int, case: str
) -> Run:
    hashes = block_hashes(tokens, block_size, Namespace("tiny-bench", "", block_size).root())
    sp = node_pb2.SamplingParams(max_tokens=1 + decode_tokens, temperature=0.0)
    t0 = time.perf_counter()
    r = await p.Prefill(
        node_pb2.PrefillRequest(
            request_id=f"bench-{case}-{len(tokens)}",
            tokens=tokens,
            block_hashes=hashes,
            sampling=sp,
            decode_address=decode_address,
        ),
        timeout=RPC_TIMEOUT_S,
    )
    t_prefill = time.perf_counter() - t0
    call = d.Decode(node_pb2.DecodeRequest(kv_handle=r.kv_handle, sampling=sp), timeout=RPC_TIMEOUT_S)
    t1 = time.perf_counter()
    first_chunk_s = 0.0
    produced = 0
    async for chunk in call:
        if not first_chunk_s:
            first_chunk_s = time.perf_counter() - t1
        produced = chunk.completion_tokens
    decode_s = time.perf_counter() - t1
    n_decoded = max(1, produced - 1)
    return Run(
        prompt_tokens=len(tokens) // 4,
        case=case,
        cached_tokens=r.cached_tokens,
        ttft_s=t_prefill + first_chunk_s,
        prefill_rpc_s=t_prefill,
        prefill_s=r.prefill_seconds,
        kv_bytes=r.transfer_bytes,
        transfer_s=r.transfer_seconds,
        decode_tokens=n_decoded,
        decode_per_token_s=decode_s / n_decoded,
    )


def fit_profile(runs: Sequence[Run]) -> Fit:
    """Least squares (relative error) of the cost model over the measured runs."""
    rows, y = [], []
    for r in runs:
        new = r.prompt_tokens - r.cached_tokens
        rows.append([new / r.prefill_s, new * (r.cached_tokens + new / 2) / r.prefill_s])
        y.append(1.0)
    (inv_tps, coeff), *_ = np.linalg.lstsq(np.array(rows), np.array(y), rcond=None)
    inv_tps, coeff = max(float(inv_tps), 1e-9), max(float(coeff), 0.0)
    ctx = np.array([[1.0, r.prompt_tokens] for r in runs])
    per = np.array([r.decode_per_token_s for r in runs])
    (base, per_ctx), *_ = np.linalg.lstsq(ctx, per, rcond=None)
    big = [r for r in runs if r.kv_bytes >= MB and r.transfer_s > 0]
    rate = sum(r.kv_bytes for r in big) / sum(r.transfer_s for r in big) if big else 0.0
    return Fit(1.0 / inv_tps, coeff, max(float(base), 0.0), max(float(per_ctx), 0.0), rate)


@contextlib.contextmanager
def node_pair(engine: str, block_size: int) -> Iterator[tuple[Child, Child]]:
    pair = [processes.start(f"{r} node", node_command(r, engine, block_size)) for r in ("prefill", "decode")]
    try:
        processes.wait_all(pair, processes.printed(processes.NODE_READY), START_TIMEOUT_S)
        for c in pair:
            c.address = processes.node_ready_line(c)["address"]
        yield pair[0], pair[1]
    finally:
        processes.stop_all(pair)


async def measure(
    engine: str, sizes: Sequence[int], block_size: int, new_tokens: int, decode_tokens: int, repeat: int
) -> list[Run]:
    """Every run, ``repeat`` times per size and case (each cold run on a prompt never seen)."""
    runs: list[Run] = []
    with node_pair(engine, block_size) as (pn, dn):
        async with grpc.aio.insecure_channel(pn.address) as pch, grpc.aio.insecure_channel(dn.address) as dch:
            p, d = node_pb2_grpc.NodeStub(pch), node_pb2_grpc.NodeStub(dch)
            await run_split(p, d, dn.address, make_prompt(block_size, 1), block_size, 4, "warmup")
            for n in sizes:
                for i in range(repeat):
                    cold = make_prompt(n, seed=n * 1000 + 2 * i)
                    runs.append(await run_split(p, d, dn.address, cold, block_size, decode_tokens, "cold"))
                    keep = max(0, n - new_tokens) // block_size * block_size
                    hit = make_prompt(n, seed=n * 1000 + 2 * i + 1, prefix=cold[: keep * 4])
                    runs.append(await run_split(p, d, dn.address, hit, block_size, decode_tokens, "hit"))
    return runs


def medians(runs: Sequence[Run]) -> list[Run]:
    """The median run (by TTFT) of each (prompt size, case), in first-seen order."""
    groups: dict[tuple[int, str], list[Run]] = {}
    for r in runs:
        groups.setdefault((r.prompt_tokens, r.case), []).append(r)
    return [sorted(g, key=lambda r: r.ttft_s)[(len(g) - 1) // 2] for g in groups.values()]


def print_table(runs: Sequence[Run], fit: Fit, engine: str, console: Console) -> None:
    t = Table(title=f"tiny engine ({engine}): split path, prefill node -> KV pages over gRPC -> decode node")
    for col in (
        "prompt",
        "case",
        "cached",
        "TTFT ms",
        "prefill ms",
        "KV MiB",
        "transfer ms",
        "MiB/s",
        "decode ms/tok",
    ):
        t.add_column(col, justify="right")
    for r in runs:
        t.add_row(
            f"{r.prompt_tokens:,}", r.case, f"{r.cached_tokens:,}", f"{r.ttft_s * 1e3:,.1f}",
            f"{r.prefill_s * 1e3:,.1f}", f"{r.kv_bytes / MB:,.2f}", f"{r.transfer_s * 1e3:,.1f}",
            f"{r.transfer_mb_s:,.0f}", f"{r.decode_per_token_s * 1e3:.2f}",
        )  # fmt: skip
    console.print(t)
    if len({r.prompt_tokens for r in runs}) < 2:
        console.print("(the cpu profile fit needs two prompt sizes or more)")
        return
    console.print(
        "fitted cpu profile: "
        f"prefill_tokens_per_s={fit.prefill_tokens_per_s:,.0f} "
        f"attention_coeff_s={fit.attention_coeff_s:.3e} "
        f"decode_base_s={fit.decode_base_s:.2e} "
        f"decode_per_context_token_s={fit.decode_per_context_token_s:.2e} "
        f"transfer_bytes_per_s={fit.transfer_bytes_per_s:.3e}"
    )


def parse_sizes(text: str) -> list[int]:
    sizes = [int(s) for s in text.split(",") if s.strip()]
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"sizes must be positive integers, got {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m prefixgate.bench.tiny_bench", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "--sizes", type=parse_sizes, default=list(SIZES), help="prompt sizes (default 1024,4096,16384)"
    )
    ap.add_argument("--engine", default="tiny", help="node engine spec (default tiny)")
    ap.add_argument("--block-size", type=int, default=BLOCK_SIZE, help="tokens per KV block (default 64)")
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help="uncached tokens of the hit case")
    ap.add_argument("--decode-tokens", type=int, default=DECODE_TOKENS, help="tokens decoded per run")
    ap.add_argument("--repeat", type=int, default=REPEAT, help="runs per size and case; the median is shown")
    ap.add_argument("--json", type=Path, default=None, help="write the figures to this file")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    repeat = max(1, args.repeat)
    runs = asyncio.run(
        measure(args.engine, args.sizes, args.block_size, args.new_tokens, args.decode_tokens, repeat)
    )
    fit = fit_profile(runs)
    shown = medians(runs)
    print_table(shown, fit, args.engine, Console(width=120))
    wall = time.perf_counter() - t0
    print(f"wall time {wall:.1f}s")
    if args.json is not None:
        doc: dict[str, Any] = {
            "engine": args.engine,
            "block_size": args.block_size,
            "repeat": repeat,
            "median_runs": [{**asdict(r), "transfer_mb_s": r.transfer_mb_s} for r in shown],
            "runs": [{**asdict(r), "transfer_mb_s": r.transfer_mb_s} for r in runs],
            "cpu_profile": asdict(fit),
            "wall_s": wall,
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
