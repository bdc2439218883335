"""Migration: a generation whose node fails after the first token continues on another node.

The node streaming a generation may be killed (the stream breaks), stall past
``stall_timeout_s``, end its stream without a finish, or be declared gone (its breaker opens:
``Node.gone``). The client has been sent text already; instead of an error event the gateway
starts the generation again elsewhere from the prompt plus the output token ids it has relayed
(``TokenDelta.token_ids``), with the same sampling: ``continuation`` is that request, and it goes
through the Executor's own attempt path (planning, retries, backoff, the request's deadline),
the failed nodes excluded. The new node re-prefills the longer prompt (the prompt's blocks are
mostly cached) and treats the relayed tokens as output already shown (``Prompt.resumed``): they
count as output (``max_tokens`` is what is left), their text is not sent again, the text it
holds back for a stop string or an incomplete character is what the broken node held, so the
stream joins seamlessly.

Only a protocol that reports token ids and continues from them (``Capabilities.resume``) can
take part: a pass-through HTTP worker generates from the OpenAI request, reports no ids, and its
streams still end with the error event. A constrained generation (``response_format``) only
migrates to nodes that carry its matcher's state across (``Capabilities.resume_constrained``).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from dataclasses import replace
from enum import StrEnum
from typing import TYPE_CHECKING

import structlog

from prefixgate.cachetier.hashing import block_hashes
from prefixgate.cachetier.tokenizer import pack_ids
from prefixgate.gateway.cluster.nodes import Node
from prefixgate.gateway.core.errors import GatewayError
from prefixgate.gateway.core.request import Prepared
from prefixgate.gateway.nodeclient import NodeFailure
from prefixgate.gateway.vocab import FailureKind

if TYPE_CHECKING:
    from prefixgate.gateway.core.execute import Executor
    from prefixgate.gateway.core.execution import Execution

log = structlog.get_logger("prefixgate.pipeline")


class Reason(StrEnum):
    """Why a generation migrated (``prefixgate_migrations_total{reason}``)."""

    BROKEN = "broken"  # the stream failed (the node killed, its connection lost)
    STALLED = "stalled"  # no token for stall_timeout_s
    ENDED = "ended"  # the stream ended without a finish
    GONE = "gone"  # the node was declared gone (its breaker opened)


def reason_of(failure: NodeFailure) -> Reason:
    if failure.kind == FailureKind.GONE:
        return Reason.GONE
    if failure.kind == FailureKind.TIMEOUT:
        return Reason.STALLED
    return Reason.BROKEN


# Start the continuation (``continuation``'s request) on a node outside the ids given: a new
# started execution, whose stream the broken one adopts; raises GatewayError when none starts.
Migrate = Callable[[Prepared, Collection[str], Reason], Awaitable["Execution"]]


def resumable(node: Node, prep: Prepared) -> bool:
    """Whether ``node`` can continue a generation of ``prep`` (or report what one continues from)."""
    caps = node.client.capabilities
    return caps.resume and (prep.sampling.constraint is None or caps.resume_constrained)


def unable_to_resume(nodes: Iterable[Node], prep: Prepared) -> set[str]:
    return {n.id for n in nodes if not resumable(n, prep)}


def continuation(prep: Prepared, sent: Sequence[int], block_size: int) -> Prepared:
    """The request that continues ``prep``'s generation after the output tokens ``sent``: the
    prompt followed by them (their blocks hashed in the prompt's chain, so its cached blocks are
    hits), ``resumed`` telling the node they are output, ``max_tokens`` what is left (so a context
    holds the continuation when it held the request: ``gateway.core.context``)."""
    tokens = prep.tokens + pack_ids(list(sent))
    left = max(1, prep.sampling.max_tokens - len(sent))
    return replace(
        prep,
        tokens=tokens,
        hashes=block_hashes(tokens, block_size, prep.namespace.root()),
        sampling=replace(prep.sampling, max_tokens=left),
        resumed=len(sent),
        openai_body=None,
    )


def charge(node: Node, failure: NodeFailure) -> None:
    """A stream broken mid-way is its node's failure (as ``Accounting.finished`` charges one that
    does not migrate); a node declared gone has its verdict already."""
    if failure.kind != FailureKind.GONE:
        node.breaker.on_failure(time.monotonic())
    node.last_error = str(failure)[:500]
    node.settle()


def executor_hook(executor: Executor, deadline: float) -> Migrate:
    """The Executor's attempt path for a continuation, within the request's ``deadline``."""

    async def migrate(cont: Prepared, exclude: Collection[str], reason: Reason) -> Execution:
        nodes = executor.pool.nodes.values()
        excluded = set(exclude) | unable_to_resume(nodes, cont)
        ex = await executor.execute(cont, exclude=excluded, deadline=deadline, continuing=True)
        executor.metrics.migrations.labels(reason.value).inc()
        return ex

    return migrate


async def started(
    migrate: Migrate, cont: Prepared, exclude: Collection[str], reason: Reason
) -> Execution | None:
    """The continuation's execution, or None when no node could start it (logged)."""
    try:
        return await migrate(cont, exclude, reason)
    except GatewayError as e:
        log.warning("migration_failed", request_id=cont.request_id, reason=reason.value, error=str(e)[:300])
        return None
