"""SGLang over the SMG engine protocol (``sglang.grpc.scheduler.SglangScheduler``), ENGINES.md §1.

Requests carry token ids only, every numeric sampling field set explicitly (proto3 zero is not
the engine's default), string stops never (single-token stops become ``stop_token_ids``; every
stop string is matched by the gateway). Chunk counters are cumulative.

Split serving is SGLang's simultaneous bootstrap (``BootstrapHandoff``): the same request (same
request id, ``disaggregated_params{prefill host, bootstrap port, fresh room}``) goes to both
legs at once; they meet at the prefill node's bootstrap port, the prefill leg completes after
the KV hand-off and the output is the decode leg's. The first delta goes out once both the
decode leg produced its first item and the prefill leg completed (its ``cached_tokens`` is the
prefix it reused). A leg failing is blamed on its node; closing aborts the prefill leg at once
and the decode leg only after its first item (aborting mid-transfer can wedge an engine).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Sequence
from typing import Any

import grpc
from google.protobuf import json_format
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from prefixgate.gateway.nodeclient.base import (
    FailedStream,
    KVFormat,
    NodeClient,
    NodeFailure,
    PrefillReport,
    Prompt,
    TokenStream,
)
from prefixgate.gateway.nodeclient.smg_common import (
    DEFAULT_BOOTSTRAP_PORT,
    EngineInfo,
    GenerateStream,
    Output,
    SmgNodeClient,
    failure,
    output_logprobs,
    packed_ids,
)
from prefixgate.gateway.vocab import FailureKind, Stage
from prefixgate.openai.constraint import Constraint
from prefixgate.openai.features import Feature, parse_features

ROOM_LIMIT = (1 << 31) - 1  # the gRPC room is int32
BLAME_GRACE_S = 0.3  # a failed decode leg waits this long for its prefill leg's own verdict
ROLES = {"prefill": "prefill", "decode": "decode"}


def sampling_params(prompt: Prompt, stop_token_ids: Sequence[int]) -> pb.SamplingParams:
    s = prompt.sampling
    params = pb.SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=-1,
        min_p=0.0,
        frequency_penalty=0.0,
        presence_penalty=0.0,
        repetition_penalty=1.0,
        stop_token_ids=list(stop_token_ids),
        skip_special_tokens=True,
        spaces_between_special_tokens=True,
        n=1,
        min_new_tokens=0,
        ignore_eos=False,
        no_stop_trim=False,
    )
    if s.max_tokens > 0:
        params.max_new_tokens = s.max_tokens
    constrain(params, s.constraint)
    return params


SGLANG_CONSTRAINTS = {
    "json_schema": "json_schema",
    "regex": "regex",
    "ebnf": "ebnf_grammar",
    "structural_tag": "structural_tag",
}


def constrain(params: pb.SamplingParams, constraint: Constraint | None) -> None:
    """The request's constraint into SGLang's ``constraint`` oneof (``json_schema``, ``regex``,
    ``ebnf_grammar``, ``structural_tag``: the grammar backend takes each as text)."""
    if constraint is not None:
        setattr(params, SGLANG_CONSTRAINTS[constraint.kind], constraint.text)


def ask_logprobs(req: pb.GenerateRequest, prompt: Prompt) -> None:
    """Output log probabilities (``return_logprob``, ``top_logprobs_num``; none of the prompt's:
    ``logprob_start_len`` stays -1) and ``logit_bias`` (token ids as strings), when asked. A split
    request sends the same to both legs: the prefill leg computes the first token's."""
    s = prompt.sampling
    if s.logprobs:
        req.return_logprob = True
        req.top_logprobs_num = s.top_logprobs
    for token_id, bias in s.logit_bias.items():
        req.sampling_params.logit_bias[str(token_id)] = bias


class SglangRuntime:
    name = "sglang"
    service = "sglang.grpc.scheduler.SglangScheduler"
    # SamplingParams has no seed: the engine samples each request at random, so a request's
    # choices (independent requests) differ, and a sampled request's ``seed`` is refused.
    features: frozenset[str] = frozenset(
        {Feature.LOGPROBS.value, Feature.LOGIT_BIAS.value, Feature.RESPONSE_FORMAT.value}
    )

    def stub(self, channel: grpc.aio.Channel) -> Any:
        return pb_grpc.SglangSchedulerStub(channel)

    def health_request(self) -> Any:
        return pb.HealthCheckRequest()

    async def info(self, stub: Any, timeout: float) -> EngineInfo:
        model = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout)
        args: dict[str, Any] = {}
        start = ""
        said: frozenset[str] | None = None
        try:
            server = await stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=timeout)
            args = json_format.MessageToDict(server.server_args)
            start = f"{server.start_time.seconds}.{server.start_time.nanos}"
            scheduler = json_format.MessageToDict(server.scheduler_info)
            if "prefixgate_features" in scheduler:  # our nodes say which they serve
                said = frozenset(f.value for f in parse_features(scheduler["prefixgate_features"]))
        except grpc.aio.AioRpcError:
            pass  # optional for smg too: the model info is enough to serve
        page = int(args.get("page_size") or 0)
        dtype = str(args.get("kv_cache_dtype") or "auto")
        layout = "sglang/{}/{}".format(
            args.get("disaggregation_transfer_backend", ""), args.get("attention_backend", "")
        )
        fingerprint = model.weight_version or model.model_path
        return EngineInfo(
            runtime=self.name,
            model_path=model.model_path,
            served_model_name=model.served_model_name,
            tokenizer_path=model.tokenizer_path,
            page_size=page,
            role=ROLES.get(str(args.get("disaggregation_mode", "null")), "monolithic"),
            kv_format=KVFormat(fingerprint, page, dtype, layout, 0),
            instance_id=start or model.weight_version,
            max_running=int(args.get("max_running_requests") or 0),
            bootstrap_port=int(args.get("disaggregation_bootstrap_port") or 0),
            eos_token_ids=tuple(model.eos_token_ids),
            features=said,
            constrains=str(args.get("grammar_backend") or "xgrammar") != "none",
        )

    async def loads(self, stub: Any, timeout: float) -> Any:
        return await stub.GetLoads(pb.GetLoadsRequest(include=["core", "memory"]), timeout=timeout)

    def request(
        self,
        prompt: Prompt,
        rid: str,
        stop_token_ids: Sequence[int],
        *,
        stream: bool,
        bootstrap: tuple[str, int, int] | None = None,
    ) -> Any:
        req = pb.GenerateRequest(
            request_id=rid,
            tokenized=pb.TokenizedInput(input_ids=packed_ids(prompt)),
            sampling_params=sampling_params(prompt, stop_token_ids),
            return_logprob=False,
            logprob_start_len=-1,
            stream=stream,
        )
        ask_logprobs(req, prompt)
        if bootstrap is not None:
            host, port, room = bootstrap
            req.disaggregated_params.CopyFrom(
                pb.DisaggregatedParams(bootstrap_host=host, bootstrap_port=port, bootstrap_room=room)
            )
        return req

    def parse(self, msg: Any, completion_so_far: int) -> Output:
        if msg.HasField("chunk"):
            c = msg.chunk
            return Output(
                False,
                list(c.token_ids),
                c.index,
                c.prompt_tokens,
                c.completion_tokens,
                c.cached_tokens,
                logprobs=output_logprobs(c),
            )
        c = msg.complete
        which = c.WhichOneof("matched_stop")
        matched = getattr(c, which) if which else None
        return Output(
            True,
            list(c.output_ids),
            c.index,
            c.prompt_tokens,
            c.completion_tokens,
            c.cached_tokens,
            c.finish_reason,
            matched,
            logprobs=output_logprobs(c),
        )

    async def abort(self, stub: Any, rid: str) -> None:
        await stub.Abort(pb.AbortRequest(request_id=rid, reason="Stream dropped"))

    def handoff(self) -> BootstrapHandoff:
        return BOOTSTRAP_HANDOFF


SGLANG = SglangRuntime()


class BootstrapStream(GenerateStream):
    """Both legs at once; this stream is the decode leg's, the prefill leg is drained aside."""

    def __init__(self, prefill: SmgNodeClient, decode: SmgNodeClient, prompt: Prompt, timeout: float) -> None:
        super().__init__(decode, prompt, timeout, Stage.DECODE)
        self.defer_abort = True
        self.p = prefill
        self.prefill_call: Any = None
        self._prefill_task: asyncio.Task[Output] | None = None
        self._prefill_done = False

    async def _prepare(self) -> Any:
        try:
            await self.p.detect(min(self.timeout, 5.0))
        except NodeFailure as e:
            raise NodeFailure(self.p.address, Stage.PREFILL, e.kind, e.detail) from e
        request = await super()._prepare()  # the decode node: detection, tokenizer, request id
        pinfo = self.p.info
        assert pinfo is not None
        port = self.p.options.bootstrap_port or pinfo.bootstrap_port or DEFAULT_BOOTSTRAP_PORT
        room = secrets.randbelow(ROOM_LIMIT)
        request.disaggregated_params.CopyFrom(
            pb.DisaggregatedParams(bootstrap_host=self.p.host, bootstrap_port=port, bootstrap_room=room)
        )
        return request

    async def start(self) -> Output | None:
        try:
            request = await self._prepare()
        except (grpc.aio.AioRpcError, TimeoutError) as e:
            self._closed = True
            raise failure(self.client.address, Stage.DECODE, e) from e
        except NodeFailure:
            self._closed = True
            raise
        if self.client.runtime is not SGLANG or self.p.runtime is not SGLANG:
            self._closed = True
            raise NodeFailure(
                self.client.address, Stage.TRANSFER, FailureKind.FORMAT_REFUSED, "not an SGLang pair"
            )
        self.prefill_call = self.p.stub.Generate(request, timeout=self.timeout)
        self.call = self.client.stub.Generate(request, timeout=self.timeout)
        self._prefill_task = asyncio.ensure_future(self._drain_prefill())
        self._prefill_task.add_done_callback(_retrieved)  # a failure after the request's end is no news
        first: asyncio.Future[Any] = asyncio.ensure_future(self.call.read())
        try:
            await asyncio.wait({first, self._prefill_task}, return_when=asyncio.FIRST_COMPLETED)
            if not first.done() and self._prefill_task.exception() is not None:
                self.defer_abort = False  # no hand-off happened: nothing is in flight to the decode node
                self._prefill_task.result()  # raises the prefill node's failure
            try:
                msg = await first
            except (grpc.aio.AioRpcError, TimeoutError) as e:
                await self._blame_prefill_first()
                raise failure(self.client.address, Stage.DECODE, e) from e
            if msg is grpc.aio.EOF:
                await self._blame_prefill_first()
                detail = "stream ended before any token"
                raise NodeFailure(self.client.address, Stage.DECODE, FailureKind.INTERNAL, detail)
            self._items += 1
            out = SGLANG.parse(msg, 0)
            report = await self._prefill_task
        except BaseException:
            if self.defer_abort and not first.done():
                self.inflight_read = first  # the deferred abort waits for it (cancelling it aborts)
            else:
                first.cancel()
            await self.aclose()
            raise
        cached = self.cached_of(report)
        self.prefill = PrefillReport(cached, 0.0, 0.0, 0.0, 0)
        self.cached_tokens = cached  # the prefill leg's count (decode's is ignored)
        return out

    async def _blame_prefill_first(self) -> None:
        """The decode leg failed before its first item; a decode leg often fails because its
        prefill leg did (no hand-off comes): when the prefill leg fails too, within a short
        grace, that failure is the one raised."""
        task = self._prefill_task
        assert task is not None
        await asyncio.wait({task}, timeout=BLAME_GRACE_S)
        if task.done() and not task.cancelled() and task.exception() is not None:
            self.defer_abort = False
            task.result()

    async def _drain_prefill(self) -> Output:
        """The prefill leg to its end: its ``complete`` (finish "length" after the hand-off)."""
        last: Output | None = None
        try:
            async for msg in self.prefill_call:
                last = SGLANG.parse(msg, 0)
        except (grpc.aio.AioRpcError, TimeoutError) as e:
            self._prefill_done = True  # the engine ended it: nothing to abort
            raise failure(self.p.address, Stage.PREFILL, e) from e
        self._prefill_done = True
        if last is None or not last.complete:
            raise NodeFailure(
                self.p.address, Stage.PREFILL, FailureKind.INTERNAL, "prefill leg ended without complete"
            )
        return last

    async def aclose(self) -> None:
        if self.prefill_call is not None and not self._prefill_done:
            # Abort first, then the call and the task reading it go (a second close finds the
            # leg taken care of: cancelling its reader now would cancel the call before the Abort)
            self._prefill_done = True
            self.p.spawn(self.p.abort_then_cancel(self.rid, self.prefill_call, self._prefill_task))
        await super().aclose()


def _retrieved(task: asyncio.Future[Output]) -> None:
    if not task.cancelled():
        task.exception()


class BootstrapHandoff:
    """SGLang split serving on a (prefill, decode) pair of SMG workers."""

    def start(
        self, prompt: Prompt, prefill: NodeClient, decode: NodeClient, *, timeout: float
    ) -> TokenStream:
        if not isinstance(prefill, SmgNodeClient) or not isinstance(decode, SmgNodeClient):
            refused = "an SGLang prefill node hands KV only to an SGLang decode node"
            return FailedStream(
                NodeFailure(decode.address, Stage.TRANSFER, FailureKind.FORMAT_REFUSED, refused)
            )
        return BootstrapStream(prefill, decode, prompt, timeout)


BOOTSTRAP_HANDOFF = BootstrapHandoff()
