"""Whether the gateway serves a chat's tools itself: a template that reads ``tools`` and a parser
(set or read from the template); otherwise the ``tools`` need stays and nodes refuse as before."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from prefixgate.backends.hftok import TOKENIZER_DIR
from prefixgate.cachetier.tokenizer import load_tokenizer
from prefixgate.gateway.cluster.nodes import Node
from prefixgate.gateway.config import load_settings
from prefixgate.gateway.nodeclient import connect
from prefixgate.gateway.tokens import open_tokenizer_dir
from prefixgate.gateway.toolcalls.support import gateway_parser, passing_through, plan_tools
from prefixgate.openai.exceptions import InvalidRequest
from prefixgate.openai.features import Feature

HERE = Path(__file__).resolve().parent
TOOLS = [{"type": "function", "function": {"name": "f"}}]
NEEDS = {Feature.TOOLS: "tools", Feature.LOGPROBS: "logprobs"}


@pytest.fixture(scope="module")
def tool_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    shutil.copy(TOKENIZER_DIR / "tokenizer.json", d / "tokenizer.json")
    config = json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text())
    config["chat_template"] = (HERE / "qwen25_template.jinja").read_text()
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


def test_the_parser_comes_from_the_setting_or_the_template(tool_dir: Path) -> None:
    tok = open_tokenizer_dir(str(tool_dir))
    assert gateway_parser(tok, "") == "hermes"  # detected: <tool_call> in the template
    assert gateway_parser(tok, "qwen25") == "qwen25"
    assert gateway_parser(tok, "none") is None
    shipped = open_tokenizer_dir(str(TOKENIZER_DIR))  # its template never reads tools
    assert gateway_parser(shipped, "") is None and gateway_parser(shipped, "hermes") is None
    assert gateway_parser(load_tokenizer("bytes4"), "hermes") is None  # the gateway renders no template


def test_plan(tool_dir: Path) -> None:
    tok = open_tokenizer_dir(str(tool_dir))
    auto = plan_tools(TOOLS, None, dict(NEEDS), tok, "")
    assert (auto.parser, auto.tools, auto.needs) == ("hermes", TOOLS, {Feature.LOGPROBS: "logprobs"})
    none = plan_tools(TOOLS, "none", {Feature.LOGPROBS: "logprobs"}, tok, "")
    assert (none.parser, none.tools) == ("", None)  # no tools in the template, nothing parsed
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        # forced: a structural tag of hermes calls, which needs an engine that constrains
        forced = plan_tools(TOOLS, choice, dict(NEEDS), tok, "")
        assert forced.needs == {Feature.LOGPROBS: "logprobs", Feature.RESPONSE_FORMAT: "tool_choice"}
        assert forced.constraint is not None and forced.constraint.kind == "structural_tag"
        fmt = json.loads(forced.constraint.text)["format"]
        assert fmt["type"] == "tags_with_separator" and fmt["at_least_one"]
        assert fmt["tags"][0]["begin"].startswith('<tool_call>\n{"name": "')
        with pytest.raises(InvalidRequest) as e:  # a format no grammar can force
            plan_tools(TOOLS, choice, dict(NEEDS), tok, "pythonic")
        assert e.value.param == "tool_choice"
        with pytest.raises(InvalidRequest) as e:  # two constraints on one answer
            plan_tools(TOOLS, choice, {Feature.RESPONSE_FORMAT: "response_format"}, tok, "")
        assert e.value.param == "tool_choice"
    kept = plan_tools(TOOLS, "auto", dict(NEEDS), open_tokenizer_dir(str(TOKENIZER_DIR)), "")
    assert (kept.parser, kept.tools, kept.needs) == ("", TOOLS, NEEDS)  # the nodes decide, as before


def test_the_setting_is_checked() -> None:
    assert load_settings(overrides={"tool_call_parser": "llama3"}, environ={}).tool_call_parser == "llama3"
    assert load_settings(environ={"PREFIXGATE_TOOL_CALL_PARSER": "none"}).tool_call_parser == "none"
    with pytest.raises(ValueError, match="tool_call_parser"):
        load_settings(overrides={"tool_call_parser": "json"}, environ={})


async def test_pass_through_workers_are_left_out() -> None:
    """A node that takes the OpenAI request whole would answer with its own tool calls, which the
    gateway cannot carry: left out of the plan, a 400 when nothing else is there."""
    smg = Node("monolithic", "grpc://127.0.0.1:1", connect("grpc://127.0.0.1:1"))
    http = Node("monolithic", "http://127.0.0.1:2", connect("http://127.0.0.1:2"))
    try:
        assert passing_through([smg, http]) == {http.id}
        assert passing_through([smg]) == set()
        with pytest.raises(InvalidRequest) as e:
            passing_through([http])
        assert e.value.param == "tools"
    finally:
        await smg.client.close()
        await http.client.close()
