"""``--engine tiny``: the engine contract computed for real by a small numpy transformer.

Same node, pool, transfer and gRPC services as the simulated engine; what differs is that page
bytes are the model's actual K and V and every output token comes from actual logits, so a
prefix reused from the pool or KV pages received from another node give the same answer only
if they arrive intact. Compute runs on one thread per engine (the "device"), in slices of
``SLICE_S``, so decode streams keep producing tokens while a long prefill runs; the event loop
stays free for the gRPC server. After each ``PrefillJob.chunk_tokens`` the prefill lets the node
give waiting prefills a turn (chunked prefill). BLAS runs single-threaded (set process-wide when
an engine is made).

Time is real: ``time_scale`` is always 1, ``transfer_floor_seconds`` is 0, and
``prefill_seconds`` (the router's estimate) comes from the ``cpu`` profile, calibrated by
``python -m prefixgate.bench.tiny_bench`` on the default preset.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

from prefixgate.backends.engine import DecodeJob, PrefillJob, PrefillOutput
from prefixgate.backends.kvpages import KVFormat
from prefixgate.backends.profiles import CostProfile, get_profile
from prefixgate.backends.tiny.config import TinyConfig, parse_engine_spec
from prefixgate.backends.tiny.kvcache import PAGE_LAYOUT
from prefixgate.backends.tiny.model import TinyModel, load_model
from prefixgate.backends.tiny.runs import DecodeRun, PrefillRun
from prefixgate.backends.tiny.vocab import EOS_TOKEN, embedding_rows, token_ids, token_text

SLICE_S = 0.02  # compute between turns on the engine thread

T = TypeVar("T")


class TinyEngine:
    name = "tiny"
    # Real logits: log probabilities and logit bias are honest, seeded sampling reproducible, and
    # a constraint's mask applies to them (``backends.grammar``).
    features = frozenset({"logprobs", "logit_bias", "seed", "response_format"})
    eos_token = EOS_TOKEN
    time_scale = 1.0

    def __init__(
        self, config: TinyConfig, *, block_size: int = 64, profile: CostProfile | None = None
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.config = config
        self.model: TinyModel = load_model(config)
        self.profile = profile if profile is not None else get_profile("cpu")
        self.kv_format = KVFormat(
            model_fingerprint=self.model.fingerprint,
            block_size=block_size,
            dtype=config.kv_dtype,
            layout=PAGE_LAYOUT,
            bytes_per_token=config.kv_bytes_per_token,
        )
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="tiny-engine")
        # One BLAS thread: the compute is many small matrix products, which a second BLAS thread
        # slows down (spinning, and worse on a busy machine); one thread also keeps results
        # independent of how many cores the node happens to get.
        threadpool_limits(1, user_api="blas")

    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def prefill_seconds(self, new_tokens: int, context_tokens: int) -> float:
        return self.profile.prefill_seconds(new_tokens, context_tokens)

    def transfer_floor_seconds(self, shipped_bytes: int) -> float:
        return 0.0

    def token_text(self, token: int) -> str:
        return token_text(token)

    async def prefill(self, job: PrefillJob) -> PrefillOutput:
        run = await self._run(PrefillRun, self.model, job, self.kv_format.block_size)
        turn = 0  # tokens computed when the node last had the chance to give others a turn
        while not await self._run(run.step, SLICE_S):
            done = run.computed_tokens
            if job.checkpoint is not None and job.chunk_tokens > 0 and done - turn >= job.chunk_tokens:
                turn = done
                await job.checkpoint(done)
        return await self._run(run.output)

    async def decode(self, job: DecodeJob) -> AsyncGenerator[list[int], None]:  # yields Tokens
        run = await self._run(DecodeRun, self.model, job)
        group = 1
        while not run.ended:
            tokens = await self._run(run.step, group, SLICE_S)
            if tokens:
                yield tokens
            group = min(job.stream_interval, group * 2)

    async def embed(self, tokens: bytes) -> list[float]:
        """The embedding of packed tokens (``TinyModel.embed``), on the engine's thread."""
        rows = embedding_rows(token_ids(tokens), self.config.vocab)
        vector = await self._run(self.model.embed, rows)
        return [float(v) for v in vector]

    @property
    def embedding_width(self) -> int:
        return self.config.d_model

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def make_engine(spec: str, *, block_size: int = 64, profile: str | None = None) -> TinyEngine:
    """The engine for ``--engine tiny[:key=value,...]``; ``profile`` None = ``cpu``."""
    return TinyEngine(parse_engine_spec(spec), block_size=block_size, profile=get_profile(profile or "cpu"))
