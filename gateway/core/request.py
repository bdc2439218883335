"""What the request path hands from stage to stage: the request's context, the prepared request
and its attempts' parts.

``RequestContext`` is made once, by the runner's entry (``gateway.core.runner``), from what the
front end read off its transport, and handed down: to preparing, in ``Prepared``, to the job and
the execution. ``Prepared`` is built once (``gateway.core.prepare``) from the context and the
parsed request and is never changed afterwards: what routing learns of a
request is carried by the stages' own values (``gateway.core.plan.Lookup``, the execution's
notes), so the ``n`` choices of one request can share it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import StrEnum

from prefixgate.cachetier.hashing import Namespace
from prefixgate.gateway.cluster.nodes import Node
from prefixgate.gateway.nodeclient import NodeFailure, OpenAIBody, StageTimings, TokenDelta
from prefixgate.gateway.records import record
from prefixgate.openai.features import Feature
from prefixgate.openai.normalize import Layout
from prefixgate.openai.schema import Sampling

Delta = TokenDelta  # what an execution streams to the front ends


class Credentials(StrEnum):
    """What a request must present: a client API key, or the admin's token (or loopback)."""

    CLIENT = "client"
    ADMIN = "admin"


@record
class RequestContext:
    """Who a request is and what its front end read of it, made once when it enters.

    No deadline is carried: the request's deadline runs from the start of its execution
    (``gateway.core.execute``), whatever the front end."""

    tenant: str  # whom it runs as: the API key's; without keys the shared one; the admin's choice
    request_id: str = ""  # the client's or a new one; "": one is made when it is prepared
    credentials: Credentials = Credentials.CLIENT  # what the runner checked it presented
    body_bytes: int = 0  # the size of the body the front end read: how heavy preparing it is
    key_id: str = ""  # the API key's id (``auth.key_id``: a digest, never the key); "": no key
    # The scheduler's hints from the headers (``gateway.core.queueing``): a class name ("": the
    # body's priority or the default class) and a TTFT target (None: the class's).
    priority_class: str = ""
    ttft_slo_ms: float | None = None

    def with_body(self, size: int) -> RequestContext:
        """Once the front end has read the body. Every field by name: ``replace`` walks the
        fields and their defaults on every request (a test holds this to ``replace``)."""
        return RequestContext(
            self.tenant,
            self.request_id,
            self.credentials,
            size,
            self.key_id,
            self.priority_class,
            self.ttft_slo_ms,
        )

    def acting_for(self, tenant: str) -> RequestContext:
        """An admin's request run for the tenant it names."""
        return replace(self, tenant=tenant)


@dataclass(slots=True)
class Switches:
    disaggregation: bool = True
    prefix_routing: bool = True
    normalization: bool = True


@record
class Prepared:
    context: RequestContext
    request_id: str  # the context's, or a choice's own (``gateway.core.choices``)
    namespace: Namespace
    layout: Layout
    tokens: bytes
    hashes: list[int]
    sampling: Sampling
    model: str
    needs: dict[Feature, str] = field(default_factory=dict)  # engine features asked for, by field
    # The request as an OpenAI-compatible HTTP worker takes it; built only for such a node.
    openai_body: Callable[[], OpenAIBody] | None = None
    # The tool-call format the gateway parses the answer with ("": none; ``gateway.toolcalls``).
    tool_parser: str = ""
    # What engines salt their prefix cache with for ``namespace`` (``gateway.core.tenancy.engine_salt``).
    engine_salt: str = ""
    # The request's fields, for the client's 400 when no context holds it (``gateway.core.context``):
    # the prompt's, and the one that gave ``max_tokens`` ("": the gateway chose it).
    prompt_param: str = "prompt"
    max_tokens_param: str = ""
    # A migrated generation's continuation (``gateway.core.migration``): the last ``resumed`` of
    # ``tokens`` are output already sent to the client.
    resumed: int = 0
    # When its nodes take it up, among those waiting (vLLM's meaning: lower earlier, 0 the
    # default): the client's ``priority``, or what the gateway sets; every node request carries
    # it (``nodeclient.Prompt.priority``). ``priority_given``: the client sent one.
    priority: int = 0
    priority_given: bool = False

    @property
    def tenant(self) -> str:
        return self.context.tenant

    @property
    def prompt_tokens(self) -> int:
        return len(self.tokens) // 4


@dataclass(slots=True)
class Timings:
    """An attempt's clock, from its start to its first token, with the node's account of the
    time in between."""

    start: float = field(default_factory=time.perf_counter)
    node: StageTimings = field(default_factory=StageTimings)
    first_token_at: float = 0.0


@dataclass(frozen=True, slots=True)
class Failure:
    """One attempt's failure, charged to the node at fault; ``prefilled_on``: the prefill node
    that had done its part before it (it holds the prompt's prefix now), if any."""

    node: Node
    error: NodeFailure
    prefilled_on: Node | None = None

    def __str__(self) -> str:
        e = self.error
        return f"{e.stage} on {self.node.id}: {e.kind}: {e.detail}"
