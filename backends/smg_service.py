"""``sglang.grpc.scheduler.SglangScheduler`` (the SMG engine protocol) over ``backends.node.Node``.

What SGLang's gRPC servicer does, as far as a client can tell (``docs/engines.md``, "The SMG
face of our nodes"): input is token ids only; ``stream=false`` answers one ``complete`` per
index with all output ids; ``stream=true`` answers one ``chunk`` per group of new tokens
(counters cumulative: prompt, completion and cached tokens so far), then a ``complete``
repeating the last chunk's ids. Generation ends on the end token
(``matched_token_id``), on a ``stop_token_ids`` hit (the stop token is not output) or on
``max_new_tokens`` ("length"). A sampled request (temperature above 0) is sampled at random, as
SGLang samples: the protocol carries no seed. ``Abort`` ends a running request's streams with
INTERNAL "Request aborted"; an unknown id is answered with success.

PD (``disaggregated_params`` set): on a prefill node the request is prefilled, its KV pages
pushed to the decode node that presented the same bootstrap room (``backends.bootstrap``), and
the leg completes with finish "length" and no tokens; on any other node the request waits for
that handoff and then decodes, its first token included (with its log probability, when asked:
the prefill leg hands it over with the KV handle, as SGLang's transfer metadata carries it).
``cached_tokens`` is the prefix the prefill reused, on both legs.
"""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, TypeVar

import grpc
import structlog
from google.protobuf import struct_pb2, timestamp_pb2
from smg_grpc_proto.generated import common_pb2, sglang_scheduler_pb2, sglang_scheduler_pb2_grpc

from prefixgate.backends.bootstrap import DEFAULT_BOOTSTRAP_TIMEOUT_S, BootstrapServer
from prefixgate.backends.engine import Sampling, TokenLogprob, bias_within, top_logprobs_within
from prefixgate.backends.errors import FailedPrecondition, InvalidArgument, NodeError, abort_rpc
from prefixgate.backends.events import EventKind
from prefixgate.backends.generation import Chunk
from prefixgate.backends.hftok import ShippedTokenizer, bundle
from prefixgate.backends.node import Node, PrefillCall
from prefixgate.backends.pd import Room, hand_off, meet_prefill
from prefixgate.backends.smg_convert import (
    TokenMap,
    chain_hashes,
    chain_root,
    chunked,
    engine_load,
    event_batch_events,
    first_stop,
    held_blocks_events,
    pack_ids,
    sampling_from_sglang,
    token_map,
)
from prefixgate.gateway import tracing

log = structlog.get_logger("prefixgate.node")

SGLANG_SERVICE = sglang_scheduler_pb2.DESCRIPTOR.services_by_name["SglangScheduler"].full_name
TOKENIZER_CHUNK = 64 << 10
HEARTBEAT_S = 1.0
VERSION = "prefixgate-0.1.0"

T = TypeVar("T")
pb = sglang_scheduler_pb2


class Aborted(Exception):
    """The client's ``Abort`` for this request id."""


@dataclass(slots=True)
class _Outcome:
    """What one index produced so far (wire ids)."""

    ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str = ""
    matched_token_id: int | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per id, when asked (engine ids)


async def _abortable(it: AsyncIterator[T], abort: asyncio.Event) -> AsyncIterator[T]:
    """Items of ``it`` until ``abort`` is set (then ``Aborted``); ``it`` is closed either way
    (also when the call is cancelled), which stops the node's work and frees what it held."""
    waiter = asyncio.ensure_future(abort.wait())
    nxt: asyncio.Future[T] | None = None
    try:
        while True:
            nxt = asyncio.ensure_future(anext(it))
            done, _ = await asyncio.wait({nxt, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if nxt not in done:
                raise Aborted
            step, nxt = nxt, None
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        waiter.cancel()
        if nxt is not None and not nxt.done():
            nxt.cancel()
            await asyncio.gather(nxt, return_exceptions=True)
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()


def _seeded(sampling: Sampling) -> Sampling:
    """A sampled request's own random seed: SGLang's protocol carries none, and the engine
    samples every request at random (two requests of one prompt differ), as SGLang does; our
    engines would otherwise derive a fixed seed from the prompt."""
    if sampling.temperature <= 0 or sampling.seed is not None:
        return sampling
    return replace(sampling, seed=secrets.randbits(64))


def _choice(sampling: Sampling, index: int) -> Sampling:
    """Choice ``index`` of n: its own sampling stream (index 0 is the request as sent), so the
    choices differ when sampling is random, as an engine's parallel samples do."""
    if index == 0 or sampling.temperature <= 0 or sampling.seed is None:
        return sampling
    return replace(sampling, seed=(sampling.seed + index) & ((1 << 64) - 1))


# of the engine's features, those served here
SMG_FEATURES = frozenset({"logit_bias", "logprobs", "response_format"})


class SglangSchedulerService(sglang_scheduler_pb2_grpc.SglangSchedulerServicer):  # type: ignore[misc]
    """The node's SGLang-scheduler face. ``kv_address`` is where this node takes KV pages."""

    def __init__(
        self,
        node: Node,
        tokenizer: ShippedTokenizer,
        *,
        served_model_name: str,
        kv_address: Callable[[], str],
        bootstrap: BootstrapServer | None = None,
        bootstrap_timeout_s: float = DEFAULT_BOOTSTRAP_TIMEOUT_S,
        max_context_tokens: int = 0,
    ) -> None:
        self.node = node
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.kv_address = kv_address
        self.bootstrap = bootstrap
        self.bootstrap_timeout_s = bootstrap_timeout_s
        self.tokens: TokenMap = token_map(node.engine, tokenizer)
        bs = node.block_size
        self.root = chain_root(served_model_name, bs, tokenizer.path.name)
        self.max_context = max_context_tokens or node.context_tokens
        # block hash -> its tokens, for KV events (clients rebuild their index from token ids)
        self._tokens_of: OrderedDict[int, bytes] = OrderedDict()
        self._tokens_cap = max(1024, 2 * node.pool.capacity)
        self._aborts: dict[str, asyncio.Event] = {}
        self._started = time.time()
        self._load_sample = 0

    # -- helpers -----------------------------------------------------------------------------

    def _hashes(self, tokens: bytes) -> list[int]:
        bs = self.node.block_size
        hashes = chain_hashes(tokens, bs, self.root)
        stride = 4 * bs
        for i, h in enumerate(hashes):
            if h in self._tokens_of:
                self._tokens_of.move_to_end(h)
            else:
                self._tokens_of[h] = tokens[i * stride : (i + 1) * stride]
        while len(self._tokens_of) > self._tokens_cap:
            self._tokens_of.popitem(last=False)
        return hashes

    def _abort_event(self, rid: str) -> asyncio.Event:
        ev = self._aborts.get(rid)
        if ev is None:
            ev = self._aborts[rid] = asyncio.Event()
        return ev

    def _role(self) -> str:
        return {"prefill": "prefill", "decode": "decode"}.get(self.node.config.role, "null")

    # -- Generate ----------------------------------------------------------------------------

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
        rid = request.request_id or f"gen-{uuid.uuid4().hex}"
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(request_id=rid, node_id=self.node.node_id)
        traceparent = next(
            (str(v) for k, v in context.invocation_metadata() or () if k == tracing.TRACEPARENT_KEY), ""
        )
        tracing.received(traceparent)
        abort = self._abort_event(rid)
        try:
            if not request.HasField("tokenized") or not request.tokenized.input_ids:
                raise InvalidArgument("tokenized.input_ids is required (this engine takes token ids only)")
            ids = list(request.tokenized.input_ids)
            if len(ids) > self.max_context:
                raise InvalidArgument(f"prompt has {len(ids)} tokens, the context holds {self.max_context}")
            sampling = _seeded(self._surface(request, sampling_from_sglang(request.sampling_params)))
            n = request.sampling_params.n or 1
            stop_ids = frozenset(request.sampling_params.stop_token_ids)
            tokens = pack_ids(ids)
            hashes = self._hashes(tokens)
            dp = request.disaggregated_params if request.HasField("disaggregated_params") else None
            if dp is not None and dp.bootstrap_host and dp.bootstrap_port > 0:
                if n != 1:
                    raise InvalidArgument("n must be 1 for a disaggregated request (one pair per choice)")
                if self.node.config.role == "prefill":
                    async for msg in self._prefill_leg(rid, tokens, hashes, sampling, dp, abort):
                        yield msg
                else:
                    leg = self._decode_leg(rid, sampling, dp, stop_ids, len(ids))
                    async for msg in self._respond(rid, 0, leg, request.stream, abort):
                        yield msg
                return
            for index in range(n):
                chunks = self._local(tokens, hashes, _choice(sampling, index), stop_ids, len(ids))
                async for msg in self._respond(rid, index, chunks, request.stream, abort):
                    yield msg
        except NodeError as e:
            await abort_rpc(context, e)
        except Aborted:
            log.info("request aborted")
            await context.abort(grpc.StatusCode.INTERNAL, "Request aborted")
        finally:
            if self._aborts.get(rid) is abort:
                del self._aborts[rid]

    def _surface(self, request: Any, sampling: Sampling) -> Sampling:
        """A constraint, ``logit_bias`` (wire ids) and output log probabilities, on an engine that
        serves them; refused, not dropped, elsewhere (a constraint that does not compile is the
        request's FAILED_PRECONDITION). On a split request the decode leg reports log probabilities
        for every token: the first token's comes from the prefill leg with the hand-off, as SGLang's
        transfer carries it."""
        engine = self.node.engine
        if sampling.constraint is not None:
            if "response_format" not in engine.features:
                raise InvalidArgument(f"constrained decoding is not supported by the {engine.name} engine")
            from prefixgate.backends import grammar  # llguidance and numpy: a fifth of a node's start

            grammar.check(sampling.constraint)  # FAILED_PRECONDITION + smg-constraint-failed
        if request.return_logprob:
            if "logprobs" not in engine.features:
                raise InvalidArgument(f"return_logprob is not supported by the {engine.name} engine")
            sampling = replace(
                sampling, logprobs=True, top_logprobs=top_logprobs_within(request.top_logprobs_num)
            )
        bias = request.sampling_params.logit_bias
        if not bias:
            return sampling
        if "logit_bias" not in engine.features:
            raise InvalidArgument(f"logit_bias is not supported by the {engine.name} engine")
        try:
            pairs = [(self.tokens.engine(int(k)), float(v)) for k, v in bias.items()]
        except ValueError:
            raise InvalidArgument("logit_bias keys must be token ids") from None
        return replace(sampling, logit_bias=bias_within(pairs))

    def _logprobs(self, lps: list[TokenLogprob]) -> Any:
        """SGLang's ``OutputLogProbs`` (wire ids) for ``lps``."""
        wire = self.tokens.wire
        return pb.OutputLogProbs(
            token_logprobs=[lp.logprob for lp in lps],
            token_ids=[wire(lp.token) for lp in lps],
            top_logprobs=[
                pb.TopLogProbs(values=[v for _, v in lp.top], token_ids=[wire(t) for t, _ in lp.top])
                for lp in lps
            ],
        )

    async def _local(
        self,
        tokens: bytes,
        hashes: list[int],
        sampling: Sampling,
        stop_ids: frozenset[int],
        prompt: int,
    ) -> AsyncIterator[_Outcome]:
        async for out in self._translate(self.node.generate(tokens, hashes, sampling), stop_ids, prompt, []):
            yield out

    async def _decode_leg(
        self, rid: str, sampling: Sampling, dp: Any, stop_ids: frozenset[int], prompt: int
    ) -> AsyncIterator[_Outcome]:
        room = Room(dp.bootstrap_host, dp.bootstrap_port, dp.bootstrap_room)
        handed = await meet_prefill(room, rid, self.kv_address(), self.bootstrap_timeout_s)
        first = handed.first_token
        lead = [] if first == self.node.engine.eos_token else [first]
        lead_lps = [handed.first_logprob] if lead and handed.first_logprob is not None else []
        chunks = self.node.decode(handed.kv_handle, sampling)
        async for out in self._translate(chunks, stop_ids, prompt, lead, lead_lps):
            yield out

    async def _translate(
        self,
        chunks: AsyncIterator[Chunk],
        stop_ids: frozenset[int],
        prompt: int,
        lead: list[int],
        lead_logprobs: list[TokenLogprob] | None = None,
    ) -> AsyncIterator[_Outcome]:
        """Node chunks (engine ids, cumulative usage) -> outcomes holding only the new wire ids;
        the last one carries the finish. ``lead``: engine ids produced before ``chunks`` (the
        prefill's first token, on a decode leg), ``lead_logprobs`` their log probabilities."""
        pending = list(lead)
        pending_lps = list(lead_logprobs or ())
        eos = self.node.engine.eos_token
        try:
            async for chunk in chunks:
                engine_ids = pending + chunk.token_ids
                lps = pending_lps + chunk.logprobs if pending_lps or chunk.logprobs else []
                pending, pending_lps = [], []
                wire = [self.tokens.wire(t) for t in engine_ids]
                out = _Outcome(prompt_tokens=prompt, cached_tokens=chunk.cached_tokens)
                cut = first_stop(wire, stop_ids)
                if cut >= 0:
                    out.ids = wire[:cut]
                    out.finish_reason = "stop"
                    out.matched_token_id = wire[cut]
                else:
                    out.ids = wire
                    out.finish_reason = chunk.finish_reason
                    if chunk.finish_reason == "stop":
                        out.matched_token_id = self.tokens.wire(eos)
                out.logprobs = lps[: len(out.ids)]
                yield out
                if out.finish_reason:
                    return
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]

    async def _respond(
        self, rid: str, index: int, outcomes: AsyncIterator[_Outcome], stream: bool, abort: asyncio.Event
    ) -> AsyncIterator[Any]:
        ids: list[int] = []
        last: list[int] = []
        lps: list[TokenLogprob] = []
        final = _Outcome()
        async for out in _abortable(outcomes, abort):
            ids.extend(out.ids)
            lps.extend(out.logprobs)
            final = out
            if stream and (out.ids or out.finish_reason):
                last = out.ids if out.ids else last
                if out.ids:
                    yield pb.GenerateResponse(
                        request_id=rid,
                        chunk=pb.GenerateStreamChunk(
                            token_ids=out.ids,
                            prompt_tokens=out.prompt_tokens,
                            completion_tokens=len(ids),
                            cached_tokens=out.cached_tokens,
                            index=index,
                            output_logprobs=self._logprobs(out.logprobs) if out.logprobs else None,
                        ),
                    )
        complete = pb.GenerateComplete(
            output_ids=last if stream else ids,
            finish_reason=final.finish_reason or "length",
            prompt_tokens=final.prompt_tokens,
            completion_tokens=len(ids),
            cached_tokens=final.cached_tokens,
            index=index,
            output_logprobs=self._logprobs(lps) if lps else None,
        )
        if final.matched_token_id is not None:
            complete.matched_token_id = final.matched_token_id
        yield pb.GenerateResponse(request_id=rid, complete=complete)

    async def _prefill_leg(
        self, rid: str, tokens: bytes, hashes: list[int], sampling: Sampling, dp: Any, abort: asyncio.Event
    ) -> AsyncIterator[Any]:
        if self.bootstrap is None:
            raise FailedPrecondition("this prefill node has no bootstrap port (--bootstrap-port)")
        call = PrefillCall(rid, tokens, hashes, sampling)
        work = asyncio.ensure_future(hand_off(self.node, self.bootstrap, dp.bootstrap_room, call, leg_id=rid))
        aborted = asyncio.ensure_future(abort.wait())
        try:
            await asyncio.wait({work, aborted}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            aborted.cancel()
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
        if work.cancelled():
            raise Aborted
        r = work.result()
        counters = {
            "prompt_tokens": r.prompt_tokens,
            "completion_tokens": 0,
            "cached_tokens": r.cached_tokens,
        }
        complete = pb.GenerateComplete(finish_reason="length", **counters)
        yield pb.GenerateResponse(request_id=rid, complete=complete)

    # -- control -----------------------------------------------------------------------------

    async def Abort(self, request: Any, context: Any) -> Any:
        ev = self._aborts.get(request.request_id)
        if ev is not None:
            ev.set()
        log.info("abort", request_id=request.request_id, known=ev is not None, reason=request.reason)
        return pb.AbortResponse(success=True, message="" if ev is not None else "unknown or finished request")

    async def HealthCheck(self, request: Any, context: Any) -> Any:
        return pb.HealthCheckResponse(healthy=True, message="ok")

    async def Embed(self, request: Any, context: Any) -> Any:
        """The engine's embedding of the token ids (the tiny engine's pooled hidden states);
        UNIMPLEMENTED for an engine without embeddings."""
        embed = getattr(self.node.engine, "embed", None)
        if embed is None:
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED, f"the {self.node.engine.name} engine serves no embeddings"
            )
            return pb.EmbedResponse()  # not reached: abort raises
        ids = list(request.tokenized.input_ids)
        if not ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "tokenized.input_ids is required")
        if self.max_context and len(ids) > self.max_context:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the input is {len(ids)} tokens; this model's context is {self.max_context}",
            )
        vector = await embed(pack_ids(ids))
        return pb.EmbedResponse(embedding_dim=len(vector), embedding=vector, prompt_tokens=len(ids))

    async def FlushCache(self, request: Any, context: Any) -> Any:
        evicted = self.node.evict(everything=True)
        return common_pb2.FlushCacheResponse(success=True, message=f"evicted {len(evicted)} blocks")

    # -- metadata ----------------------------------------------------------------------------

    async def GetModelInfo(self, request: Any, context: Any) -> Any:
        tok = self.tokenizer
        return pb.GetModelInfoResponse(
            model_path=str(tok.path),
            tokenizer_path=str(tok.path),
            is_generation=True,
            served_model_name=self.served_model_name,
            max_context_length=self.max_context,
            max_req_input_len=self.max_context,
            vocab_size=tok.vocab_size,
            eos_token_ids=[tok.eos_token_id],
            pad_token_id=tok.pad_token_id,
            bos_token_id=tok.pad_token_id,
            model_type=f"prefixgate-{self.node.engine.name}",
            architectures=[f"prefixgate-{self.node.engine.name}"],
            supports_vision=False,
            default_sampling_params_json='{"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,'
            ' "repetition_penalty": 1.0}',
            weight_version=self.node.engine.kv_format.model_fingerprint,
        )

    def features(self) -> frozenset[str]:
        """The engine's features served on this face (in every role: a split request's decode
        leg reports every log probability, the first one handed over by the prefill leg)."""
        return SMG_FEATURES & frozenset(self.node.engine.features)

    def server_args(self) -> dict[str, Any]:
        fmt = self.node.engine.kv_format
        bs = self.node.block_size
        return {
            "model_path": str(self.tokenizer.path),
            "served_model_name": self.served_model_name,
            "tokenizer_path": str(self.tokenizer.path),
            "skip_tokenizer_init": True,
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "context_length": self.max_context,
            "max_total_tokens": self.node.pool.capacity * bs,
            "max_running_requests": self.node.config.max_decode_streams,
            "load_balance_method": "round_robin",
            "disaggregation_mode": self._role(),
            "disaggregation_transfer_backend": "prefixgate",
            "disaggregation_bootstrap_port": self.bootstrap.port if self.bootstrap is not None else 0,
            "is_embedding": False,
            "vocab_size": self.tokenizer.vocab_size,
            "weight_version": fmt.model_fingerprint,
            "kv_cache_dtype": fmt.dtype,
            "page_size": bs,
            "attention_backend": self.node.engine.name,
            # SGLang's own switch: "none" = no constrained decoding on this engine
            "grammar_backend": "llguidance" if "response_format" in self.node.engine.features else "none",
            "kv_events_config": '{"publisher": "grpc", "topic": "kv-events"}',
        }

    async def GetServerInfo(self, request: Any, context: Any) -> Any:
        args = struct_pb2.Struct()
        args.update(self.server_args())
        s = self.node.snapshot()
        info = struct_pb2.Struct()
        info.update(
            {
                "max_total_num_tokens": s.capacity_blocks * self.node.block_size,
                "node_id": s.node_id,
                # What a gateway may route here beyond plain sampling (prefixgate.openai.features).
                "prefixgate_features": sorted(self.features()),
            }
        )
        started = timestamp_pb2.Timestamp()
        started.FromSeconds(int(self._started))
        return pb.GetServerInfoResponse(
            server_args=args,
            scheduler_info=info,
            active_requests=s.running_requests,
            is_paused=False,
            last_receive_timestamp=time.time(),
            uptime_seconds=time.time() - self._started,
            sglang_version=VERSION,
            server_type="grpc",
            start_time=started,
            max_total_num_tokens=s.capacity_blocks * self.node.block_size,
        )

    async def GetLoads(self, request: Any, context: Any) -> Any:
        s = self.node.snapshot()
        bs = self.node.block_size
        # As SGLang: used = total - (free + evictable); cached blocks nobody holds are free to take.
        usage = s.in_use_blocks / s.capacity_blocks if s.capacity_blocks else 0.0
        load = pb.SchedulerLoad(
            dp_rank=0,
            num_running_reqs=s.running_requests,
            num_waiting_reqs=s.queued_requests,
            num_total_reqs=s.running_requests + s.queued_requests,
            num_used_tokens=s.in_use_blocks * bs,
            max_total_num_tokens=s.capacity_blocks * bs,
            token_usage=usage,
            gen_throughput=0.0,
            cache_hit_rate=s.prefix_hit_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
            utilization=usage,
            max_running_requests=self.node.config.max_decode_streams,
            num_waiting_uncached_tokens=s.queued_tokens,
        )
        aggregate = pb.AggregateMetrics(
            total_running_reqs=s.running_requests,
            total_waiting_reqs=s.queued_requests,
            total_reqs=s.running_requests + s.queued_requests,
            avg_token_usage=usage,
            avg_utilization=usage,
        )
        return pb.GetLoadsResponse(
            timestamp=datetime.now(UTC).isoformat(),
            version=VERSION,
            dp_rank_count=1,
            loads=[load],
            aggregate=aggregate,
        )

    async def GetTokenizer(self, request: Any, context: Any) -> AsyncIterator[Any]:
        data, sha = bundle(self.tokenizer.path)
        parts = list(chunked(data, TOKENIZER_CHUNK))
        for i, part in enumerate(parts):
            yield common_pb2.GetTokenizerChunk(data=part, sha256=sha if i == len(parts) - 1 else "")

    # -- KV events ---------------------------------------------------------------------------

    def _load(self, load_only: bool) -> Any:
        self._load_sample += 1
        s = self.node.snapshot()
        max_running = self.node.config.max_decode_streams
        return engine_load(s, self.node.block_size, max_running, self._load_sample, load_only)

    async def SubscribeKvEvents(self, request: Any, context: Any) -> AsyncIterator[Any]:
        """What the pool holds (one batch, when it holds anything), then its changes, one batch
        each, numbered 0, 1, ... on this stream; a load record on every batch and a
        ``load_only`` heartbeat each second of silence. A subscriber that falls behind the
        node's event buffer gets DATA_LOSS (clear, resubscribe)."""
        await context.send_initial_metadata(())  # at once: clients take a silent stream for dead
        if request.start_sequence_number != 0:
            await context.abort(
                grpc.StatusCode.OUT_OF_RANGE,
                f"start_sequence_number must be 0 (history is not kept), got {request.start_sequence_number}",
            )
        seq = -1
        if request.load_records_before_first_batch:
            yield common_pb2.KvEventBatch(sequence_number=0, timestamp=time.time(), load=self._load(True))
        events = self.node.events
        held = held_blocks_events(self.node.pool.snapshot(), self._tokens_of, self.node.block_size)
        follow = events.follow(events.seq)  # no await since the snapshot: nothing falls between
        first = events.seq == 0  # follow(0) starts with a snapshot of the (empty) pool
        if held:
            seq += 1
            yield common_pb2.KvEventBatch(
                sequence_number=seq, timestamp=time.time(), events=held, load=self._load(False)
            )
        nxt: asyncio.Future[Any] | None = None
        try:
            while True:
                if nxt is None:
                    nxt = asyncio.ensure_future(anext(follow))
                done, _ = await asyncio.wait({nxt}, timeout=HEARTBEAT_S)
                if not done:
                    batch = common_pb2.KvEventBatch(
                        sequence_number=max(seq, 0), timestamp=time.time(), load=self._load(True)
                    )
                    yield batch
                    continue
                try:
                    rec = nxt.result()
                except StopAsyncIteration:
                    return
                nxt = None
                if rec.kind == EventKind.SNAPSHOT:
                    if not first:
                        await context.abort(
                            grpc.StatusCode.DATA_LOSS, "KV events lost: clear and resubscribe"
                        )
                    # follow(0) starts with the pool as it is when the follower first runs: blocks
                    # stored since ``held`` was taken are in it (again sending a held one is harmless)
                    first = False
                    pairs = list(zip(rec.block_hashes, rec.parent_hashes, strict=False))
                    kv = held_blocks_events(pairs, self._tokens_of, self.node.block_size)
                else:
                    first = False
                    kv = event_batch_events(rec, self._tokens_of, self.node.block_size)
                if not kv:
                    continue
                seq += 1
                yield common_pb2.KvEventBatch(
                    sequence_number=seq, timestamp=time.time(), events=kv, load=self._load(False)
                )
        finally:
            if nxt is not None:
                nxt.cancel()
                await asyncio.gather(nxt, return_exceptions=True)  # before closing what it runs
            await follow.aclose()
