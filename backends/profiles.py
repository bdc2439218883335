"""Hardware cost profiles: how long a node's prefill, decode step and KV transfer take.

All figures in a profile are *simulated hardware* seconds (time_scale = 1). A node sleeps
``figure x time_scale``; ``CostProfile.effective`` gives the wall-clock figures a node reports
in ``NodeStats.profile`` so the router's estimates are in real seconds.

The formula and the reference ``s5000`` live in ``gateway.routing.costmodel`` (the router
estimates with the same code and numbers, and the trace simulator replays with them); its
docstring gives the calibration. Other profiles:

``astar`` (the decode pool's "GPU A*" server class): time between tokens grows with context as
each step reads the sequence's KV (and, in a batch of ~24 such sequences, theirs):
``decode_base_s + decode_per_context_token_s * ctx`` = 10 ms + 0.25 µs/token, i.e. 26 ms at 64K.
Its prefill is assumed at half the S5000's (monolithic fallback is slower than the prefill pool).

``instant``: zero cost, for measuring software overhead.

``cpu``: the tiny engine (``--engine tiny``, default preset: d_model 128, 2 layers, 8 query / 2
KV heads, f32 KV of 512 bytes a token) computing on one core of a 2-core AMD EPYC VM, fitted by
``python -m prefixgate.bench.tiny_bench`` (1K/4K/16K prompts, cold and with a prefix hit): a 16K-token
prefill takes ~5 s, almost all of it attention; decode ~0.3 ms + 75 ns per context token; KV
over loopback gRPC at ~150 MB/s (the tiny engine ships its KV at full size). Tiny nodes report
it, so the router's estimates for them are in real seconds.

``transfer_bytes_per_s`` is the link between a prefill and a decode server at full KV size
(400G RoCE ≈ 50 GB/s nominal, 40 GB/s taken as achieved). 0 means unlimited.
"""

from __future__ import annotations

import math

from prefixgate.gateway.routing.costmodel import (
    MAX_RATE,
    REFERENCE_INPUT_TOKENS,
    REFERENCE_PREFILL_TOKENS_PER_S,
    S5000,
    CostProfile,
    calibrated_prefill,
)
from prefixgate.gateway.vocab import Role

__all__ = [
    "ASTAR",
    "CPU",
    "DEFAULT_PROFILE_BY_ROLE",
    "INSTANT",
    "MAX_RATE",
    "PROFILES",
    "REFERENCE_INPUT_TOKENS",
    "REFERENCE_PREFILL_TOKENS_PER_S",
    "S5000",
    "CostProfile",
    "calibrated_prefill",
    "get_profile",
    "prefill_throughput",
]


def prefill_throughput(profile: CostProfile, tokens: int, context_tokens: int = 0) -> float:
    """Tokens per second prefilling ``tokens`` new tokens after ``context_tokens`` cached."""
    seconds = profile.prefill_seconds(tokens, context_tokens)
    return math.inf if seconds <= 0 else tokens / seconds


ASTAR = CostProfile(
    name="astar",
    prefill_tokens_per_s=S5000.prefill_tokens_per_s / 2,
    attention_coeff_s=S5000.attention_coeff_s * 2,
    decode_base_s=0.010,
    decode_per_context_token_s=2.5e-7,
    transfer_bytes_per_s=S5000.transfer_bytes_per_s,
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

DEFAULT_PROFILE_BY_ROLE: dict[str, str] = {
    Role.PREFILL: "s5000",
    Role.DECODE: "astar",
    Role.MONOLITHIC: "astar",
}


def get_profile(name: str | None, role: str = "monolithic") -> CostProfile:
    """A profile by name; None or "" picks the role's default (prefill: s5000, else astar)."""
    key = name or DEFAULT_PROFILE_BY_ROLE.get(role, "astar")
    try:
        return PROFILES[key]
    except KeyError:
        raise ValueError(f"unknown profile {key!r}: choose one of {', '.join(sorted(PROFILES))}") from None
