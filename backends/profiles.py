"""Hardware cost profiles: how long a node's prefill, decode step and KV transfer take.

All figures in a profile are *simulated hardware* seconds (time_scale = 1). A node sleeps
``figure x time_scale``; ``CostProfile.effective`` gives the wall-clock figures a node reports
in ``NodeStats.profile`` so the router's estimates are in real seconds.

Prefill of ``new`` tokens over ``ctx`` cached tokens takes::

    new / prefill_tokens_per_s  +  attention_coeff_s * new * (ctx + new / 2)

a linear (weights) term plus causal attention, quadratic in context length. This is exactly
``gateway.routing.base.prefill_seconds``; keep the two in agreement.

Calibration of ``s5000`` (one 8-card MTT S5000 server, the reference prefill server): the white
paper measures 95,920.5 tok/s prefilling a 64K input (taken as 65,536 tokens, no cached
context). We split that 64K prefill time ``T = 65536 / 95920.5 = 0.6832 s`` into 70 % linear and
30 % attention (a dense 70B-class GQA model spends ~30-40 % of its 64K-prefill FLOPs on attention):

    prefill_tokens_per_s = 65536 / (0.7 T) = 95920.5 / 0.7 = 137,029 tok/s
    attention_coeff_s    = 0.3 T / (65536 * 32768)      = 9.545e-11 s

so a 64K prefill reproduces 95,920.5 tok/s, shorter prompts run faster (≈137K tok/s at 1K) and
a 128K prompt slows to ≈74K tok/s.

``astar`` (the decode pool's "GPU A*" server class): time between tokens grows with context as
each step reads the sequence's KV (and, in a batch of ~24 such sequences, theirs):
``decode_base_s + decode_per_context_token_s * ctx`` = 10 ms + 0.25 µs/token, i.e. 26 ms at 64K.
Its prefill is assumed at half the S5000's (monolithic fallback is slower than the prefill pool).

``instant``: zero cost, for measuring software overhead.

``cpu``: the tiny engine (``--engine tiny``, default preset: d_model 128, 2 layers, 8 query / 2
KV heads, f32 KV of 512 bytes a token) computing on one core of a 2-core AMD EPYC VM, fitted by
``python -m bench.tiny_bench`` (1K/4K/16K prompts, cold and with a prefix hit): a 16K-token
prefill takes ~5 s, almost all of it attention; decode ~0.3 ms + 75 ns per context token; KV
over loopback gRPC at ~150 MB/s (the tiny engine ships its KV at full size). Tiny nodes report
it, so the router's estimates for them are in real seconds.

``transfer_bytes_per_s`` is the link between a prefill and a decode server at full KV size
(400G RoCE ≈ 50 GB/s nominal, 40 GB/s taken as achieved). 0 means unlimited.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Reporting cap for "infinitely fast" figures: finite, so JSON and division stay well-behaved.
MAX_RATE = 1e15

REFERENCE_INPUT_TOKENS = 65_536
REFERENCE_PREFILL_TOKENS_PER_S = 95_920.5
REFERENCE_ATTENTION_SHARE = 0.30


@dataclass(frozen=True, slots=True)
class CostProfile:
    name: str
    prefill_tokens_per_s: float  # linear part, at zero context; math.inf = free
    attention_coeff_s: float  # seconds per (new token x context token)
    decode_base_s: float  # seconds per output token at zero context
    decode_per_context_token_s: float
    transfer_bytes_per_s: float  # full-size KV bytes per second over the link; 0 = unlimited

    def prefill_seconds(self, new_tokens: int, context_tokens: int) -> float:
        """Simulated seconds to prefill ``new_tokens`` after ``context_tokens`` cached ones."""
        if new_tokens <= 0:
            return 0.0
        linear = 0.0 if math.isinf(self.prefill_tokens_per_s) else new_tokens / self.prefill_tokens_per_s
        return linear + self.attention_coeff_s * new_tokens * (context_tokens + new_tokens / 2)

    def decode_step_seconds(self, context_tokens: int) -> float:
        """Simulated time between tokens for a sequence of ``context_tokens``."""
        return self.decode_base_s + self.decode_per_context_token_s * context_tokens

    def transfer_seconds(self, full_bytes: float) -> float:
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


def prefill_throughput(profile: CostProfile, tokens: int, context_tokens: int = 0) -> float:
    """Tokens per second prefilling ``tokens`` new tokens after ``context_tokens`` cached."""
    seconds = profile.prefill_seconds(tokens, context_tokens)
    return math.inf if seconds <= 0 else tokens / seconds


_S5000_TPS, _S5000_COEFF = calibrated_prefill(REFERENCE_PREFILL_TOKENS_PER_S)
_LINK_BYTES_PER_S = 40e9

S5000 = CostProfile(
    name="s5000",
    prefill_tokens_per_s=_S5000_TPS,
    attention_coeff_s=_S5000_COEFF,
    decode_base_s=0.012,
    decode_per_context_token_s=3.0e-7,
    transfer_bytes_per_s=_LINK_BYTES_PER_S,
)

ASTAR = CostProfile(
    name="astar",
    prefill_tokens_per_s=_S5000_TPS / 2,
    attention_coeff_s=_S5000_COEFF * 2,
    decode_base_s=0.010,
    decode_per_context_token_s=2.5e-7,
    transfer_bytes_per_s=_LINK_BYTES_PER_S,
)

INSTANT = CostProfile(
    name="instant",
    prefill_tokens_per_s=math.inf,
    attention_coeff_s=0.0,
    decode_base_s=0.0,
    decode_per_context_token_s=0.0,
    transfer_bytes_per_s=0.0,
)

CPU = CostProfile(
    name="cpu",
    prefill_tokens_per_s=40_000.0,
    attention_coeff_s=3.8e-8,
    decode_base_s=3.0e-4,
    decode_per_context_token_s=7.5e-8,
    transfer_bytes_per_s=1.5e8,
)

PROFILES: dict[str, CostProfile] = {
    "s5000": S5000,
    "astar": ASTAR,
    "instant": INSTANT,
    "cpu": CPU,
}

DEFAULT_PROFILE_BY_ROLE = {"prefill": "s5000", "decode": "astar", "monolithic": "astar"}


def get_profile(name: str | None, role: str = "monolithic") -> CostProfile:
    """A profile by name; None or "" picks the role's default (prefill: s5000, else astar)."""
    key = name or DEFAULT_PROFILE_BY_ROLE.get(role, "astar")
    try:
        return PROFILES[key]
    except KeyError:
        raise ValueError(f"unknown profile {key!r}: choose one of {', '.join(sorted(PROFILES))}") from None
