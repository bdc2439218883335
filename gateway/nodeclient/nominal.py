"""The cost profile an HTTP worker is given, in a module of its own so that the node pool can
know it without importing the HTTP adapter (and its HTTP client) in a gateway that has no HTTP
worker."""

from __future__ import annotations

from prefixgate.gateway.nodeclient.base import CostProfile
from prefixgate.gateway.routing.costmodel import S5000

# An HTTP worker states no prefill speed. Without one every prefill would look free and the
# routing policy would give a cached prefix no weight against load; this declared nominal
# figure (the reference server's) gives the cache its usual worth.
NOMINAL_PROFILE = CostProfile(
    name="nominal",
    prefill_tokens_per_s=S5000.prefill_tokens_per_s,
    attention_coeff_s=S5000.attention_coeff_s,
)
