"""Between the wire (``prefixgate.v1`` messages) and the node's own types."""

from __future__ import annotations

from collections.abc import Callable

from prefixgate.backends.engine import Sampling, TokenLogprob
from prefixgate.backends.events import KVEventRecord
from prefixgate.backends.generation import Chunk
from prefixgate.backends.kvpages import KVFormat
from prefixgate.backends.node import PrefillResult
from prefixgate.backends.stats import KV_FORMAT_FIELDS, fields_of, format_message
from prefixgate.backends.transfer import TransferHeader, WirePage
from prefixgate.v1 import node_pb2


def sampling_from_proto(p: node_pb2.SamplingParams) -> Sampling:
    return Sampling.normalized(
        p.max_tokens,
        p.temperature,
        p.top_p,
        p.seed if p.has_seed else None,
        list(p.stop),
        choice=p.choice,
        logprobs=p.logprobs,
        top_logprobs=p.top_logprobs,
        logit_bias=list(p.logit_bias.items()),
    )


def sampling_to_proto(s: Sampling) -> node_pb2.SamplingParams:
    return node_pb2.SamplingParams(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        seed=s.seed or 0,
        has_seed=s.seed is not None,
        stop=list(s.stop),
        choice=s.choice,
        logprobs=s.logprobs,
        top_logprobs=s.top_logprobs,
        logit_bias=dict(s.logit_bias),
    )


def logprob_to_proto(lp: TokenLogprob, token_text: Callable[[int], str]) -> node_pb2.TokenLogprob:
    return node_pb2.TokenLogprob(
        token_id=lp.token,
        text=token_text(lp.token),
        logprob=lp.logprob,
        top=[node_pb2.TopLogprob(text=token_text(t), logprob=v) for t, v in lp.top],
    )


def format_from_proto(p: node_pb2.KVFormat) -> KVFormat:
    return KVFormat(**fields_of(p, KV_FORMAT_FIELDS))


# Carried one for one, under the same name in the message and the node's type.
HEADER_FIELDS = ("request_id", "kv_handle", "tokens", "num_pages", "first_token", "state")
PAGE_FIELDS = ("index", "block_hash", "num_tokens", "data", "checksum")
PREFILL_FIELDS = (
    "request_id",
    "prompt_tokens",
    "cached_tokens",
    "first_token",
    "first_text",
    "kv_handle",
    "queue_seconds",
    "prefill_seconds",
    "transfer_seconds",
    "transfer_bytes",
    "state",
    "finished",
    "finish_reason",
)


def header_to_proto(h: TransferHeader) -> node_pb2.KVTransferHeader:
    return node_pb2.KVTransferHeader(
        **fields_of(h, HEADER_FIELDS), format=format_message(h.format), sampling=sampling_to_proto(h.sampling)
    )


def header_from_proto(p: node_pb2.KVTransferHeader) -> TransferHeader:
    return TransferHeader(
        **fields_of(p, HEADER_FIELDS),
        format=format_from_proto(p.format),
        sampling=sampling_from_proto(p.sampling),
    )


def page_to_proto(p: WirePage) -> node_pb2.KVPage:
    return node_pb2.KVPage(**fields_of(p, PAGE_FIELDS))


def page_from_proto(p: node_pb2.KVPage) -> WirePage:
    return WirePage(**fields_of(p, PAGE_FIELDS))


def prefill_to_proto(r: PrefillResult, token_text: Callable[[int], str]) -> node_pb2.PrefillResponse:
    """``token_text`` names the first token's log probabilities (when there are any)."""
    lp = logprob_to_proto(r.first_logprob, token_text) if r.first_logprob else None
    return node_pb2.PrefillResponse(**fields_of(r, PREFILL_FIELDS), first_logprob=lp)


def chunk_to_proto(c: Chunk, token_text: Callable[[int], str] | None = None) -> node_pb2.TokenChunk:
    """``token_text`` names the tokens of ``c.logprobs`` (required when there are any)."""
    logprobs = [logprob_to_proto(lp, token_text) for lp in c.logprobs] if token_text else []
    return node_pb2.TokenChunk(
        token_ids=c.token_ids,
        text=c.text,
        finish_reason=c.finish_reason,
        prompt_tokens=c.prompt_tokens,
        completion_tokens=c.completion_tokens,
        cached_tokens=c.cached_tokens,
        queue_seconds=c.queue_seconds,
        prefill_seconds=c.prefill_seconds,
        logprobs=logprobs,
    )


def event_to_proto(r: KVEventRecord, instance_id: str) -> node_pb2.KVEvent:
    return node_pb2.KVEvent(
        seq=r.seq,
        instance_id=instance_id,
        kind=int(r.kind),  # type: ignore[arg-type]
        parent_hash=r.parent_hash,
        block_hashes=r.block_hashes,
        parent_hashes=r.parent_hashes,
    )
