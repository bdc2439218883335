"""The simulated engine: real KV bytes and deterministic text, time from a cost profile.

Prefill sleeps ``profile.prefill_seconds(new, cached) x time_scale`` (the page bytes it makes
count against that time) and produces one page per uncached block, derived from the block hash.
It sleeps chunk by chunk (``PrefillJob.chunk_tokens``: the cost formula makes the chunks' times add
up to the whole prompt's), and between chunks lets the node give waiting prefills a turn.
Decode paces tokens at ``profile.decode_step_seconds(context) x time_scale`` each, against a
deadline so sleeps do not drift, and hands them out in small groups when a token is due in
under a millisecond. Time between tokens does not grow with the number of concurrent streams.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncGenerator

import xxhash

from prefixgate.backends.engine import DecodeJob, PrefillJob, PrefillOutput
from prefixgate.backends.kvpages import (
    DEFAULT_KV_SCALE,
    PAGE_LAYOUT,
    REFERENCE_MODEL,
    KVFormat,
    ModelSpec,
    scaled_bytes_per_token,
    synth_page_bytes,
)
from prefixgate.backends.profiles import CostProfile
from prefixgate.backends.sim import textgen

MIN_SLEEP_S = 0.001  # tokens due sooner than this go out together
MAX_LAG_S = 0.05  # a consumer stalled longer than this does not get a burst afterwards
PAGES_PER_YIELD = 64

_LE64 = struct.Struct("<Q")


class SimEngine:
    name = "sim"
    features: frozenset[str] = frozenset({"seed"})  # no logits: no logprobs nor logit_bias
    eos_token = textgen.EOS_TOKEN

    def __init__(
        self,
        profile: CostProfile,
        *,
        block_size: int = 64,
        time_scale: float = 1.0,
        kv_scale: float = DEFAULT_KV_SCALE,
        model: ModelSpec = REFERENCE_MODEL,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if time_scale < 0:
            raise ValueError(f"time_scale must be >= 0, got {time_scale}")
        self.profile = profile
        self.time_scale = time_scale
        # Fault injection: real work takes this many times longer than the profile (and the
        # node's reports) claim, as on throttled or degraded hardware. Toggled by SIGUSR1/2.
        self.slowdown = 1.0
        self.kv_scale = kv_scale
        self.model = model
        self.kv_format = KVFormat(
            model_fingerprint=f"sim:{model.name}:{textgen.VOCAB_DIGEST}",
            block_size=block_size,
            dtype=model.dtype,
            layout=PAGE_LAYOUT,
            bytes_per_token=scaled_bytes_per_token(model, kv_scale),
        )
        self._salt = self.kv_format.model_fingerprint.encode()

    def prefill_seconds(self, new_tokens: int, context_tokens: int) -> float:
        return self.profile.prefill_seconds(new_tokens, context_tokens) * self.time_scale

    def transfer_floor_seconds(self, shipped_bytes: int) -> float:
        full = shipped_bytes * self.model.kv_bytes_per_token / self.kv_format.bytes_per_token
        return self.profile.transfer_seconds(full) * self.time_scale

    def token_text(self, token: int) -> str:
        return textgen.token_text(token)

    async def prefill(self, job: PrefillJob) -> PrefillOutput:
        loop = asyncio.get_running_loop()
        start = loop.time()
        bs = self.kv_format.block_size
        n_tokens = len(job.tokens) // 4
        cached_tokens = job.cached_blocks * bs
        size = self.kv_format.page_bytes
        pages: list[bytes] = []
        for i, h in enumerate(job.block_hashes[job.cached_blocks :], 1):
            pages.append(synth_page_bytes(h, size, self._salt))
            if i % PAGES_PER_YIELD == 0:
                await asyncio.sleep(0)
        full = len(job.block_hashes) * bs
        tail_tokens = job.tokens[full * 4 :]
        tail = b""
        if tail_tokens:
            last = job.block_hashes[-1] if job.block_hashes else 0
            key = xxhash.xxh3_64_intdigest(_LE64.pack(last) + tail_tokens)
            tail = synth_page_bytes(key, (len(tail_tokens) // 4) * self.kv_format.bytes_per_token, self._salt)
        if job.first_token:
            token, state = textgen.first_token(job.tokens, job.sampling, job.resumed)
        else:
            token, state = 0, textgen.prompt_state(job.tokens)
        new = n_tokens - cached_tokens
        chunk = job.chunk_tokens if job.checkpoint is not None and job.chunk_tokens > 0 else new
        done = 0
        while True:  # one chunk at a time; the chunks' costs add up to the whole prompt's
            step = min(chunk, new - done)
            budget = self.prefill_seconds(step, cached_tokens + done) * self.slowdown
            await asyncio.sleep(max(0.0, budget - (loop.time() - start)))
            done += step
            if done >= new or job.checkpoint is None:
                break
            await job.checkpoint(done)
            start = loop.time()
        return PrefillOutput(pages, tail, token, state)

    async def decode(self, job: DecodeJob) -> AsyncGenerator[list[int], None]:
        loop = asyncio.get_running_loop()
        prompt = job.tokens[: len(job.tokens) - 4 * job.resumed]
        sampler = textgen.Sampler(job.sampling, textgen.prompt_state(prompt))
        state = job.state
        step = 1 + job.resumed
        context = len(job.tokens) // 4 + 1
        deadline = loop.time()
        group: list[int] = []
        for _ in range(job.max_new):
            token = sampler.pick(state, step)
            deadline += self.profile.decode_step_seconds(context) * self.time_scale * self.slowdown
            group.append(token)
            if token == self.eos_token:
                break
            state = textgen.advance(state, token)
            step += 1
            context += 1
            now = loop.time()
            deadline = max(deadline, now - MAX_LAG_S)
            if deadline - now >= MIN_SLEEP_S:
                await asyncio.sleep(deadline - now)
                yield group
                group = []
            elif len(group) >= job.stream_interval:
                yield group
                group = []
                await asyncio.sleep(0)
        if group:
            await asyncio.sleep(max(0.0, deadline - loop.time()))
            yield group
