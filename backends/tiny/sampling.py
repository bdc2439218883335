"""Choosing a token from the tiny model's logits. Pure.

Greedy when ``temperature`` is 0 (argmax, lowest class on ties). Otherwise softmax at the
temperature (in float64), nucleus cut at ``top_p`` (the smallest set of most likely classes
reaching that mass; ties ranked by class), and one uniform draw per token from a
``numpy.random.Generator``:

- prefill seeds it with ``PCG64(base)``, ``base`` = the request's seed, or without one the
  xxh3-64 digest of the prompt tokens; it draws for the first token, then draws one 64-bit word,
  the ``state`` handed to decode (``PrefillOutput.state`` -> transfer header -> ``DecodeJob``);
- decode seeds ``PCG64(state)`` and draws once per token;
- a resumed generation (``PrefillJob.resumed``: a generation broken elsewhere continues from its
  prompt and the ``r`` tokens it had produced) seeds from the prompt alone, redoes the first
  draw and ``state``, and advances ``PCG64(state)`` past the ``r - 1`` decode draws (``skip``;
  decode then past ``r``): it samples what the unbroken run would have.

So a request samples the same tokens on every path: one node, or prefill here and decode there.

Choice ``i > 0`` of a request with ``n`` choices mixes ``i`` into ``base`` (choice 0 keeps it), so
choices differ from each other and each is reproducible under a seed. ``logit_bias`` is added to
the logits of the classes of the token ids it names (ids the model cannot output are ignored)
before anything else; log probabilities are those of the biased logits at temperature 1 (the
model's distribution, not the sampler's). Under a constraint (``backends.grammar``) the classes
it does not allow are removed (logit -inf) before the choice, greedy or sampled; the log
probabilities are still the model's.
"""

from __future__ import annotations

import numpy as np
import xxhash
from numpy.typing import NDArray

from prefixgate.backends.engine import Sampling, TokenLogprob
from prefixgate.backends.tiny.vocab import CLASS_OF, OUTPUT_CLASSES, token_of_class

_MASK64 = (1 << 64) - 1


def base_seed(tokens: bytes, sampling: Sampling) -> int:
    base = sampling.seed & _MASK64 if sampling.seed is not None else xxhash.xxh3_64_intdigest(tokens)
    if sampling.choice:
        base = xxhash.xxh3_64_intdigest(base.to_bytes(8, "little") + sampling.choice.to_bytes(4, "little"))
    return base


def bias_vector(sampling: Sampling) -> NDArray[np.float32] | None:
    """The additive bias per output class (None without ``logit_bias``)."""
    if not sampling.logit_bias:
        return None
    bias = np.zeros(OUTPUT_CLASSES, dtype=np.float32)
    for token, b in sampling.logit_bias:
        cls = CLASS_OF.get(token)
        if cls is not None:
            bias[cls] += b
    return bias


def logprob_of(logits: NDArray[np.float32], cls: int, top: int) -> TokenLogprob:
    """The chosen class's log probability and the ``top`` most likely classes (ties by class)."""
    z = logits.astype(np.float64)
    z -= z.max()
    lp = z - np.log(np.exp(z).sum())
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        order = np.argsort(-lp, kind="stable")[:top]
        best = tuple((token_of_class(int(c)), float(lp[c])) for c in order)
    return TokenLogprob(token_of_class(cls), float(lp[cls]), best)


def pick(
    logits: NDArray[np.float32],
    sampling: Sampling,
    gen: np.random.Generator,
    bias: NDArray[np.float32] | None,
    allowed: NDArray[np.bool_] | None = None,
) -> tuple[int, TokenLogprob | None]:
    """The output token for one position, and its log probability when the sampling asks;
    ``allowed``: the classes a constraint lets through (None: all)."""
    if bias is not None:
        logits = logits + bias
    cls = choose(logits if allowed is None else np.where(allowed, logits, -np.inf), sampling, gen)
    lp = logprob_of(logits, cls, sampling.top_logprobs) if sampling.logprobs else None
    return token_of_class(cls), lp


def rng(seed: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(seed))


def skip(gen: np.random.Generator, sampling: Sampling, tokens: int) -> np.random.Generator:
    """``gen`` past the draws of ``tokens`` sampled tokens (one each; none when greedy): where a
    resumed generation (``PrefillJob.resumed``) picks up the unbroken run's stream."""
    if sampling.temperature > 0 and tokens > 0:
        bits: np.random.PCG64 = gen.bit_generator  # type: ignore[assignment]  # what ``rng`` seeds
        bits.advance(tokens)
    return gen


def next_state(gen: np.random.Generator) -> int:
    """A 64-bit word from the stream: the seed decode continues from."""
    return int(gen.integers(0, 1 << 64, dtype=np.uint64))


def choose(logits: NDArray[np.float32], sampling: Sampling, gen: np.random.Generator) -> int:
    """The output class for one position."""
    if sampling.temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / sampling.temperature
    z -= z.max()
    p = np.exp(z)
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    cdf = np.cumsum(p[order])
    keep = len(order)
    if sampling.top_p < 1.0:
        keep = min(len(order), int(np.searchsorted(cdf, sampling.top_p, side="left")) + 1)
    u = gen.random() * cdf[keep - 1]
    pick = min(int(np.searchsorted(cdf[:keep], u, side="right")), keep - 1)
    return int(order[pick])
