"""The engine contract: what a node's compute must provide, whatever it is.

The node (``backends.node``) owns the block pool, queues, KV transfer, handles, events and the
gRPC surface; an engine only computes. The simulated engine (``backends.sim``) and a future
real one (``--engine tiny``) implement this protocol and serve the same services.

Token ids are uint32. The engine's ``eos_token`` ends generation (finish_reason "stop") and is
never shown nor counted. ``state`` is a 64-bit digest of the engine's sampling state after the
first token, carried from prefill to decode so the split path continues exactly where a
monolithic run would. A resumed job (``PrefillJob.resumed``) continues a generation broken
elsewhere: the engine samples its tokens as the unbroken generation would have (same seed, same
positions), so the continuation is the unbroken run's wherever it was computed.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from prefixgate.backends.kvpages import KVFormat
from prefixgate.backends.profiles import CostProfile

DEFAULT_MAX_TOKENS = 1024
MAX_TOKENS_LIMIT = 1 << 16
MAX_TOP_LOGPROBS = 20
# Tokens decoded faster than they are streamed go out in groups of at most this many (one
# streamed chunk each); ``--stream-interval``, SGLang's flag, sets it (SGLang's own default is 1).
MAX_GROUP = 16


@dataclass(frozen=True, slots=True)
class Constraint:
    """What the output must match: ``kind`` "json_schema" (``text`` the schema's JSON), "regex",
    "ebnf" (an EBNF/GBNF grammar) or "structural_tag" (xgrammar's structural tag JSON)."""

    kind: str
    text: str


@dataclass(frozen=True, slots=True)
class Sampling:
    """Sampling and stopping (mirror of ``prefixgate.v1.SamplingParams``)."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    choice: int = 0  # which of a request's n choices: mixed into the sampling seed
    logprobs: bool = False  # report each output token's log probability
    top_logprobs: int = 0  # and this many most likely alternatives
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    constraint: Constraint | None = None  # constrained decoding (``backends.grammar``)

    @classmethod
    def normalized(
        cls,
        max_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | None,
        stop: Sequence[str],
        *,
        choice: int = 0,
        logprobs: bool = False,
        top_logprobs: int = 0,
        logit_bias: Sequence[tuple[int, float]] = (),
    ) -> Sampling:
        """Defaults for the wire's zero values: max_tokens 0 -> default, top_p 0 -> 1.
        ``temperature`` is taken as given (0 = greedy): senders fill OpenAI's default of 1."""
        mt = DEFAULT_MAX_TOKENS if max_tokens <= 0 else min(max_tokens, MAX_TOKENS_LIMIT)
        tp = 1.0 if top_p <= 0 or top_p > 1 else top_p
        temp = min(max(temperature, 0.0), 2.0)
        top = top_logprobs_within(top_logprobs) if logprobs else 0
        return cls(
            mt, temp, tp, seed, tuple(s for s in stop if s), choice, logprobs, top, bias_within(logit_bias)
        )


def top_logprobs_within(n: int) -> int:
    """How many alternatives a request may ask for, whatever protocol it came in on."""
    return min(max(n, 0), MAX_TOP_LOGPROBS)


def bias_within(pairs: Iterable[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    """A logit bias as the engine takes it: each bias within [-100, 100], by token id."""
    return tuple(sorted((int(t), min(max(float(b), -100.0), 100.0)) for t, b in pairs))


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """An output token's log probability and the most likely alternatives at its position."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log probability), most likely first


class Tokens(list[int]):
    """A group of decoded tokens; ``logprobs`` holds one per token when the request asked."""

    __slots__ = ("logprobs",)

    def __init__(self, tokens: Sequence[int] = (), logprobs: Sequence[TokenLogprob] = ()) -> None:
        super().__init__(tokens)
        self.logprobs = list(logprobs)


@dataclass(frozen=True, slots=True)
class PrefillJob:
    tokens: bytes  # the whole prompt, packed LE uint32
    block_hashes: Sequence[int]  # hashes of its full blocks (the pool's keys)
    cached_blocks: int  # leading blocks whose KV is already in the pool
    cached_pages: Sequence[bytes]  # their page bytes (a real engine attends over them)
    sampling: Sampling
    first_token: bool = True  # False: warm only, compute KV and generate nothing
    # Chunked prefill: after each ``chunk_tokens`` computed (and not after the last), the engine
    # awaits ``checkpoint(tokens computed so far)``, where the node lets waiting prefills take a
    # turn, as SGLang's scheduler admits new requests between the chunks of a long one.
    chunk_tokens: int = 0
    checkpoint: Callable[[int], Awaitable[None]] | None = None
    # The last ``resumed`` of ``tokens`` are output a broken generation already produced: the
    # first token is the one after them, sampled as that generation would have (the prompt is
    # the rest; ``backends.node.Node._generation``).
    resumed: int = 0


@dataclass(frozen=True, slots=True)
class PrefillOutput:
    new_pages: list[bytes]  # one per block after the cached ones: block_hashes[cached_blocks:]
    tail_page: bytes  # KV of the trailing partial block (b"" when the prompt ends on a boundary)
    first_token: int  # the first generated token (eos_token possible; 0 when not asked)
    state: int  # sampling state after the first token
    first_logprob: TokenLogprob | None = None  # when the sampling asked for logprobs


@dataclass(frozen=True, slots=True)
class DecodeJob:
    tokens: bytes  # the prompt
    pages: Sequence[bytes]  # KV pages of the prompt, full blocks then the tail
    first_token: int
    state: int
    sampling: Sampling
    max_new: int  # tokens to produce at most after the first one
    resumed: int = 0  # as ``PrefillJob.resumed`` (``tokens`` and ``pages`` include them)
    stream_interval: int = MAX_GROUP  # tokens a group (one streamed chunk) holds at most


class Engine(Protocol):
    name: str  # "sim", "tiny"
    # What it serves beyond plain sampling (``prefixgate.openai.features`` names). An engine
    # serving "logprobs" yields ``Tokens`` from ``decode`` and fills ``first_logprob``.
    features: frozenset[str]
    kv_format: KVFormat
    profile: CostProfile  # simulated-hardware figures (time_scale = 1)
    time_scale: float
    eos_token: int

    def prefill_seconds(self, new_tokens: int, context_tokens: int) -> float:
        """Expected wall-clock seconds of a prefill (for queue estimates)."""
        ...

    async def prefill(self, job: PrefillJob) -> PrefillOutput:
        """Compute the KV of the uncached blocks (and the first token), taking its time."""
        ...

    def decode(self, job: DecodeJob) -> AsyncGenerator[list[int], None]:
        """Tokens after the first, in small groups as they are produced; the last group ends
        with ``eos_token`` when generation ends by itself. Stops after ``max_new`` tokens.
        Closing the iterator stops the work."""
        ...

    def token_text(self, token: int) -> str:
        """Text of one output token."""
        ...

    def transfer_floor_seconds(self, shipped_bytes: int) -> float:
        """Least wall-clock time sending ``shipped_bytes`` of KV may take on the modelled link
        (the sender waits out the rest); 0 for a real link."""
        ...
