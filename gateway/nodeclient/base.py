"""The node-client seam: what the gateway needs from a node, in the gateway's own words.

Nothing here knows a wire. An adapter (``prefixgate_grpc`` for our own nodes; ``smg_common`` with
``smg_sglang`` and ``smg_vllm`` for SGLang and vLLM over SMG's gRPC; ``http_openai`` for
OpenAI-compatible HTTP workers, ``http_pd`` for their SGLang/vLLM split serving) translates one
engine protocol into these types, the way an httpx transport turns a request into bytes;
``fake`` scripts them for tests. The pipeline, the node pool, event sync and cache operations
only ever see what is defined here.

Two contracts:

- ``NodeClient``: one node: status, KV events, cache operations, and whole-request generation.
- ``Handoff``: split serving over a (prefill, decode) pair. Engine families cooperate differently
  (ours: prefill pushes KV to the decode node, then decode streams; vLLM: prefill returns
  ``kv_transfer_params`` that are relayed to decode; SGLang: both legs start at once and meet at a
  bootstrap room), so the whole dance is the handoff's: the caller gets one token stream back.
  The vLLM and SGLang ways are written once, in ``handoff``, for every transport.

Failures are ``NodeFailure``: which node, at which stage, of which kind; never a status code.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from prefixgate.gateway.records import record
from prefixgate.gateway.routing.base import KVFormat as KVFormat  # one type: what routing pairs on
from prefixgate.gateway.vocab import EventKind, FailureKind, Stage
from prefixgate.openai.schema import Sampling


@dataclass(frozen=True, slots=True)
class CostProfile:
    """The node's own performance claims (wall-clock figures)."""

    name: str = ""
    prefill_tokens_per_s: float = 0.0
    attention_coeff_s: float = 0.0
    decode_base_s: float = 0.0
    decode_per_context_token_s: float = 0.0
    transfer_bytes_per_s: float = 0.0
    time_scale: float = 1.0


@dataclass(frozen=True, slots=True)
class NodeStatus:
    """A node's load and cache as it reports them (a snapshot, refreshed by polling)."""

    node_id: str = ""
    role: str = ""
    engine: str = ""
    kv_format: KVFormat = field(default_factory=KVFormat)
    capacity_blocks: int = 0
    used_blocks: int = 0  # held (prefixgate nodes: cached blocks included; SGLang: in use)
    pinned_blocks: int = 0
    queued_requests: int = 0
    queued_tokens: int = 0
    running_requests: int = 0
    max_queue: int = 0
    max_concurrency: int = 0
    profile: CostProfile = field(default_factory=CostProfile)
    kv_event_seq: int = 0
    instance_id: str = ""  # changes when the node restarts
    prefix_hit_tokens: int = 0
    prompt_tokens: int = 0
    # Engine features it serves beyond plain sampling (``prefixgate.openai.features``), carried
    # and honoured end to end; a node that reports none serves none (nothing is silently dropped).
    features: frozenset[str] = frozenset()
    # The model names the node serves (empty: it does not say; it serves the gateway's model).
    models: tuple[str, ...] = ()
    # Of used_blocks, the cached ones nobody holds (the node evicts them for new work); 0 when
    # the node does not say (an SGLang engine's used count already leaves them out).
    evictable_blocks: int = 0
    # The longest request the node serves, in tokens (0: it does not say): our nodes' NodeStats,
    # SMG's GetModelInfo ``max_context_length``, an HTTP worker's ``/v1/models`` ``max_model_len``.
    max_context_tokens: int = 0

    @property
    def in_use_blocks(self) -> int:
        return max(0, self.used_blocks - self.evictable_blocks)


@record
class KVEvent:
    """A change in a node's block pool; ``seq`` is consecutive per node instance.

    STORED: ``hashes`` is a chain fragment, root first, whose first block follows ``parent``
    (0: the root). REMOVED: the blocks gone. CLEARED: every block gone. SNAPSHOT: the whole pool,
    ``parents[i]`` being the parent of ``hashes[i]``, parents before children.
    """

    seq: int
    instance_id: str
    kind: EventKind
    parent: int = 0
    hashes: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()


class NodeFailure(Exception):
    """A node could not do its part of a request; ``kind`` decides whether another node is tried."""

    def __init__(self, node_id: str, stage: Stage, kind: FailureKind, detail: str) -> None:
        super().__init__(f"{stage} on {node_id}: {kind}: {detail}")
        self.node_id = node_id
        self.stage = stage
        self.kind = kind
        self.detail = detail


@record
class Capabilities:
    """What a node's protocol lets the gateway do beyond whole-request generation."""

    split: bool = False  # takes part in split serving through a Handoff
    kv_events: bool = False  # streams KV events (else the index learns only from routing)
    pin: bool = False
    evict: bool = False
    warm: bool = False  # prefill without generating
    # Engine features the protocol serves whatever the status says (a pass-through worker); None:
    # as the node's status reports (``NodeStatus.features``).
    features: frozenset[str] | None = None
    openai_body: bool = False  # generates from the normalized OpenAI request (``Prompt.openai``)
    flush: bool = False  # drop the node's whole cache (the most an engine without evict offers)
    # The protocol carries the tenant into the engine's prefix-cache key (``gateway.core.tenancy``).
    tenant_salt: bool = False
    # Streams report their output token ids (``TokenDelta.token_ids``) and the node continues a
    # generation from them (``Prompt.resumed``): a generation broken here or elsewhere migrates.
    resume: bool = False
    # ... a constrained one too (the engine carries its matcher's state past the resumed tokens).
    resume_constrained: bool = False
    # Requests carry the prompt's block hashes at the gateway's block size, one a node page: a
    # node whose page (``KVFormat.block_size``) is another refuses them all, and takes no work.
    block_hashes: bool = False


@record
class OpenAIBody:
    """The request as an OpenAI-compatible engine takes it, after the gateway's normalization:
    ``kind`` is ``chat`` or ``completion``, ``body`` the JSON object to send."""

    kind: str
    body: Mapping[str, Any]


@record
class Prompt:
    """One request as a node sees it: packed tokens, their block hashes, sampling; and, for
    nodes that generate from the OpenAI request itself (``Capabilities.openai_body``), that
    request."""

    request_id: str
    tokens: bytes  # packed little-endian uint32, 4 bytes a token
    hashes: Sequence[int]
    sampling: Sampling
    openai: OpenAIBody | None = None
    # What the engine salts its prefix cache with for this request's namespace ("": none;
    # ``gateway.core.tenancy.engine_salt``), for protocols that carry one.
    cache_salt: str = ""
    # The last ``resumed`` of ``tokens`` are output a broken generation already sent
    # (``gateway.core.migration``): the node continues it. Only for ``Capabilities.resume``.
    resumed: int = 0
    # Among the requests waiting on the node, lower is taken up earlier (vLLM's meaning; 0 the
    # default); each protocol carries it as far as its engines take it (docs/engines.md).
    priority: int = 0

    @property
    def token_count(self) -> int:
        return len(self.tokens) // 4


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One output token's log probability, and the most likely alternatives at its position.

    ``raw`` / ``top_raw``: the tokens' own bytes where they are not the UTF-8 of their text (a
    token holding part of a character); None: the text's UTF-8."""

    token_id: int
    text: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()  # (token text, log probability), most likely first
    raw: bytes | None = None
    top_raw: tuple[bytes | None, ...] = ()  # per entry of ``top`` (empty: all None)


@record
class TokenDelta:
    """One step of generation; ``completion_tokens`` is the running total (0: not reported).
    ``logprobs``: one per token of this step, when the request asked for them; ``prompt_tokens``
    is the node's own count of the prompt when it reports one (0: not). ``tool_calls``: the
    engine's own tool-call deltas (OpenAI's ``delta.tool_calls`` entries, as it sent them), from
    a worker that parses tool calls itself. ``token_ids``: the output tokens of this step (those
    whose text is held back included; never the end token), from a protocol that reports them
    (``Capabilities.resume``): what a generation broken later continues from."""

    text: str = ""
    finish_reason: str = ""
    completion_tokens: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_tokens: int = 0
    tool_calls: tuple[Mapping[str, Any], ...] = ()
    token_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class StageTimings:
    """Where the node says the time before the first token went (seconds)."""

    queue_s: float = 0.0
    prefill_s: float = 0.0
    transfer_s: float = 0.0


@dataclass(frozen=True, slots=True)
class PrefillReport:
    """What the prefill leg of a split request reports once it is done."""

    cached_tokens: int
    queue_s: float
    prefill_s: float
    transfer_s: float
    transfer_bytes: int


@runtime_checkable
class TokenStream(Protocol):
    """A started generation: iterate for deltas until one has a ``finish_reason``.

    Iteration raises ``NodeFailure`` when the node fails (before or after the first token: the
    caller decides what that means). ``cached_tokens`` and ``timings`` are filled in as the node
    reports them; ``prefill`` is set by a handoff once its prefill leg is done. ``aclose`` cancels
    the node's work if it is still running and is idempotent. A stream with a true
    ``whole_answer`` attribute gets its answer in one message (a prompt whose ``Sampling.stream``
    is false): its first delta is the last, and its wait is the whole generation's.
    """

    cached_tokens: int
    timings: StageTimings
    prefill: PrefillReport | None

    def __aiter__(self) -> AsyncIterator[TokenDelta]: ...

    async def __anext__(self) -> TokenDelta: ...

    async def aclose(self) -> None: ...


class PrefillWatched(Protocol):
    """A split stream that tells when its prefill leg is done (``on_prefill``, called once, on
    the loop, right after ``prefill`` is set): the prefill node is free for other work then,
    before the decode node's first token."""

    on_prefill: Callable[[], None] | None


class FailedStream:
    """A TokenStream whose first read raises ``failure``: how ``generate`` or ``Handoff.start``
    report what they know before anything is sent (they never raise themselves)."""

    def __init__(self, failure: NodeFailure) -> None:
        self.failure = failure
        self.cached_tokens = 0
        self.timings = StageTimings()
        self.prefill: PrefillReport | None = None
        self._done = False

    def __aiter__(self) -> FailedStream:
        return self

    async def __anext__(self) -> TokenDelta:
        if self._done:
            raise StopAsyncIteration
        self._done = True
        raise self.failure

    async def aclose(self) -> None:
        self._done = True


@runtime_checkable
class NodeClient(Protocol):
    """One node, behind whatever protocol it speaks."""

    @property
    def address(self) -> str: ...

    @property
    def capabilities(self) -> Capabilities: ...

    @property
    def handoff(self) -> Handoff | None:
        """How this node hands a prefilled request to a decode node (None: it cannot)."""
        ...

    async def status(self, timeout: float) -> NodeStatus:
        """The node's current status; raises NodeFailure (stage PROBE) when it does not answer."""
        ...

    def generate(self, prompt: Prompt, *, timeout: float) -> TokenStream:
        """Start the whole request on this node (nothing is sent before the first iteration;
        failures surface there, never from this call)."""
        ...

    def kv_events(self, since_seq: int) -> AsyncGenerator[KVEvent, None]:
        """Events after ``since_seq`` (0: a SNAPSHOT first); ends or raises when the node goes."""
        ...

    async def warm(self, prompt: Prompt, *, pin_seconds: float, timeout: float) -> PrefillReport:
        """Compute the prompt's KV (no generation), optionally pinning it."""
        ...

    async def evict(self, hashes: Sequence[int], *, everything: bool, timeout: float) -> list[int]:
        """Evict blocks (with their descendants), or everything; returns the blocks evicted."""
        ...

    async def pin(self, hashes: Sequence[int], *, seconds: float, timeout: float) -> tuple[int, int]:
        """Pin blocks the node holds; returns (pinned, missing)."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class Handoff(Protocol):
    """Serve one request on a (prefill, decode) pair and return the decode side's token stream.

    Implementations own the engine family's cooperation (push-then-decode, a relayed transfer
    token, or simultaneous legs with a bootstrap room), the cancellation of both legs, and the
    blame: a failure names the node at fault (a KV push the decode node refused is the decode
    node's failure at stage TRANSFER, not the prefill node's). Nothing is sent before the first
    iteration of the returned stream, and ``start`` never raises: what goes wrong (a pair it
    cannot serve included) surfaces on that iteration. The prefill leg's report is in
    ``stream.prefill`` once the first delta is out.
    """

    def start(
        self, prompt: Prompt, prefill: NodeClient, decode: NodeClient, *, timeout: float
    ) -> TokenStream: ...
