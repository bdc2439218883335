"""A Generate request made in two parts (``smg_prompt.EngineRequest``: the message without its
ids, and the ids' field made from the packed ids) is the request the protobuf way makes: for
both runtimes, any ids (the u32 extremes, empty prompts), a split prefill leg's request too, and
the varints are protobuf's own."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from smg_grpc_proto.generated import sglang_scheduler_pb2, vllm_engine_pb2

from prefixgate.cachetier.tokenizer import pack_ids
from prefixgate.gateway.nodeclient.smg_prompt import NUMPY_FROM_IDS, EngineRequest, tokenized_field, varints
from prefixgate.gateway.nodeclient.smg_sglang import SGLANG
from prefixgate.gateway.nodeclient.smg_vllm import VLLM, prefill_request
from tests.smgwire.test_sglang_adapter import prompt

IDS = st.lists(
    st.one_of(
        st.integers(0, 200_000), st.sampled_from([0, 127, 128, 16_383, 16_384, 2**21, 2**28, 2**32 - 1])
    ),
    max_size=400,
)
RUNTIMES: list[tuple[Any, Any]] = [(SGLANG, sglang_scheduler_pb2), (VLLM, vllm_engine_pb2)]


def protobufs_way(runtime: Any, pb: Any, ids: list[int], stream: bool) -> Any:
    """The request as the message itself would carry the ids."""
    req = runtime.request(prompt(ids, 7, stop=("\n",)), "rid-1", [5, 9], stream=stream)
    req.tokenized.CopyFrom(pb.TokenizedInput(input_ids=ids))
    return req


@pytest.mark.parametrize(("runtime", "pb"), RUNTIMES, ids=["sglang", "vllm"])
@settings(max_examples=60, deadline=None)
@given(ids=IDS, stream=st.booleans())
def test_the_two_parts_are_the_request_protobuf_makes(
    runtime: Any, pb: Any, ids: list[int], stream: bool
) -> None:
    message = runtime.request(prompt(ids, 7, stop=("\n",)), "rid-1", [5, 9], stream=stream)
    sent = EngineRequest(message, tokenized_field(pack_ids(ids))).serialize()
    assert pb.GenerateRequest.FromString(sent) == protobufs_way(runtime, pb, ids, stream)


@settings(max_examples=60, deadline=None)
@given(IDS)
def test_varints_are_protobufs_own(ids: list[int]) -> None:
    whole = sglang_scheduler_pb2.TokenizedInput(input_ids=ids).SerializeToString()
    assert tokenized_field(pack_ids(ids)).endswith(whole)
    assert whole.endswith(varints(pack_ids(ids)))


@settings(max_examples=20, deadline=None)
@given(IDS, st.integers(0, 300))
def test_both_ways_of_making_the_varints_give_protobufs_field(ids: list[int], more: int) -> None:
    """Short prompts are encoded by protobuf, long ones by numpy: either side of the switch."""
    long = (ids * (NUMPY_FROM_IDS // max(1, len(ids)) + 1) + list(range(more)))[: NUMPY_FROM_IDS + more]
    for some in (ids, long, long[: NUMPY_FROM_IDS - 1]):
        whole = sglang_scheduler_pb2.TokenizedInput(input_ids=some).SerializeToString()
        assert tokenized_field(pack_ids(some)).endswith(whole)


def test_a_prefill_legs_request_keeps_the_ids_and_changes_the_rest() -> None:
    ids = list(range(1_000, 41_000))
    p = prompt(ids, 7)
    decode = EngineRequest(VLLM.request(p, "rid-2", [], stream=True), tokenized_field(pack_ids(ids)))
    leg = vllm_engine_pb2.GenerateRequest.FromString(prefill_request(decode, p).serialize())
    assert list(leg.tokenized.input_ids) == ids and not leg.stream and leg.kv_transfer_params_json
    again = vllm_engine_pb2.GenerateRequest.FromString(decode.serialize())
    assert again.stream and not again.HasField("kv_transfer_params_json")  # the decode leg's as it was
