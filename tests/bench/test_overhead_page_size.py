"""``bench overhead --page-size``, ``--stream-interval`` and ``--output-tokens``: the nodes' KV page
and streamed chunks, SGLang's defaults of one token included, and the chats' length."""

from __future__ import annotations

import argparse

import orjson
import pytest

from prefixgate.bench import launch
from prefixgate.bench.overhead import OUTPUT_TOKENS, add_arguments, body


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="prefixgate bench overhead")
    add_arguments(p)
    return p.parse_args(list(argv))


def test_the_page_is_the_nodes_own_by_default_and_one_token_when_asked() -> None:
    assert _parse().page_size == launch.NodeOptions().block_size == 64
    one = _parse("--page-size", "1").page_size
    command = launch.node_command("node-1", launch.NodeOptions(block_size=one))
    assert command[command.index("--block-size") + 1] == "1"


@pytest.mark.parametrize("bad", ["0", "-4", "1.5", "a"])
def test_a_page_of_no_tokens_is_refused_with_the_reason(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        _parse("--page-size", bad)
    assert e.value.code == 2
    assert f"a page is a whole number of tokens, 1 or more, not {bad!r}" in capsys.readouterr().err


def test_streamed_tokens_one_a_chunk_and_longer_answers_when_asked() -> None:
    default = _parse()
    assert (default.output_tokens, default.stream_interval) == (
        OUTPUT_TOKENS,
        launch.NodeOptions().stream_interval,
    )
    args = _parse("--output-tokens", "256", "--stream-interval", "1")
    command = launch.node_command("node-1", launch.NodeOptions(stream_interval=args.stream_interval))
    assert command[command.index("--stream-interval") + 1] == "1"  # SGLang's default: a chunk a token
    assert orjson.loads(body("hi", True, max_tokens=args.output_tokens))["max_tokens"] == 256
    with pytest.raises(SystemExit):
        _parse("--stream-interval", "0")
