"""When a node is given another prefill (``gateway.scheduling.room``)."""

from __future__ import annotations

from prefixgate.gateway.routing.base import NodeView
from prefixgate.gateway.scheduling.room import RoomRule, has_room

RULE = RoomRule(window_s=0.05, max_requests=4)


def view(requests: int, tokens: int, rate: float = 100_000.0, routable: bool = True) -> NodeView:
    return NodeView(
        "p",
        outstanding_requests=requests,
        outstanding_tokens=tokens,
        prefill_tokens_per_s=rate,
        routable=routable,
    )


def test_an_idle_node_always_takes_one_even_a_long_one() -> None:
    assert has_room(view(0, 0), RULE)
    assert has_room(view(1, 10**9), RULE)  # and a second: it computes while the first's KV travels
    assert not has_room(view(1, 10**9), RoomRule(window_s=0.05, max_requests=4, min_requests=1))


def test_a_node_holding_less_than_the_window_takes_more() -> None:
    assert has_room(view(2, 4000), RULE)  # 40 ms
    assert has_room(view(1, 6000), RULE)  # 60 ms, but one computing and one behind it always
    assert not has_room(view(2, 6000), RULE)


def test_at_most_max_requests() -> None:
    assert not has_room(view(4, 10), RULE)


def test_unknown_speed_is_held_to_the_count() -> None:
    assert has_room(view(3, 10**9, rate=0.0), RULE)
    assert not has_room(view(4, 0, rate=0.0), RULE)


def test_an_unroutable_node_takes_nothing_and_max_requests_0_turns_the_queue_off() -> None:
    assert not has_room(view(0, 0, routable=False), RULE)
    assert has_room(view(100, 10**9), RoomRule(max_requests=0))
