"""Choosing a token from the tiny model's logits. Pure.

Greedy when ``temperature`` is 0 (argmax, lowest class on ties). Otherwise softmax at the
temperature (in float64), nucleus cut at ``top_p`` (the smallest set of most likely classes
reaching that mass; ties ranked by class), and one uniform draw per token from a
``numpy.random.Generator``:

- prefill seeds it with ``PCG64(base)``, ``base`` = the request's seed, or without one the
  xxh3-64 digest of the prompt tokens; it draws for the first token, then draws one 64-bit word,
  the ``state`` handed to decode (``PrefillOutput.state`` -> transfer header -> ``DecodeJob``);
- decode seeds ``PCG64(state)`` and draws once per token.

So a request samples the same tokens on every path: one node, or prefill here and decode there.
"""

from __future__ import annotations

import numpy as np
import xxhash
from numpy.typing import NDArray

from prefixgate.backends.engine import Sampling

_MASK64 = (1 << 64) - 1


def base_seed(tokens: bytes, sampling: Sampling) -> int:
    if sampling.seed is not None:
        return sampling.seed & _MASK64
    return xxhash.xxh3_64_intdigest(tokens)


def rng(seed: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(seed))


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
