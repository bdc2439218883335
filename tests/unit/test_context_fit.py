"""Which contexts hold a request (``gateway.core.context``), the planner's candidates under them,
refusals for length retried over scripted nodes, and a decode node's streams counted from
dispatch (``Node.dispatched``)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from prefixgate.gateway.cluster.nodes import Node
from prefixgate.gateway.core import context
from prefixgate.gateway.core.errors import InvalidRequest
from prefixgate.gateway.nodeclient.fake import Fail, FakeNodeClient, fake_status
from prefixgate.gateway.routing import NodeView, parse_policy
from prefixgate.gateway.routing.planner import RequestView, plan
from prefixgate.gateway.vocab import FailureKind, Mode, Role
from tests.unit.seam_support import harness


def test_a_given_max_tokens_counts_in_full_and_the_default_gives_way() -> None:
    assert context.needed(900, 256, True, [1024, 4096]) == 1156  # fits the large one
    assert context.needed(900, 256, False, [1024]) == 901  # the default is lowered to fit
    assert context.needed(900, 256, True, [1024]) is None  # the client asked for that room
    assert context.needed(1024, 256, False, [1024]) is None  # not one token of room
    assert context.needed(5000, 256, True, [1024, 0]) == 5256  # a node that does not say holds any
    assert context.needed(5000, 256, True, []) == 5256  # no node: not the context's to refuse
    assert context.room(900, 256, False, [1024, 0]) == 124
    assert context.room(900, 256, True, [1024]) == 256
    assert context.room(100, 256, False, [0]) == 256
    assert context.largest([0, 1024, 512]) == 1024 and context.largest([0]) == 0


@pytest.mark.parametrize(
    ("max_tokens_param", "prompt", "param", "words"),
    [
        ("", 2000, "messages", "the prompt (2000 tokens) exceeds"),
        ("max_tokens", 900, "max_tokens", "plus max_tokens (256) exceeds"),
        ("max_tokens", 2000, "messages", "the prompt (2000 tokens) exceeds"),
    ],
)
def test_the_400_names_the_field_at_fault_and_the_largest_context(
    max_tokens_param: str, prompt: int, param: str, words: str
) -> None:
    e = context.exceeded(prompt, 256, 1024, prompt_param="messages", max_tokens_param=max_tokens_param)
    assert e.code == "context_length_exceeded" and e.param == param
    assert words in e.message and e.message.endswith("the largest context available, 1024 tokens")


def _view(node_id: str, role: Role, ctx: int, streams: int = 0) -> NodeView:
    return NodeView(node_id, role=role, max_context_tokens=ctx, streams=streams, attention_coeff_s=0.0)


def test_the_plan_offers_only_nodes_whose_context_holds_the_request() -> None:
    nodes = [
        _view("p-small", Role.PREFILL, 1000),
        _view("p-large", Role.PREFILL, 8000),
        _view("d-small", Role.DECODE, 1000),
        _view("d-large", Role.DECODE, 8000, streams=5),  # busier, but the only one that fits
    ]
    req = RequestView(4000, 64, {"p-small": 15}, context_tokens=4256)  # p-small holds its prefix
    p = plan(req, nodes, parse_policy("prefixgate"))
    assert p.mode.mode == Mode.DISAGGREGATED
    assert p.prefill is not None and p.prefill.node_id == "p-large" and p.decode_node == "d-large"
    short = plan(replace(req, prompt_tokens=500, context_tokens=756), nodes, parse_policy("prefixgate"))
    assert short.decode_node == "d-small"  # least busy again
    # a prefill node need hold only the prompt and a first token
    edge = plan(
        replace(req, prompt_tokens=999, context_tokens=1255),
        nodes[:2] + nodes[3:],
        parse_policy("prefixgate"),
    )
    assert edge.prefill is not None and {e.node_id for e in edge.prefill.estimates} == {"p-small", "p-large"}
    none = plan(replace(req, context_tokens=9000), nodes, parse_policy("prefixgate"))
    assert none.mode.mode == Mode.FALLBACK and none.monolithic is None and none.decode_node is None


def test_a_decode_node_counts_an_attempt_from_its_dispatch_once() -> None:
    node = Node("decode", "d0", FakeNodeClient("d0"), status=fake_status("d0", "decode"))
    with node.dispatched():
        assert node.view().streams == 1
        node.status = replace(fake_status("d0", "decode"), running_requests=1)  # the node has it too
        assert node.view().streams == 1
    with node.streaming():  # from its first token, the execution's count
        assert node.view().streams == 1
    assert node.view().streams == 1  # the node still says 1 until its next report
    node.status = fake_status("d0", "decode")
    with pytest.raises(RuntimeError), node.dispatched():
        raise RuntimeError("the attempt failed")
    assert (node.pending_streams, node.active_streams, node.view().streams) == (0, 0, 0)


TOO_LONG = "INVALID_ARGUMENT: prompt has 400 tokens, the context holds 256"


async def test_a_decode_nodes_refusal_for_length_is_retried_on_another_and_not_blamed() -> None:
    refuses = Fail(FailureKind.INVALID, detail=TOO_LONG)
    d1 = FakeNodeClient("d1", decode=refuses)  # says no context: offered what it then refuses
    d2 = FakeNodeClient("d2", status=replace(fake_status("d2", "decode"), max_context_tokens=8192))
    async with harness(("prefill", FakeNodeClient("p1")), ("decode", d1), ("decode", d2)) as h:
        ex = await h.pipeline.execute(h.prep())
        assert ex.route == Mode.DISAGGREGATED and ex.decode_node is h.node("d2") and ex.attempts == 2
        assert [d.text async for d in ex.stream()] == ["Hello", " world"]
        d1_node = h.node("d1")
        assert d1_node.breaker.failures == 0 and "the context holds 256" in d1_node.last_error
        assert all(
            (n.pending_streams, n.active_streams, n.local_requests) == (0, 0, 0)
            for n in h.pool.nodes.values()
        )


async def test_refusals_for_length_everywhere_are_the_400_naming_the_largest_context() -> None:
    refuses = Fail(FailureKind.INVALID, detail=TOO_LONG)
    d1 = FakeNodeClient("d1", decode=refuses)
    d2 = FakeNodeClient(
        "d2", decode=refuses, status=replace(fake_status("d2", "decode"), max_context_tokens=8192)
    )
    async with harness(("prefill", FakeNodeClient("p1")), ("decode", d1), ("decode", d2)) as h:
        with pytest.raises(InvalidRequest) as info:
            await h.pipeline.execute(h.prep())
        e = info.value
        assert e.code == "context_length_exceeded" and e.param == "prompt"
        assert "largest context available, 8192 tokens" in e.message and "context holds 256" in e.message
        assert d1.calls.count("decode") == d2.calls.count("decode") == 1
