"""vLLM over the SMG engine protocol (``vllm.grpc.engine.VllmEngine``; docs/engines.md, vLLM
requests).

Differences from SGLang: sampling fields are vLLM's (``temperature`` optional, ``top_k`` 0 =
off, ``max_tokens``), string stops are kept (the engine matches them too; the gateway's stop
decoder still runs on the output), responses carry no request id and chunk ``completion_tokens``
are deltas (added up here). Abort takes a list of ids.

Split serving is the sequential ``kv_transfer_params_json`` relay (``handoff.relay`` over the
SMG legs of ``smg_legs``, NIXL-style; ``SmgRelayPair``): the prefill leg runs sanitised (no
stream, one token, no stops, ``ignore_eos``) with ``{"do_remote_decode": true}``; its
``complete`` carries the transfer parameters, relayed verbatim to the decode leg under the same
request id. No parameters back: the decode leg is still sent (it recomputes the prompt). The
Mooncake push variant (a gateway-minted ``transfer_id``) is not spoken here.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from prefixgate.gateway.nodeclient.base import KVFormat, NodeFailure, Prompt
from prefixgate.gateway.nodeclient.handoff import PrefillAnswer, RelayHandoff
from prefixgate.gateway.nodeclient.smg_common import (
    EngineInfo,
    Output,
    SmgNodeClient,
    engine_output,
)
from prefixgate.gateway.nodeclient.smg_legs import (
    SmgDecodeLeg,
    SmgPrefillLeg,
    prepared,
    smg_pairs,
)
from prefixgate.gateway.nodeclient.smg_prompt import EngineRequest
from prefixgate.gateway.vocab import FailureKind, Stage
from prefixgate.openai.constraint import Constraint
from prefixgate.openai.features import Feature
from prefixgate.openai.schema import choice_seed

PREFILL_PARAMS = json.dumps({"do_remote_decode": True, "do_remote_prefill": False})
ROLES = {"kv_producer": "prefill", "kv_consumer": "decode"}
_I32 = (1 << 31) - 1
MAX_LOGPROBS = 20  # the alternatives vLLM gives at most (its max_logprobs default)


def sampling_params(prompt: Prompt, stop_token_ids: Sequence[int]) -> pb.SamplingParams:
    s = prompt.sampling
    params = pb.SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=0,
        min_p=0.0,
        frequency_penalty=0.0,
        presence_penalty=0.0,
        repetition_penalty=1.0,
        min_tokens=0,
        stop=list(s.stop),
        stop_token_ids=list(stop_token_ids),
        skip_special_tokens=True,
        spaces_between_special_tokens=True,
        ignore_eos=False,
        n=1,
    )
    if s.max_tokens > 0:
        params.max_tokens = s.max_tokens
    if s.seed is not None:  # each choice its own seed (none: the engine samples at random)
        params.seed = choice_seed(s.seed, s.choice) & _I32
    constrain(params, s.constraint)
    return params


VLLM_CONSTRAINTS = {
    "json_schema": "json_schema",
    "regex": "regex",
    "ebnf": "grammar",
    "structural_tag": "structural_tag",
}


def constrain(params: pb.SamplingParams, constraint: Constraint | None) -> None:
    """The request's constraint into vLLM's ``constraint`` oneof (``json_schema``, ``regex``,
    ``grammar``, ``structural_tag``); ``json_object`` is sent as the schema ``{"type": "object"}``,
    which means the same and reads the same on both runtimes. The prefill leg of a split request
    runs one discarded token and carries none (the decode leg's own request does)."""
    if constraint is not None:
        setattr(params, VLLM_CONSTRAINTS[constraint.kind], constraint.text)


def ask_logprobs(params: pb.SamplingParams, prompt: Prompt) -> None:
    """Output log probabilities (``logprobs`` = the alternatives wanted, at least 1, at most 20)
    and ``logit_bias`` (int32 token ids), when asked. Only the decode leg of a split request gets
    them: it samples every output token itself, the prefill leg's one token is dropped."""
    s = prompt.sampling
    if s.logprobs:
        params.logprobs = min(max(s.top_logprobs, 1), MAX_LOGPROBS)
    for token_id, bias in s.logit_bias.items():
        if not 0 <= token_id <= _I32:
            raise NodeFailure(
                "", Stage.GENERATE, FailureKind.INVALID, f"logit_bias token id {token_id} out of range"
            )
        params.logit_bias[token_id] = bias


def prefill_params(prompt: Prompt) -> pb.SamplingParams:
    """The prefill leg: one token, length-capped (the engine returns transfer parameters only
    for a request that finished LENGTH), nothing that could stop it early."""
    s = prompt.sampling
    return pb.SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=0,
        repetition_penalty=1.0,
        max_tokens=1,
        min_tokens=0,
        ignore_eos=True,
        skip_special_tokens=True,
        n=1,
    )


class VllmRuntime:
    name = "vllm"
    service = "vllm.grpc.engine.VllmEngine"
    generate_response = pb.GenerateResponse
    matches_stop_strings = True  # ``stop`` is sent (the gateway matches them on the output too)
    # SamplingParams.seed, .logprobs, .logit_bias
    # vLLM's structured outputs are always on
    features = frozenset(
        {Feature.SEED.value, Feature.LOGPROBS.value, Feature.LOGIT_BIAS.value, Feature.RESPONSE_FORMAT.value}
    )

    def stub(self, channel: grpc.aio.Channel) -> Any:
        return pb_grpc.VllmEngineStub(channel)

    def health_request(self) -> Any:
        return pb.HealthCheckRequest()

    async def info(self, stub: Any, timeout: float) -> EngineInfo:
        model = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout)
        server = await stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=timeout)
        started = int(time.time() - server.uptime_seconds)
        layout = f"vllm/{server.kv_connector}/{server.attention_backend}"
        return EngineInfo(
            runtime=self.name,
            model_path=model.model_path,
            served_model_name=model.served_model_name,
            tokenizer_path=model.tokenizer_path,
            page_size=server.block_size,
            role=ROLES.get(server.kv_role, "monolithic"),
            kv_format=KVFormat(model.model_path, server.block_size, server.kv_cache_dtype, layout, 0),
            instance_id=f"{server.kv_engine_id or model.model_path}@{started}",
            max_running=server.max_num_seqs,
            kv_connector=server.kv_connector,
            eos_token_ids=tuple(model.eos_token_ids),
            max_context_tokens=EngineInfo.context_of(model),
        )

    async def loads(self, stub: Any, timeout: float) -> Any:
        return await stub.GetLoads(pb.GetLoadsRequest(), timeout=timeout)

    def embed_request(self, rid: str, text: str, ids: Sequence[int]) -> Any:
        return pb.EmbedRequest(request_id=rid, tokenized=pb.TokenizedInput(original_text=text, input_ids=ids))

    def request(self, prompt: Prompt, rid: str, stop_token_ids: Sequence[int], *, stream: bool) -> Any:
        """The request without its prompt ids (``smg_prompt.EngineRequest`` adds them)."""
        req = pb.GenerateRequest(
            request_id=rid,
            sampling_params=sampling_params(prompt, stop_token_ids),
            stream=stream,
        )
        ask_logprobs(req.sampling_params, prompt)
        return req

    def parse(self, msg: Any, completion_so_far: int) -> Output:
        return engine_output(msg, completion_so_far, delta_counts=True)

    async def abort(self, stub: Any, rid: str) -> None:
        await stub.Abort(pb.AbortRequest(request_ids=[rid]))

    def handoff(self) -> RelayHandoff:
        return RELAY_HANDOFF


VLLM = VllmRuntime()


def prefill_request(request: EngineRequest, prompt: Prompt) -> EngineRequest:
    """The prefill leg's request: the decode leg's, not streamed, sanitised (``prefill_params``),
    asking for the KV to be kept for a remote decode (the same ids' bytes, not a copy)."""
    leg = pb.GenerateRequest()
    leg.CopyFrom(request.message)
    leg.stream = False
    leg.sampling_params.CopyFrom(prefill_params(prompt))
    leg.kv_transfer_params_json = PREFILL_PARAMS
    return EngineRequest(leg, request.tokenized)


class SmgRelayPair:
    """One request's vLLM legs: the sanitised prefill, then the decode request with the prefill
    answer's transfer parameters verbatim (none back: sent without them)."""

    def __init__(self, prefill: SmgNodeClient, decode: SmgNodeClient, prompt: Prompt, timeout: float) -> None:
        self.p, self.d, self.prompt, self.timeout = prefill, decode, prompt, timeout
        self._request: EngineRequest | None = None
        self._decode: SmgDecodeLeg | None = None

    async def prefill_leg(self) -> SmgPrefillLeg:
        # the decode leg streams whatever the client takes: it fetches the KV once it has
        # started, and only its first item tells that the fetch is over (docs/engines.md, Aborts)
        self._request, self._decode = await prepared(
            self.p, self.d, self.prompt, self.timeout, VLLM, stream=True
        )
        leg = prefill_request(self._request, self.prompt).serialize()
        return SmgPrefillLeg(self.p, leg, self._decode.rid, self.timeout, self.prompt.token_count, whole=True)

    def decode_leg(self, answer: PrefillAnswer) -> SmgDecodeLeg:
        assert self._decode is not None and self._request is not None
        if answer.transfer_params is not None:
            self._request.message.kv_transfer_params_json = answer.transfer_params
        self._decode.request = self._request.serialize()
        return self._decode


RELAY_HANDOFF = RelayHandoff(
    smg_pairs(SmgRelayPair, "a vLLM prefill node relays KV only to a vLLM decode node")
)
