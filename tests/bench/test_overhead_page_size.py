"""``bench overhead --page-size``: the nodes' KV page, SGLang's default of one token included."""

from __future__ import annotations

import argparse

import pytest

from prefixgate.bench import launch
from prefixgate.bench.overhead import add_arguments


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
