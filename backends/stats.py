"""``prefixgate.v1.NodeStats``, the message a node reports its load and cache in: one field map
for the node that writes it (``stats_message``) and the gateway client that reads it
(``node_status``), so the two cannot drift apart.

Light on purpose: the gateway imports it, so it needs nothing of the node but the message.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from prefixgate.gateway.routing.base import KVFormat
from prefixgate.v1 import node_pb2

if TYPE_CHECKING:
    from prefixgate.backends.node import NodeSnapshot
    from prefixgate.gateway.nodeclient.base import NodeStatus

# Carried one for one, under the same name in the message and in both sides' types.
STATS_FIELDS = (
    "node_id",
    "role",
    "engine",
    "capacity_blocks",
    "used_blocks",
    "pinned_blocks",
    "evictable_blocks",
    "queued_requests",
    "queued_tokens",
    "running_requests",
    "max_queue",
    "max_concurrency",
    "kv_event_seq",
    "instance_id",
    "prefix_hit_tokens",
    "prompt_tokens",
    "max_context_tokens",
)
KV_FORMAT_FIELDS = ("model_fingerprint", "block_size", "dtype", "layout", "bytes_per_token")
# ``time_scale`` rides in the message's profile; the node keeps it beside its profile.
PROFILE_FIELDS = (
    "name",
    "prefill_tokens_per_s",
    "attention_coeff_s",
    "decode_base_s",
    "decode_per_context_token_s",
    "transfer_bytes_per_s",
)


def fields_of(source: Any, names: Sequence[str]) -> dict[str, Any]:
    return {name: getattr(source, name) for name in names}


def format_message(fmt: Any) -> node_pb2.KVFormat:
    """Any KV format type with the message's field names (the node's, the gateway's)."""
    return node_pb2.KVFormat(**fields_of(fmt, KV_FORMAT_FIELDS))


def stats_message(s: NodeSnapshot, features: Iterable[str]) -> node_pb2.NodeStats:
    """The node's snapshot on the wire; ``features``: those served on this protocol."""
    return node_pb2.NodeStats(
        **fields_of(s, STATS_FIELDS),
        kv_format=format_message(s.kv_format),
        profile=node_pb2.CostProfile(**fields_of(s.profile, PROFILE_FIELDS), time_scale=s.time_scale),
        features=sorted(features),
    )


def kv_format(msg: node_pb2.KVFormat) -> KVFormat:
    return KVFormat(**fields_of(msg, KV_FORMAT_FIELDS))


def node_status(msg: node_pb2.NodeStats) -> NodeStatus:
    """The gateway's ``NodeStatus`` of a node's report."""
    # Imported here, not above: the gateway's nodeclient package imports this module.
    from prefixgate.gateway.nodeclient.base import CostProfile, NodeStatus

    p = msg.profile
    return NodeStatus(
        **fields_of(msg, STATS_FIELDS),
        kv_format=kv_format(msg.kv_format),
        profile=CostProfile(**fields_of(p, PROFILE_FIELDS), time_scale=p.time_scale),
        features=frozenset(msg.features),
    )
