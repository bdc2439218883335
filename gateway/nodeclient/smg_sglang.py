"""SGLang over the SMG engine protocol (``sglang.grpc.scheduler.SglangScheduler``; docs/engines.md,
SGLang requests).

Requests carry token ids only, every numeric sampling field set explicitly (proto3 zero is not
the engine's default), string stops never (single-token stops become ``stop_token_ids``; every
stop string is matched by the gateway). Chunk counters are cumulative.

Split serving is SGLang's simultaneous bootstrap (``handoff.bootstrap``) over the SMG legs
(``smg_legs``): the same request (same request id, ``disaggregated_params{prefill host,
bootstrap port, fresh int32 room}``) to both legs at once (``SmgBootstrapPair``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
from google.protobuf import json_format
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from prefixgate.gateway.nodeclient.base import KVFormat, Prompt
from prefixgate.gateway.nodeclient.handoff import (
    DEFAULT_BOOTSTRAP_PORT,
    GRPC_ROOM_LIMIT,
    BootstrapHandoff,
)
from prefixgate.gateway.nodeclient.smg_common import (
    EngineInfo,
    Output,
    SmgNodeClient,
    engine_output,
    streams,
)
from prefixgate.gateway.nodeclient.smg_legs import (
    SmgDecodeLeg,
    SmgPrefillLeg,
    prepared,
    smg_pairs,
)
from prefixgate.openai.constraint import Constraint
from prefixgate.openai.features import Feature, parse_features

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
    generate_response = pb.GenerateResponse
    matches_stop_strings = False  # string stops are never sent (single-token ones as ids)
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
            max_context_tokens=EngineInfo.context_of(model),
            features=said,
            constrains=str(args.get("grammar_backend") or "xgrammar") != "none",
        )

    async def loads(self, stub: Any, timeout: float) -> Any:
        return await stub.GetLoads(pb.GetLoadsRequest(include=["core", "memory"]), timeout=timeout)

    def embed_request(self, rid: str, text: str, ids: Sequence[int]) -> Any:
        return pb.EmbedRequest(request_id=rid, tokenized=pb.TokenizedInput(original_text=text, input_ids=ids))

    def request(self, prompt: Prompt, rid: str, stop_token_ids: Sequence[int], *, stream: bool) -> Any:
        """The request without its prompt ids (``smg_prompt.EngineRequest`` adds them)."""
        req = pb.GenerateRequest(
            request_id=rid,
            sampling_params=sampling_params(prompt, stop_token_ids),
            return_logprob=False,
            logprob_start_len=-1,
            stream=stream,
        )
        ask_logprobs(req, prompt)
        return req

    def parse(self, msg: Any, completion_so_far: int) -> Output:
        return engine_output(msg, completion_so_far, delta_counts=False)

    async def abort(self, stub: Any, rid: str) -> None:
        await stub.Abort(pb.AbortRequest(request_id=rid, reason="Stream dropped"))

    def handoff(self) -> BootstrapHandoff:
        return BOOTSTRAP_HANDOFF


SGLANG = SglangRuntime()


def with_bootstrap(request: Any, host: str, port: int, room: int) -> None:
    """Where the decode leg meets the prefill leg: the prefill node's host and bootstrap port,
    the request's room (docs/engines.md, SGLang PD: bootstrap host, port and room)."""
    request.disaggregated_params.CopyFrom(
        pb.DisaggregatedParams(bootstrap_host=host, bootstrap_port=port, bootstrap_room=room)
    )


class SmgBootstrapPair:
    """One request's two SGLang legs: the decode node's request, with the bootstrap room, to both
    (serialized once). Not streamed when the client takes the answer whole (``whole_answer``):
    both legs then ask for one ``complete``, and the prefill leg's end, after the hand-off, tells
    that no KV is in flight to the decode leg any more (docs/engines.md, Aborts)."""

    room_limit = GRPC_ROOM_LIMIT

    def __init__(self, prefill: SmgNodeClient, decode: SmgNodeClient, prompt: Prompt, timeout: float) -> None:
        self.p, self.d, self.prompt, self.timeout = prefill, decode, prompt, timeout
        self.whole_answer = not streams(SGLANG, prompt)

    async def legs(self, room: int) -> tuple[SmgPrefillLeg, SmgDecodeLeg]:
        request, decode = await prepared(
            self.p, self.d, self.prompt, self.timeout, SGLANG, stream=not self.whole_answer
        )
        assert self.p.info is not None
        port = self.p.options.bootstrap_port or self.p.info.bootstrap_port or DEFAULT_BOOTSTRAP_PORT
        with_bootstrap(request.message, self.p.host, port, room)
        decode.request = data = request.serialize()
        prefill = SmgPrefillLeg(
            self.p, data, decode.rid, self.timeout, self.prompt.token_count, whole=self.whole_answer
        )
        return prefill, decode


BOOTSTRAP_HANDOFF = BootstrapHandoff(
    smg_pairs(SmgBootstrapPair, "an SGLang prefill node hands KV only to an SGLang decode node")
)
