"""A prefill and a decode as resumable, synchronous computations. No I/O, no asyncio.

The engine runs them a slice at a time on its compute thread (``step(budget_s)``), so a long
prefill and the decode streams of the same node take turns instead of one blocking the rest.

Prefill reuses the leading cached blocks (their pages are loaded into the attention cache) and
computes the rest one block per chunk. When every block is cached and the prompt ends on a
block boundary, it recomputes the last block to get the first token (its page is not emitted:
the pool already holds it).
"""

from __future__ import annotations

import time

import numpy as np

from prefixgate.backends.engine import DecodeJob, PrefillJob, PrefillOutput, Sampling, TokenLogprob, Tokens
from prefixgate.backends.grammar import Guide
from prefixgate.backends.tiny import sampling as smp
from prefixgate.backends.tiny.kvcache import KVCache
from prefixgate.backends.tiny.model import TinyModel
from prefixgate.backends.tiny.vocab import EOS_TOKEN, OUTPUT_IDS, embedding_rows, token_ids

DECODE_HEADROOM = 256  # positions allocated beyond the prompt before the cache grows


def chunk_bounds(n_tokens: int, block_size: int, first_block: int) -> list[tuple[int, int]]:
    """[start, end) of every block-aligned chunk from ``first_block`` to the prompt's end."""
    return [(s, min(s + block_size, n_tokens)) for s in range(first_block * block_size, n_tokens, block_size)]


class PrefillRun:
    def __init__(self, model: TinyModel, job: PrefillJob, block_size: int) -> None:
        self.model = model
        self.job = job
        self.bs = block_size
        self.n = len(job.tokens) // 4
        self.rows = embedding_rows(token_ids(job.tokens), model.cfg.vocab)
        self.full = len(job.block_hashes)
        k = job.cached_blocks
        if len(job.cached_pages) != k:
            raise ValueError(f"prefill: {len(job.cached_pages)} cached pages for {k} cached blocks")
        first = k
        if job.first_token and k == self.full and k > 0 and self.n == k * block_size:
            first = k - 1  # everything cached: recompute the last block for its logits
        self.cache = KVCache(model.cfg, self.n)
        self.cache.load_pages(job.cached_pages[:first])
        self.chunks = chunk_bounds(self.n, block_size, first)
        self.next = 0
        self.logits: np.ndarray | None = None

    @property
    def done(self) -> bool:
        return self.next >= len(self.chunks)

    @property
    def computed_tokens(self) -> int:
        """Prompt positions computed so far by this run."""
        return self.chunks[self.next - 1][1] - self.chunks[0][0] if self.next else 0

    def step(self, budget_s: float) -> bool:
        """Compute chunks until ``budget_s`` has passed (at least one); True when finished."""
        t0 = time.perf_counter()
        while not self.done:
            s, e = self.chunks[self.next]
            last = self.next == len(self.chunks) - 1
            out = self.model.forward(self.rows[s:e], self.cache, s, logits=last and self.job.first_token)
            if out is not None:
                self.logits = out
            self.next += 1
            if time.perf_counter() - t0 >= budget_s:
                break
        return self.done

    def output(self) -> PrefillOutput:
        bs, k = self.bs, self.job.cached_blocks
        pages = [self.cache.page(b * bs, (b + 1) * bs) for b in range(k, self.full)]
        tail = self.cache.page(self.full * bs, self.n) if self.n > self.full * bs else b""
        job, r = self.job, self.job.resumed
        prompt = job.tokens[: len(job.tokens) - 4 * r]
        gen = smp.rng(smp.base_seed(prompt, job.sampling))
        token, lp = 0, None
        if job.first_token:
            assert self.logits is not None
            c = job.sampling.constraint
            guide = Guide(c, OUTPUT_IDS) if c is not None else None
            draws = gen
            if r:  # resumed: the unbroken run's first draw, then its decode stream, past r - 1 draws
                smp.skip(gen, job.sampling, 1)
                state = smp.next_state(gen)
                draws = smp.skip(smp.rng(state), job.sampling, r - 1)
                if guide is not None:
                    guide.advance([int(t) for t in token_ids(job.tokens)[self.n - r :]])
            allowed = guide.allowed() if guide is not None else None
            token, lp = smp.pick(self.logits, job.sampling, draws, smp.bias_vector(job.sampling), allowed)
            if r:  # decode continues the unbroken run's stream (``DecodeRun``)
                return PrefillOutput(pages, tail, token, state, lp)
        return PrefillOutput(pages, tail, token, smp.next_state(gen), lp)


class DecodeRun:
    """Tokens after the first: feed the last token, sample the next, until EOS or ``max_new``."""

    def __init__(self, model: TinyModel, job: DecodeJob) -> None:
        self.model = model
        self.sampling: Sampling = job.sampling
        n = len(job.tokens) // 4
        self.cache = KVCache(model.cfg, n + 1 + min(job.max_new, DECODE_HEADROOM))
        loaded = self.cache.load_pages(job.pages)
        if loaded != n:
            raise ValueError(f"decode: pages hold {loaded} tokens, the prompt has {n}")
        self.pos = n
        self.last = job.first_token
        self.remaining = job.max_new
        # Resumed: the stream past the r - 1 resumed decode draws and the one its prefill made.
        self.gen = smp.skip(smp.rng(job.state), job.sampling, job.resumed)
        self.bias = smp.bias_vector(job.sampling)
        self.ended = job.max_new <= 0
        # A constraint's matcher, past the first token (chosen by prefill under the same one).
        self.guide: Guide | None = None
        if job.sampling.constraint is not None and not self.ended:
            self.guide = Guide(job.sampling.constraint, OUTPUT_IDS)
            resumed = [int(t) for t in token_ids(job.tokens)[n - job.resumed :]] if job.resumed else []
            self.guide.advance([*resumed, job.first_token])

    def step(self, max_tokens: int, budget_s: float) -> Tokens:
        """Up to ``max_tokens`` tokens, stopping early once ``budget_s`` has passed."""
        t0 = time.perf_counter()
        out: list[int] = []
        logprobs: list[TokenLogprob] = []
        vocab = self.model.cfg.vocab
        while not self.ended and len(out) < max_tokens:
            rows = embedding_rows(np.array([self.last], dtype=np.uint32), vocab)
            logits = self.model.forward(rows, self.cache, self.pos, logits=True)
            assert logits is not None
            allowed = self.guide.allowed() if self.guide is not None else None
            token, lp = smp.pick(logits, self.sampling, self.gen, self.bias, allowed)
            if self.guide is not None:
                self.guide.advance([token])
            if lp is not None:
                logprobs.append(lp)
            out.append(token)
            self.pos += 1
            self.last = token
            self.remaining -= 1
            if token == EOS_TOKEN or self.remaining <= 0:
                self.ended = True
            if time.perf_counter() - t0 >= budget_s:
                break
        return Tokens(out, logprobs)
