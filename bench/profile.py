"""Cost profiles of a simulated prefill node, for the virtual-time simulator.

The formula is the gateway's (``gateway.routing.base.prefill_seconds``): prefill of ``new``
tokens after ``ctx`` cached ones takes ``new / tps + coeff * new * (ctx + new / 2)``. The
simulated engine in ``backends/`` uses the same formula with its own copy of the numbers; they
are kept here so the benchmarks do not depend on the node servers.

``s5000``: one 8-card MTT S5000 server measured at 95,920 tok/s prefilling a 64K-token prompt
(seed white paper), of which we assume 30 % is attention at that length. Hence at 64K input
``T = 65,536 / 95,920 s``, ``tps = 65,536 / (0.7 T)`` = 137,029 tok/s for the linear part and
``coeff = 2 * 0.3 T / 65,536²``. KV size (35,136 B/token: 61 layers x 576 B of compressed
latent KV in FP8) and the 400G RoCE link (50 GB/s) are assumptions, not measurements.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.routing.base import NodeView, prefill_seconds

_REF_TOKENS = 65_536
_REF_TPS = 95_920.0
_ATTN_SHARE = 0.3
_REF_SECONDS = _REF_TOKENS / _REF_TPS


@dataclass(frozen=True, slots=True)
class CostProfile:
    name: str
    prefill_tokens_per_s: float  # linear part, at zero context
    attention_coeff_s: float  # seconds per (new token x context token)
    kv_bytes_per_token: int
    transfer_bytes_per_s: float
    first_token_s: float  # first decode step on the decode node, after the KV arrived

    def prefill_s(self, new_tokens: int, context_tokens: int) -> float:
        return prefill_seconds(self.view("_"), new_tokens, context_tokens)

    def transfer_s(self, prompt_tokens: int) -> float:
        if not self.transfer_bytes_per_s:
            return 0.0
        return prompt_tokens * self.kv_bytes_per_token / self.transfer_bytes_per_s

    def view(
        self, node_id: str, outstanding_requests: int = 0, outstanding_tokens: int = 0, capacity: int = 0
    ) -> NodeView:
        """The node as the gateway would see it (stats carry the same profile)."""
        return NodeView(
            node_id=node_id,
            outstanding_requests=outstanding_requests,
            outstanding_tokens=outstanding_tokens,
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            attention_coeff_s=self.attention_coeff_s,
            transfer_bytes_per_s=self.transfer_bytes_per_s,
            kv_bytes_per_token=self.kv_bytes_per_token,
            capacity_blocks=capacity,
        )


S5000 = CostProfile(
    name="s5000",
    prefill_tokens_per_s=_REF_TOKENS / ((1 - _ATTN_SHARE) * _REF_SECONDS),
    attention_coeff_s=2 * _ATTN_SHARE * _REF_SECONDS / (_REF_TOKENS * _REF_TOKENS),
    kv_bytes_per_token=61 * 576,
    transfer_bytes_per_s=50e9,
    first_token_s=0.03,
)

PROFILES: dict[str, CostProfile] = {S5000.name: S5000}


def get_profile(name: str) -> CostProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; choose from {sorted(PROFILES)}") from None
