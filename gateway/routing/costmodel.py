"""The cost model: how long a prefill, a decode step and a KV transfer take. Pure arithmetic.

The simulated nodes sleep it, the router estimates with it and the trace simulator replays with
it, so all three speak of the same hardware when they say ``s5000``.

Prefill of ``new`` tokens over ``ctx`` cached tokens takes::

    new / prefill_tokens_per_s  +  attention_coeff_s * new * (ctx + new / 2)

a linear (weights) term plus causal attention, quadratic in context length.

**``S5000``** (one 8-card MTT S5000 server, the reference prefill server). The white paper
measures 95,920.5 tok/s prefilling a 64K input (taken as 65,536 tokens, no cached context). That
64K prefill time ``T = 65536 / 95920.5 = 0.6832 s`` is split into 70 % linear and 30 % attention
(a dense 70B-class GQA model spends ~30-40 % of its 64K-prefill FLOPs on attention)::

    prefill_tokens_per_s = 65536 / (0.7 T) = 95920.5 / 0.7 = 137,029 tok/s
    attention_coeff_s    = 0.3 T / (65536 * 32768)      = 9.545e-11 s

so a 64K prefill reproduces 95,920.5 tok/s, shorter prompts run faster (≈137K tok/s at 1K) and a
128K prompt slows to ≈74K tok/s. The link to the decode servers is 400G RoCE: 50 GB/s nominal,
40 GB/s taken as achieved.

**KV size.** The nodes' reference model (``backends.kvpages.REFERENCE_MODEL``): a
Llama-3.1-70B-class GQA model with an fp8 KV cache, 80 layers x 8 KV heads x 128 dims x (K, V) x
1 byte = 163,840 bytes (160 KiB) a token. It is what the nodes charge the link for, so the
simulator charges the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Reporting cap for "infinitely fast" figures: finite, so JSON and division stay well-behaved.
MAX_RATE = 1e15

REFERENCE_INPUT_TOKENS = 65_536
REFERENCE_PREFILL_TOKENS_PER_S = 95_920.5
REFERENCE_ATTENTION_SHARE = 0.30
REFERENCE_LINK_BYTES_PER_S = 40e9
REFERENCE_KV_BYTES_PER_TOKEN = 2 * 80 * 8 * 128 * 1


def prefill_seconds(
    prefill_tokens_per_s: float, attention_coeff_s: float, new_tokens: int, context_tokens: int
) -> float:
    """Seconds to prefill ``new_tokens`` after ``context_tokens`` cached ones (inf rate: free)."""
    if new_tokens <= 0:
        return 0.0
    linear = 0.0 if math.isinf(prefill_tokens_per_s) else new_tokens / prefill_tokens_per_s
    return linear + attention_coeff_s * new_tokens * (context_tokens + new_tokens / 2)


def transfer_seconds(tokens: int, bytes_per_token: float, link_bytes_per_s: float) -> float:
    """Seconds to move ``tokens`` tokens of KV over the link (0 bytes/s: unlimited)."""
    if link_bytes_per_s <= 0 or bytes_per_token <= 0:
        return 0.0
    return tokens * bytes_per_token / link_bytes_per_s


def calibrated_prefill(
    tokens_per_s_at_reference: float,
    reference_tokens: int = REFERENCE_INPUT_TOKENS,
    attention_share: float = REFERENCE_ATTENTION_SHARE,
) -> tuple[float, float]:
    """(prefill_tokens_per_s, attention_coeff_s) reproducing a measured throughput at one length."""
    total = reference_tokens / tokens_per_s_at_reference
    tps = reference_tokens / ((1.0 - attention_share) * total)
    coeff = attention_share * total / (reference_tokens * reference_tokens / 2)
    return tps, coeff


@dataclass(frozen=True, slots=True)
class CostProfile:
    """A server class's figures, in simulated hardware seconds (``effective`` scales them)."""

    name: str
    prefill_tokens_per_s: float  # linear part, at zero context; math.inf = free
    attention_coeff_s: float  # seconds per (new token x context token)
    decode_base_s: float  # seconds per output token at zero context
    decode_per_context_token_s: float
    transfer_bytes_per_s: float  # full-size KV bytes per second over the link; 0 = unlimited

    def prefill_seconds(self, new_tokens: int, context_tokens: int) -> float:
        return prefill_seconds(self.prefill_tokens_per_s, self.attention_coeff_s, new_tokens, context_tokens)

    def decode_step_seconds(self, context_tokens: int) -> float:
        """Time between tokens for a sequence of ``context_tokens``."""
        return self.decode_base_s + self.decode_per_context_token_s * context_tokens

    def transfer_seconds(self, full_bytes: float) -> float:
        """Seconds to move ``full_bytes`` of KV over the link (0 bytes/s: unlimited)."""
        if self.transfer_bytes_per_s <= 0:
            return 0.0
        return full_bytes / self.transfer_bytes_per_s

    def effective(self, time_scale: float) -> CostProfile:
        """The same profile in wall-clock figures: every duration multiplied by ``time_scale``."""
        if time_scale <= 0:
            return CostProfile(self.name, MAX_RATE, 0.0, 0.0, 0.0, 0.0)
        tps = self.prefill_tokens_per_s / time_scale
        return CostProfile(
            name=self.name,
            prefill_tokens_per_s=min(tps, MAX_RATE),
            attention_coeff_s=self.attention_coeff_s * time_scale,
            decode_base_s=self.decode_base_s * time_scale,
            decode_per_context_token_s=self.decode_per_context_token_s * time_scale,
            transfer_bytes_per_s=min(self.transfer_bytes_per_s / time_scale, MAX_RATE),
        )


_S5000_TPS, _S5000_COEFF = calibrated_prefill(REFERENCE_PREFILL_TOKENS_PER_S)

S5000 = CostProfile(
    name="s5000",
    prefill_tokens_per_s=_S5000_TPS,
    attention_coeff_s=_S5000_COEFF,
    decode_base_s=0.012,
    decode_per_context_token_s=3.0e-7,
    transfer_bytes_per_s=REFERENCE_LINK_BYTES_PER_S,
)
