"""Disaggregated or monolithic: the degrade switch, as a pure decision."""

from __future__ import annotations

from prefixgate.gateway.records import record
from prefixgate.gateway.vocab import Mode


@record
class ModeDecision:
    mode: Mode
    reason: str


def choose_mode(
    *,
    disaggregation: bool,
    prefill_configured: bool = True,
    prefill_routable: int,
    decode_routable: int,
    uncached_tokens: int,
    min_disagg_tokens: int,
    queue_wait_s: float,
    ttft_budget_s: float,
) -> ModeDecision:
    """Serve split only when it can and when it pays; otherwise say why not."""
    if not disaggregation:
        return ModeDecision(Mode.MONOLITHIC, "disaggregation switched off")
    if not prefill_configured:
        return ModeDecision(Mode.MONOLITHIC, "no prefill pool configured: monolithic serving")
    if decode_routable == 0:
        return ModeDecision(Mode.FALLBACK, "no decode node can take the request")
    if prefill_routable == 0:
        return ModeDecision(Mode.FALLBACK, "no prefill node can take the request")
    if uncached_tokens < min_disagg_tokens:
        return ModeDecision(
            Mode.MONOLITHIC,
            f"only {uncached_tokens} uncached tokens on a monolithic node (< {min_disagg_tokens}): "
            "the split does not pay",
        )
    if queue_wait_s > ttft_budget_s:
        return ModeDecision(
            Mode.FALLBACK,
            f"prefill queue wait {queue_wait_s:.2f}s exceeds the TTFT budget {ttft_budget_s:.2f}s",
        )
    return ModeDecision(Mode.DISAGGREGATED, "prefill pool available and the uncached part is large enough")
