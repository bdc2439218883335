"""The OpenAI request surface below HTTP: schema, image identity in block hashes, feature routing,
and the tiny engine's sampling additions."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from prefixgate.backends.engine import Sampling as EngineSampling
from prefixgate.backends.tiny import sampling as smp
from prefixgate.backends.tiny.vocab import CLASS_OF, OUTPUT_CLASSES, OUTPUT_IDS
from prefixgate.cachetier.hashing import block_hashes
from prefixgate.cachetier.tokenizer import Bytes4Tokenizer
from prefixgate.gateway.core import choices
from prefixgate.gateway.core.errors import InvalidRequest, StreamBroken
from prefixgate.gateway.core.request import RequestContext
from prefixgate.gateway.nodeclient.base import Capabilities
from prefixgate.gateway.nodeclient.fake import Fail, FakeNodeClient, Tokens, fake_status
from prefixgate.gateway.vocab import FailureKind, Mode
from prefixgate.openai.features import Feature
from prefixgate.openai.normalize import render_chat
from prefixgate.openai.schema import parse_request
from tests.unit.seam_support import harness

KW: dict[str, Any] = {"models": {"m"}, "default_max_tokens": 16, "max_tokens_limit": 64, "max_documents": 4}
PNG_A = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk"
PNG_B = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNl"


def chat(**fields: Any) -> Any:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_request(body, "chat", **KW)


# -- schema --------------------------------------------------------------------------------------


def test_surface_fields_parse_into_the_request() -> None:
    r = chat(n=3, logprobs=True, top_logprobs=4, logit_bias={"17": -5, "3": 2.5}, seed=9)
    assert r.n == 3 and r.sampling.logprobs and r.sampling.top_logprobs == 4 and r.sampling.seed == 9
    assert r.sampling.logit_bias == {17: -5.0, 3: 2.5}
    assert r.needs == {Feature.LOGPROBS: "logprobs", Feature.LOGIT_BIAS: "logit_bias", Feature.SEED: "seed"}
    assert chat(top_logprobs=0).needs == {}  # zero alternatives asks for nothing
    plain = chat()
    assert plain.n == 1 and not plain.sampling.logprobs and plain.needs == {}
    comp = parse_request({"model": "m", "prompt": "x", "logprobs": 0}, "completion", **KW)
    assert comp.sampling.logprobs and comp.sampling.top_logprobs == 0  # logprobs=0: the chosen token only
    assert chat(max_completion_tokens=5, max_tokens=40).sampling.max_tokens == 5  # max_completion_tokens wins


def test_features_asked_for_name_their_field() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert chat(tools=tools).needs == {Feature.TOOLS: "tools"}
    assert chat(tools=tools, tool_choice="none").needs == {}  # the tools only inform the prompt
    assert chat(response_format={"type": "text"}).needs == {}
    assert chat(response_format={"type": "json_object"}).needs == {Feature.RESPONSE_FORMAT: "response_format"}
    image = [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": PNG_A}}]
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": image}]
    assert chat(messages=msgs).needs == {Feature.IMAGES: "messages[1].content[1]"}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"top_logprobs": 1}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": 1}, "logprobs"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"1": True}}, "logit_bias"),
        ({"logit_bias": [1]}, "logit_bias"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": "json"}, "response_format"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "maybe"}, "tool_choice"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
        ),
        ({"best_of": 2}, "best_of"),
    ],
)
def test_bad_surface_fields_name_their_param(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        chat(**fields)
    assert e.value.param == param


# -- images in the block hashes ------------------------------------------------------------------


def hashes_with(image: dict[str, Any]) -> list[int]:
    content = [
        {"type": "text", "text": "question about the picture " * 3},
        {"type": "image_url", "image_url": image},
    ]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "a long shared system prompt " * 8},
        {"role": "user", "content": content},
    ]
    layout = render_chat(messages)
    return block_hashes(Bytes4Tokenizer().encode(layout.text), 16, root=1)


def test_an_image_is_part_of_every_block_hash_from_its_block_on() -> None:
    a, b = hashes_with({"url": PNG_A}), hashes_with({"url": PNG_B})
    assert hashes_with({"url": PNG_A}) == a  # the same image: the same blocks
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
    assert shared > 0  # the blocks before the image are shared
    assert all(x != y for x, y in zip(a[shared:], b[shared:], strict=True))  # none after it
    assert hashes_with({"url": PNG_A, "detail": "high"}) != a  # detail changes what the model sees


def test_an_image_marker_cannot_be_forged_by_text() -> None:
    real = render_chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": PNG_A}}]}])
    marker = real.text[real.text.index("<|image:") :].split("\n")[0]
    forged = render_chat([{"role": "user", "content": marker}])
    assert marker not in forged.text and forged.text != real.text
    start = real.encoded().index(marker.encode())
    assert all(not (s <= start < e) for s, e in real.user_spans)  # a marker, not client text


# -- routing by features -------------------------------------------------------------------------


def node_with(address: str, role: str, features: frozenset[str]) -> FakeNodeClient:
    status = dataclasses.replace(fake_status(address, role), features=features)
    return FakeNodeClient(address, status=status)


def prep_asking(h: Any, **fields: Any) -> Any:
    s = h.pipeline.settings
    body = {"model": s.default_model, "prompt": "x" * 1600, "max_tokens": 4, **fields}
    parsed = parse_request(body, "completion", **{**KW, "models": {s.default_model}})
    return h.pipeline.prepare(parsed, RequestContext("tenant"))


async def test_a_request_goes_only_to_nodes_serving_its_features() -> None:
    sim = node_with("sim", "monolithic", frozenset())
    tiny = node_with("tiny", "monolithic", frozenset({"logprobs", "logit_bias"}))
    async with harness(("monolithic", sim), ("monolithic", tiny), disaggregation=False) as h:
        for _ in range(4):
            ex = await h.pipeline.execute(prep_asking(h, logprobs=1))
            assert ex.decode_node.id == "tiny" and ex.route == Mode.MONOLITHIC
            await ex.close()
        assert "generate" not in sim.calls


async def test_no_node_serving_a_feature_is_a_400_naming_the_field() -> None:
    sim = node_with("sim", "monolithic", frozenset())
    async with harness(("monolithic", sim), disaggregation=False) as h:
        with pytest.raises(InvalidRequest) as e:
            await h.pipeline.execute(prep_asking(h, logit_bias={"5": 1}))
        assert e.value.param == "logit_bias" and "fake" in e.value.message
        assert "generate" not in sim.calls


async def test_a_node_reporting_no_features_serves_none_unless_its_protocol_claims_them() -> None:
    quiet = node_with("quiet", "monolithic", frozenset())  # an adapter that carries no feature
    claimed = dataclasses.replace(fake_status("relay", "monolithic"), features=frozenset())
    relay = FakeNodeClient(
        "relay", status=claimed, capabilities=Capabilities(features=frozenset({"logprobs"}))
    )
    async with harness(("monolithic", quiet), ("monolithic", relay), disaggregation=False) as h:
        ex = await h.pipeline.execute(prep_asking(h, logprobs=1))
        assert ex.decode_node.id == "relay"  # its protocol passes logprobs through
        await ex.close()
        with pytest.raises(InvalidRequest) as e:
            await h.pipeline.execute(prep_asking(h, logit_bias={"1": 1}))
        assert e.value.param == "logit_bias"
        assert "generate" not in quiet.calls


# -- tiny engine sampling ------------------------------------------------------------------------


def test_choice_zero_keeps_the_seed_and_other_choices_differ() -> None:
    s = EngineSampling(seed=42)
    assert smp.base_seed(b"abcd", s) == 42
    seeds = {smp.base_seed(b"abcd", dataclasses.replace(s, choice=i)) for i in range(8)}
    assert len(seeds) == 8


def test_logit_bias_and_logprobs() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=OUTPUT_CLASSES).astype(np.float32)
    forced = int(OUTPUT_IDS[7])
    s = EngineSampling(temperature=0, logprobs=True, top_logprobs=3, logit_bias=((forced, 100.0),))
    token, lp = smp.pick(logits, s, smp.rng(1), smp.bias_vector(s))
    assert token == forced and lp is not None and lp.token == forced and lp.logprob > -1e-3
    plain = EngineSampling(temperature=0, logprobs=True, top_logprobs=3)
    token, lp = smp.pick(logits, plain, smp.rng(1), None)
    assert lp is not None and token == int(OUTPUT_IDS[int(np.argmax(logits))]) and lp.top[0][0] == token
    z = logits.astype(np.float64)
    expected = float(-np.log(np.exp(z - z.max()).sum()))  # log-softmax of the argmax
    assert abs(lp.logprob - expected) < 1e-9
    assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True) and len(lp.top) == 3
    assert CLASS_OF[forced] == 7
    unknown = EngineSampling(logit_bias=((2**32 - 1, 100.0),))  # an id the model never outputs
    assert not smp.bias_vector(unknown).any()  # type: ignore[union-attr]


# -- n choices -----------------------------------------------------------------------------------


async def test_choices_run_as_separate_requests_and_merge_with_their_index() -> None:
    seen: list[tuple[str, int]] = []

    def script(prompt: Any) -> Tokens:
        seen.append((prompt.request_id, prompt.sampling.choice))
        return Tokens(texts=(f"c{prompt.sampling.choice}", "!"), stall_s=0.001 * prompt.sampling.choice)

    node = FakeNodeClient("m", status=fake_status("m", "monolithic"), generate=script)
    async with harness(("monolithic", node), disaggregation=False) as h:
        prep = prep_asking(h)
        ch = await choices.start(h.pipeline, prep, 3)
        out: dict[int, str] = {}
        async for i, d in ch.stream():
            out[i] = out.get(i, "") + d.text
        await ch.close()
        assert out == {0: "c0!", 1: "c1!", 2: "c2!"} and ch.completion_tokens == 6
        assert sorted(seen) == [
            (prep.request_id, 0),
            (f"{prep.request_id}-1", 1),
            (f"{prep.request_id}-2", 2),
        ]
        assert h.node("m").active_streams == 0


async def test_a_choice_breaking_mid_stream_ends_the_request_and_closes_the_others() -> None:
    def script(prompt: Any) -> Tokens:
        if prompt.sampling.choice == 1:
            return Tokens(texts=("a", "b", "c"), break_after=1)
        return Tokens(texts=("x", "y", "z"), stall_s=0.05)

    node = FakeNodeClient("m", status=fake_status("m", "monolithic"), generate=script)
    async with harness(("monolithic", node), disaggregation=False) as h:
        ch = await choices.start(h.pipeline, prep_asking(h), 3)
        with pytest.raises(StreamBroken):
            async for _ in ch.stream():
                pass
        await ch.close()
        assert h.node("m").active_streams == 0
        assert all(s.closed for s in node.streams)


async def test_a_choice_that_cannot_start_fails_the_request_and_closes_the_started_ones() -> None:
    def script(prompt: Any) -> Tokens | Fail:
        return Fail(FailureKind.INVALID) if prompt.sampling.choice == 2 else Tokens()

    node = FakeNodeClient("m", status=fake_status("m", "monolithic"), generate=script)
    async with harness(("monolithic", node), disaggregation=False) as h:
        with pytest.raises(InvalidRequest):  # the engine refused the request: the client's 400
            await choices.start(h.pipeline, prep_asking(h), 3)
        assert h.node("m").active_streams == 0
        assert all(s.closed for s in node.streams)


async def test_the_default_max_tokens_is_clamped_for_the_engines_and_the_request_left_as_it_was() -> None:
    node = FakeNodeClient("m", status=fake_status("m", "monolithic"))
    # a window 10 tokens past the 400-token prompt: less room than the default max_tokens (16)
    async with harness(("monolithic", node), disaggregation=False, context_window=410) as h:
        s = h.pipeline.settings
        body = {"model": s.default_model, "prompt": "x" * 1600}
        parsed = parse_request(body, "completion", **{**KW, "models": {s.default_model}})
        prep = h.pipeline.prepare(parsed, RequestContext("tenant"))
        assert (parsed.sampling.max_tokens, prep.sampling.max_tokens) == (16, 10)
        assert prep.openai_body is not None and prep.openai_body().body["max_tokens"] == 10
        assert (
            h.pipeline.prepare(parsed, RequestContext("tenant")).sampling == prep.sampling
        )  # prepared again alike


async def test_context_overflow_names_the_field_that_set_the_limit() -> None:
    node = FakeNodeClient("m", status=fake_status("m", "monolithic"))
    async with harness(("monolithic", node), disaggregation=False, context_window=420) as h:
        for field in ("max_completion_tokens", "max_tokens"):
            with pytest.raises(InvalidRequest) as e:
                prep_asking(h, **{"max_tokens": None, field: 60})
            assert e.value.param == field and e.value.code == "context_length_exceeded"
