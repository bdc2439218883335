"""The simulator's node profile: the reference hardware plus what the simulator adds to it.

The hardware is ``gateway.routing.costmodel.S5000``, the very profile the simulated nodes sleep
and the router estimates with (its docstring gives the calibration: 95,920.5 tok/s at 64K input,
30 % of it attention, a 40 GB/s link). The simulator adds the KV size of the model it serves
(the nodes' reference model, 160 KiB a token, ``costmodel.REFERENCE_KV_BYTES_PER_TOKEN``) and the
first decode step on the decode node, which it does not simulate (30 ms).
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixgate.gateway.routing.base import NodeView
from prefixgate.gateway.routing.costmodel import REFERENCE_KV_BYTES_PER_TOKEN, CostProfile, transfer_seconds
from prefixgate.gateway.routing.costmodel import S5000 as S5000_HARDWARE


@dataclass(frozen=True, slots=True)
class SimProfile:
    hardware: CostProfile
    kv_bytes_per_token: int  # full KV size of the served model, charged to the link
    first_token_s: float  # first decode step on the decode node, after the KV arrived

    @property
    def name(self) -> str:
        return self.hardware.name

    def prefill_s(self, new_tokens: int, context_tokens: int) -> float:
        return self.hardware.prefill_seconds(new_tokens, context_tokens)

    def transfer_s(self, prompt_tokens: int) -> float:
        return transfer_seconds(prompt_tokens, self.kv_bytes_per_token, self.hardware.transfer_bytes_per_s)

    def view(
        self,
        node_id: str,
        outstanding_requests: int = 0,
        outstanding_tokens: int = 0,
        capacity: int = 0,
        *,
        transfer: bool = True,
    ) -> NodeView:
        """The node as the gateway would see it (its stats carry the same profile)."""
        return NodeView(
            node_id=node_id,
            outstanding_requests=outstanding_requests,
            outstanding_tokens=outstanding_tokens,
            prefill_tokens_per_s=self.hardware.prefill_tokens_per_s,
            attention_coeff_s=self.hardware.attention_coeff_s,
            transfer_bytes_per_s=self.hardware.transfer_bytes_per_s,
            kv_bytes_per_token=self.kv_bytes_per_token if transfer else 0,
            capacity_blocks=capacity,
        )


S5000 = SimProfile(S5000_HARDWARE, REFERENCE_KV_BYTES_PER_TOKEN, first_token_s=0.03)

PROFILES: dict[str, SimProfile] = {S5000.name: S5000}


def get_profile(name: str) -> SimProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; choose from {sorted(PROFILES)}") from None
