"""Split serving, each engine family's way written once, over legs that transports supply.

- ``bootstrap``: SGLang's simultaneous legs meeting at a bootstrap room.
- ``relay``: vLLM's sequential prefill, its transfer parameters relayed to the decode leg.

A handoff decides the order of the legs, their blame and when they end; a transport (the SMG
gRPC legs in ``smg_legs``, the HTTP legs in ``http_pd``) only carries legs (``legs``: start,
first item, stream, abort) whose requests an engine dialect built (``smg_sglang``, ``smg_vllm``,
``http_pd``'s bodies). Every handoff ends its legs by one abort rule (``legs.close_decode``).
A new engine family is a dialect (and, if it cooperates another way, a handoff here); a new
transport is a leg pair. Our own nodes' push-then-decode is ``prefixgate_grpc.PushHandoff``:
its decode node holds the pushed KV before the decode call starts, so nothing is ever in
flight to a decode leg there.
"""

from prefixgate.gateway.nodeclient.handoff.bootstrap import (
    DEFAULT_BOOTSTRAP_PORT,
    GRPC_ROOM_LIMIT,
    HTTP_ROOM_LIMIT,
    BootstrapHandoff,
    BootstrapPair,
    BootstrapStream,
)
from prefixgate.gateway.nodeclient.handoff.legs import (
    BLAME_GRACE_S,
    DEFERRED_ABORT_MAX_WAIT_S,
    DecodeLeg,
    PrefillAnswer,
    PrefillLeg,
    close_decode,
)
from prefixgate.gateway.nodeclient.handoff.relay import RelayHandoff, RelayPair, RelayStream
from prefixgate.gateway.nodeclient.handoff.split import PairedHandoff, PairFactory, SplitStream

__all__ = [
    "BLAME_GRACE_S",
    "DEFAULT_BOOTSTRAP_PORT",
    "DEFERRED_ABORT_MAX_WAIT_S",
    "GRPC_ROOM_LIMIT",
    "HTTP_ROOM_LIMIT",
    "BootstrapHandoff",
    "BootstrapPair",
    "BootstrapStream",
    "DecodeLeg",
    "PairFactory",
    "PairedHandoff",
    "PrefillAnswer",
    "PrefillLeg",
    "RelayHandoff",
    "RelayPair",
    "RelayStream",
    "SplitStream",
    "close_decode",
]
