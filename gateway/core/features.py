"""Which nodes can serve a request's engine-dependent features; a 400 when none of the pool can.

A node serves what its adapter claims for every node of its protocol (``Capabilities.features``,
a pass-through worker) or else what its status reports (``NodeStatus.features``); a node that
reports nothing serves nothing beyond plain sampling, since a feature the adapter does not carry
to the engine would be silently dropped (a node not yet polled likewise). Checked before
routing: nodes that cannot serve the request are left out of the plan, and when that leaves none,
the client gets a 400 naming the field that asks for the feature, never a 503.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prefixgate.gateway.cluster.nodes import Node
from prefixgate.openai.exceptions import InvalidRequest
from prefixgate.openai.features import Feature, refusal


def served(node: Node) -> frozenset[str]:
    """The features ``node`` serves."""
    claimed = node.client.capabilities.features
    if claimed is not None:
        return claimed
    return node.status.features if node.status is not None else frozenset()


def missing(node: Node, needs: Mapping[Feature, str]) -> Feature | None:
    """The first feature of ``needs`` the node does not serve (None: it serves them all)."""
    have = served(node)
    return next((f for f in needs if f.value not in have), None)


def unable(nodes: Iterable[Node], needs: Mapping[Feature, str]) -> set[str]:
    """Ids of the nodes that cannot serve the request; raises ``InvalidRequest`` when that is
    every node there is (naming the field of the first feature missing)."""
    if not needs:
        return set()
    nodes = list(nodes)
    lacking = {n.id: f for n in nodes if (f := missing(n, needs)) is not None}
    if nodes and len(lacking) == len(nodes):
        feature = next(f for f in needs if f in lacking.values())
        engines = sorted({n.status.engine for n in nodes if n.status is not None and n.status.engine})
        raise InvalidRequest(
            refusal(feature, ", ".join(engines) or "unknown"),
            param=needs[feature],
            code="unsupported_parameter",
        )
    return set(lacking)
