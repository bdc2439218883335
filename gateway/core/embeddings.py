"""``/v1/embeddings``: to a worker that serves them, for the model, the least loaded first; a
worker that fails is not asked again for the request, and the next one is (bounded by
``retry_max_attempts``). Embeddings go to ``http://`` workers as their own ``/v1/embeddings``
(passed through, checked first) and to ``grpc://`` ones as the SMG protocol's ``Embed`` call; a
node of prefixgate's own protocol (no such call) does not take them.

``candidates`` is pure: the order the workers are asked in."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import structlog

from prefixgate.gateway.cluster.nodes import Node
from prefixgate.gateway.core.errors import NotFound, Unavailable
from prefixgate.gateway.nodeclient import NodeFailure
from prefixgate.gateway.vocab import Role
from prefixgate.openai.embeddings import EmbeddingsRequest
from prefixgate.openai.errors import APIError

log = structlog.get_logger("prefixgate.embeddings")

EMBEDDINGS_TIMEOUT_S = 60.0


class EmbeddingsClient(Protocol):
    async def embeddings(
        self, body: Mapping[str, Any], request_id: str, timeout: float
    ) -> tuple[int, Mapping[str, Any]]: ...


def serves(node: Node, model: str) -> bool:
    """The node takes embeddings for ``model``: a whole-request worker whose protocol has them,
    serving that model (or naming none)."""
    return (
        node.role == Role.MONOLITHIC.value
        and hasattr(node.client, "embeddings")
        and (not node.models or model in node.models)
    )


def candidates(nodes: Iterable[Node], model: str, tried: set[str]) -> list[Node]:
    """Routable workers serving ``model`` not tried yet, the least loaded (this gateway's
    requests on each) first, then by id."""
    found = [n for n in nodes if n.routable and n.id not in tried and serves(n, model)]
    return sorted(found, key=lambda n: (n.local_requests + n.active_streams, n.id))


async def embed(
    nodes: Mapping[str, Node],
    req: EmbeddingsRequest,
    body: Mapping[str, Any],
    request_id: str,
    attempts: int,
) -> tuple[Node, Mapping[str, Any]]:
    """The worker that answered and its answer; a worker's own 4xx is the client's error as it
    gave it (APIError); none able to answer: Unavailable (503), none serving: NotFound (404)."""
    if not any(serves(n, req.model) for n in nodes.values()):
        raise NotFound(
            f"no worker serves embeddings for model {req.model!r}", code="model_not_found", param="model"
        )
    tried: set[str] = set()
    last = "no worker is routable"
    weight = req.text_chars // 4 + sum(len(i) for i in req.inputs if not isinstance(i, str))
    for _ in range(max(1, attempts)):
        order = candidates(nodes.values(), req.model, tried)
        if not order:
            break
        node = order[0]
        tried.add(node.id)
        client: EmbeddingsClient = node.client  # type: ignore[assignment]  # ``serves`` checked it
        t0 = time.perf_counter()
        try:
            with node.load(weight):
                status, answer = await client.embeddings(body, request_id, EMBEDDINGS_TIMEOUT_S)
        except NodeFailure as e:
            node.breaker.on_failure(time.monotonic())
            last = str(e)[:300]
            continue
        if status == 200:
            log.info(
                "embeddings",
                node=node.id,
                inputs=len(req.inputs),
                ms=round((time.perf_counter() - t0) * 1000, 2),
            )
            return node, answer
        found = answer.get("error")
        error: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
        message = str(error.get("message") or answer)[:500]
        if 400 <= status < 500 and status not in (408, 429):
            raise APIError(status, message, param=error.get("param"), code=error.get("code"))
        last = f"{node.id}: HTTP {status}: {message}"
    raise Unavailable(f"no worker could serve the embeddings ({last})")
