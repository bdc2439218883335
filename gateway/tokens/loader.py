"""Where the engine tokenizer comes from, in SMG's order.

1. A local directory given to the gateway (``--tokenizer-path``, ``tokenizer_path`` in the TOML
   file, ``PREFIXGATE_TOKENIZER_PATH``).
2. Else, per worker in the order given: the ``tokenizer_path`` its ``GetModelInfo`` reports, when
   that directory exists here; else the bundle remembered on disk for that worker; else the
   worker's ``GetTokenizer`` stream, verified and unpacked into the disk cache (``bundle``).
   The SGLang service is asked first, the vLLM one when the worker does not implement it.

The first worker that gives a usable tokenizer wins; when none does, the error names each
worker's reason. A ``GetTokenizer`` stream is bounded in time as a whole (``timeout_s``) and
between two chunks (``bundle.STALL_TIMEOUT_S``): a worker that stalls is a worker that gave none.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import structlog
from smg_grpc_proto.generated import (
    common_pb2,
    sglang_scheduler_pb2,
    sglang_scheduler_pb2_grpc,
    vllm_engine_pb2,
    vllm_engine_pb2_grpc,
)

from prefixgate.gateway.tokens import bundle
from prefixgate.gateway.tokens.bundle import (
    DEFAULT_TIMEOUT_S,
    BundleCache,
    BundleError,
    channel,
    collect_chunks,
    default_cache_dir,
    worker_key,
)
from prefixgate.gateway.tokens.engine import DEFAULT_SEGMENT_CACHE_BYTES, EngineTokenizer, TokenizerLoadError

log = structlog.get_logger("prefixgate.tokens")

BACKENDS = ("sglang", "vllm")
#: Codes of a worker that is not up (yet): waited for at start, unlike one that answers "no".
UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class WorkerUnreachable(BundleError):
    """The worker did not answer GetModelInfo at all (not up yet, or gone)."""


class NoWorkerAnswered(TokenizerLoadError):
    """No worker answered: they may not be up yet (``wait_engine_tokenizer`` waits for them)."""


def open_tokenizer_dir(
    path: str | Path, *, origin: str = "", segment_cache_bytes: int = DEFAULT_SEGMENT_CACHE_BYTES
) -> EngineTokenizer:
    """The tokenizer in a local directory (or the directory of a ``tokenizer.json`` path)."""
    p = Path(path).expanduser()
    if p.is_file() and p.name == "tokenizer.json":
        p = p.parent
    if not p.is_dir():
        raise TokenizerLoadError(f"tokenizer path {str(path)!r} is not a directory")
    return EngineTokenizer(p, origin=origin or str(p), segment_cache_bytes=segment_cache_bytes)


def _stubs(ch: grpc.aio.Channel, backend: str) -> tuple[Any, Any]:
    """(stub, GetModelInfoRequest class) of one SMG engine service."""
    if backend == "vllm":
        return vllm_engine_pb2_grpc.VllmEngineStub(ch), vllm_engine_pb2.GetModelInfoRequest
    return sglang_scheduler_pb2_grpc.SglangSchedulerStub(ch), sglang_scheduler_pb2.GetModelInfoRequest


class _Stalled(Exception):
    pass


async def _chunks(call: Any, stall_s: float) -> AsyncIterator[tuple[bytes, str]]:
    """The stream's chunks; ``_Stalled`` when the next one takes longer than ``stall_s``."""
    stream = call.__aiter__()
    chunks = size = 0
    while True:
        try:
            async with asyncio.timeout(stall_s):
                c = await anext(stream)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise _Stalled(f"no chunk for {stall_s:g} s after {chunks} chunks ({size} bytes)") from None
        chunks, size = chunks + 1, size + len(c.data)
        yield bytes(c.data), str(c.sha256)


async def fetch_bundle(
    address: str,
    *,
    backend: str = "sglang",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    stall_s: float | None = None,
) -> tuple[bytes, str]:
    """The verified ``GetTokenizer`` zip of a worker and its sha256: the whole RPC under
    ``timeout_s``, each chunk within ``stall_s`` of the one before (``bundle.STALL_TIMEOUT_S``)."""
    stall = bundle.STALL_TIMEOUT_S if stall_s is None else stall_s
    async with channel(address) as ch:
        stub, _ = _stubs(ch, backend)
        call = stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=timeout_s)
        try:
            return await asyncio.wait_for(collect_chunks(_chunks(call, min(stall, timeout_s))), timeout_s)
        except grpc.aio.AioRpcError as e:
            raise BundleError(f"GetTokenizer on {address}: {e.code().name}: {e.details()}") from None
        except _Stalled as e:
            call.cancel()
            raise BundleError(f"GetTokenizer on {address}: stalled: {e}") from None
        except TimeoutError:
            call.cancel()
            raise BundleError(f"GetTokenizer on {address}: no complete bundle within {timeout_s} s") from None


async def _model_info(ch: grpc.aio.Channel, backend: str, timeout_s: float) -> Any:
    stub, request = _stubs(ch, backend)
    return await stub.GetModelInfo(request(), timeout=timeout_s)


async def tokenizer_from_worker(
    address: str,
    *,
    cache: BundleCache,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    segment_cache_bytes: int = DEFAULT_SEGMENT_CACHE_BYTES,
    local_paths: bool = True,
) -> EngineTokenizer:
    """One worker's tokenizer: its local ``tokenizer_path``, the disk cache, or ``GetTokenizer``.

    ``local_paths=False`` ignores the worker's ``tokenizer_path`` even when it exists here (a
    worker on another host may report a path that means something else on this one)."""
    backends = (backend,) if backend else BACKENDS
    info: Any = None
    chosen = backends[0]
    async with channel(address) as ch:
        for b in backends:
            try:
                info = await _model_info(ch, b, min(timeout_s, 10.0))
                chosen = b
                break
            except grpc.aio.AioRpcError as e:
                if e.code() in UNREACHABLE:
                    raise WorkerUnreachable(
                        f"GetModelInfo on {address}: no answer ({e.code().name})"
                    ) from None
                if e.code() != grpc.StatusCode.UNIMPLEMENTED or b == backends[-1]:
                    raise BundleError(f"GetModelInfo on {address}: {e.code().name}: {e.details()}") from None
    tok = await _tokenizer_of(address, info, chosen, cache, timeout_s, segment_cache_bytes, local_paths)
    tok.served_model = info.served_model_name or info.model_path
    return tok


async def _tokenizer_of(
    address: str,
    info: Any,
    chosen: str,
    cache: BundleCache,
    timeout_s: float,
    segment_cache_bytes: int,
    local_paths: bool,
) -> EngineTokenizer:
    local = Path(info.tokenizer_path) if info.tokenizer_path else None
    if local_paths and local is not None and (local / "tokenizer.json").is_file():
        try:
            return open_tokenizer_dir(
                local, origin=f"{address} tokenizer_path {local}", segment_cache_bytes=segment_cache_bytes
            )
        except TokenizerLoadError as e:
            log.warning("worker_tokenizer_path_unusable", worker=address, error=str(e))
    facts = (chosen, info.served_model_name, info.model_path, info.tokenizer_path, str(info.vocab_size))
    key = worker_key(address, facts)
    kept = cache.remembered(key)
    if kept is not None:
        try:
            return EngineTokenizer(
                kept,
                origin=f"{address} bundle {kept.name[:16]} (cached)",
                segment_cache_bytes=segment_cache_bytes,
            )
        except TokenizerLoadError as e:
            log.warning("cached_tokenizer_unusable", worker=address, error=str(e))
    data, sha = await fetch_bundle(address, backend=chosen, timeout_s=timeout_s)
    path = await asyncio.to_thread(cache.store, data, sha)
    size = len(data)
    del data  # up to MAX_BUNDLE_BYTES, no longer needed while the tokenizer loads
    try:
        tok = EngineTokenizer(
            path, origin=f"{address} bundle {sha[:16]}", segment_cache_bytes=segment_cache_bytes
        )
    except (TokenizerLoadError, OSError):
        await asyncio.to_thread(cache.discard, sha)  # refused: not kept, not remembered
        raise
    cache.remember(key, sha)
    log.info("tokenizer_fetched", worker=address, sha256=sha, bytes=size)
    return tok


async def load_engine_tokenizer(
    path: str | Path | None = None,
    workers: Sequence[str] = (),
    *,
    cache_dir: str | Path | None = None,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    segment_cache_bytes: int = DEFAULT_SEGMENT_CACHE_BYTES,
    local_paths: bool = True,
) -> EngineTokenizer:
    """The engine tokenizer from ``path``, else from the first worker that gives one."""
    if path:
        return open_tokenizer_dir(path, segment_cache_bytes=segment_cache_bytes)
    if not workers:
        raise TokenizerLoadError("no tokenizer path and no worker to ask for the tokenizer")
    cache = BundleCache(Path(cache_dir) if cache_dir else default_cache_dir())
    reasons: list[str] = []
    unreachable = 0
    for address in workers:
        try:
            return await tokenizer_from_worker(
                address,
                cache=cache,
                backend=backend,
                timeout_s=timeout_s,
                segment_cache_bytes=segment_cache_bytes,
                local_paths=local_paths,
            )
        except (BundleError, TokenizerLoadError, OSError) as e:
            reasons.append(f"{address}: {e}")
            if isinstance(e, WorkerUnreachable):
                unreachable += 1  # not up (yet): the caller says so, once
            else:
                log.warning("worker_tokenizer_unavailable", worker=address, error=str(e))
    kind = NoWorkerAnswered if unreachable == len(workers) else TokenizerLoadError
    raise kind("no worker gave a tokenizer: " + "; ".join(reasons))


async def worker_tokenizers(
    workers: Sequence[str],
    *,
    cache_dir: str | Path | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    local_paths: bool = True,
) -> list[EngineTokenizer]:
    """The tokenizer of every worker that gives one (``served_model`` says its model), in order;
    workers that do not answer or give none are passed over."""
    cache = BundleCache(Path(cache_dir) if cache_dir else default_cache_dir())
    out: list[EngineTokenizer] = []
    for address in workers:
        try:
            tok = await tokenizer_from_worker(
                address, cache=cache, timeout_s=timeout_s, local_paths=local_paths
            )
            out.append(tok)
        except (BundleError, TokenizerLoadError, OSError):
            continue
    return out


async def wait_engine_tokenizer(
    workers: Sequence[str],
    *,
    wait_s: float,
    interval_s: float = 0.5,
    **options: Any,
) -> EngineTokenizer:
    """``load_engine_tokenizer`` from the workers, waiting up to ``wait_s`` while none of them
    answers yet (a gateway may start before its engines); a worker that answers but gives no
    usable tokenizer fails at once."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    waiting = False
    while True:
        try:
            return await load_engine_tokenizer(workers=workers, **options)
        except NoWorkerAnswered as e:
            if loop.time() + interval_s > deadline:
                raise
            if not waiting:
                waiting = True
                log.info("tokenizer_waiting_for_workers", wait_s=wait_s, reason=str(e))
        await asyncio.sleep(interval_s)
