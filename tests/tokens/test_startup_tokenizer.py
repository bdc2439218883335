"""The engine's tokenizer is the default in front of ``grpc://`` workers: ``prefixgate gateway
--worker-urls grpc://…`` with no other flag takes the worker's own, waits for workers not up yet,
and exits at once, in one line saying what to pass, when the worker offers none."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc
from transformers import AutoTokenizer

from prefixgate.backends.hftok import TOKENIZER_DIR
from prefixgate.backends.server import start_node
from prefixgate.cachetier.tokenizer import unpack_ids
from prefixgate.gateway.config import load_settings
from prefixgate.gateway.core.request import RequestContext
from prefixgate.gateway.core.service import GatewayService
from prefixgate.gateway.tokens import TokenizerLoadError, open_tokenizer_dir
from prefixgate.gateway.tokens.wiring import resolve_tokenizer
from prefixgate.openai.schema import parse_request
from tests.helpers import REPO, free_port

SHIPPED = open_tokenizer_dir(TOKENIZER_DIR).name


class Elsewhere(pb_grpc.SglangSchedulerServicer):  # type: ignore[misc]
    """An SGLang worker of another model whose tokenizer directory is ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    async def GetModelInfo(self, request: Any, context: Any) -> Any:
        return pb.GetModelInfoResponse(
            model_path=str(self.path), tokenizer_path=str(self.path), served_model_name="other-model"
        )


async def _serve(servicer: Any) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    pb_grpc.add_SglangSchedulerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"grpc://127.0.0.1:{port}"


class NoTokenizer(pb_grpc.SglangSchedulerServicer):  # type: ignore[misc]
    """An SGLang worker whose tokenizer is nowhere to be had: its ``tokenizer_path`` is not on
    this host and it does not serve ``GetTokenizer`` (the base servicer answers UNIMPLEMENTED)."""

    async def GetModelInfo(self, request: Any, context: Any) -> Any:
        return pb.GetModelInfoResponse(
            model_path="/models/elsewhere", tokenizer_path="/models/elsewhere", served_model_name="far"
        )


@pytest.fixture
async def tokenless() -> AsyncIterator[str]:
    server = grpc.aio.server()
    pb_grpc.add_SglangSchedulerServicer_to_server(NoTokenizer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"grpc://127.0.0.1:{port}"
    finally:
        await server.stop(0)


async def _gateway(*args: str, timeout: float = 30.0) -> tuple[int, str, float]:
    t0 = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "prefixgate.cli",
        "gateway",
        "--port",
        str(free_port()),
        *args,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        _, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    return int(proc.returncode or 0), err.decode(), time.monotonic() - t0


async def test_a_worker_that_offers_no_tokenizer_stops_the_gateway_at_once_in_one_line(
    tokenless: str,
) -> None:
    rc, err, took = await _gateway("--worker-urls", tokenless)
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("{")]
    assert rc == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith("prefixgate gateway: no worker gave a tokenizer")
    assert tokenless in lines[0] and "UNIMPLEMENTED" in lines[0] and "--tokenizer-path DIR" in lines[0]
    assert took < 20  # at once: the worker answered, nothing is waited for


async def test_the_stand_in_tokenizer_is_refused_in_front_of_grpc_workers(tokenless: str) -> None:
    rc, err, _ = await _gateway("--worker-urls", tokenless, "--tokenizer", "bytes4")
    assert rc == 2
    assert err.strip().count("\n") == 0 and "bytes4 cannot feed" in err and tokenless in err


async def test_the_default_takes_the_workers_own_and_waits_for_a_worker_not_up_yet(tmp_path: Path) -> None:
    port = free_port()
    settings = load_settings(
        overrides={"worker_urls": [f"grpc://127.0.0.1:{port}"], "tokenizer_cache_dir": str(tmp_path)},
        environ={},
    )
    assert settings.tokenizer == "" and settings.tokenizer_path == ""

    async def late_node() -> Any:
        await asyncio.sleep(1.5)
        return await start_node("monolithic", "127.0.0.1", port, time_scale=0.0)

    starting = asyncio.ensure_future(late_node())
    try:
        resolved = await resolve_tokenizer(settings)
    finally:
        node = await starting
        await node.stop(grace=0.2)
    # the node's own tokenizer_path exists on this host (smg's first choice, as here)
    assert resolved.tokenizer == "engine" and Path(resolved.tokenizer_path) == TOKENIZER_DIR
    assert open_tokenizer_dir(resolved.tokenizer_path).name == SHIPPED


async def test_an_explicit_path_or_hf_file_is_used_as_given_and_no_worker_is_asked() -> None:
    for override in (
        {"tokenizer_path": str(TOKENIZER_DIR)},
        {"tokenizer": f"hf:{TOKENIZER_DIR}/tokenizer.json"},
    ):
        settings = load_settings(overrides={"worker_urls": ["grpc://127.0.0.1:1"], **override}, environ={})
        # hf:FILE means --tokenizer-path of its directory: the model's own chat template with it
        assert settings.tokenizer_path == str(TOKENIZER_DIR)
        assert await resolve_tokenizer(settings) == settings


def _other_template(directory: Path) -> Path:
    """The shipped tokenizer with a chat template of its own (another model's): the same ids."""
    shutil.copytree(TOKENIZER_DIR, directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = "<|im_start|>system\nOther model.<|im_end|>\n" + config["chat_template"]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


async def test_each_model_gets_its_own_workers_tokenizer(tmp_path: Path) -> None:
    node = await start_node("monolithic", "127.0.0.1", 0, time_scale=0.0)
    same = tmp_path / "same"
    shutil.copytree(TOKENIZER_DIR, same)  # another copy of the very same tokenizer
    other = _other_template(tmp_path / "other")
    servers = [await _serve(Elsewhere(same)), await _serve(Elsewhere(other))]
    try:
        ours = f"grpc://{node.address}"
        one = load_settings(overrides={"worker_urls": [ours, servers[0][1]]}, environ={})
        resolved = await resolve_tokenizer(one)
        assert Path(resolved.tokenizer_path) == TOKENIZER_DIR and resolved.model_tokenizers == []
        two = load_settings(overrides={"worker_urls": [ours, servers[1][1]]}, environ={})
        resolved = await resolve_tokenizer(two)
        assert Path(resolved.tokenizer_path) == TOKENIZER_DIR
        assert resolved.model_tokenizers == [f"other-model={other}"]
        # the pipeline renders each model's chats with its own workers' template
        svc = GatewayService(resolved)
        chat = [{"role": "user", "content": "Which model am I talking to?"}]
        models = {"prefixgate-sim", "other-model"}
        ids = {}
        for model in sorted(models):
            body = {"model": model, "messages": chat, "max_tokens": 4}
            parsed = parse_request(
                body, "chat", models=models, default_max_tokens=4, max_tokens_limit=8, max_documents=1
            )
            prep = svc.pipeline.prepare(parsed, RequestContext(""))
            want = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR if model == "prefixgate-sim" else other))
            text = want.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            assert unpack_ids(prep.tokens) == want(text, add_special_tokens=False)["input_ids"], model
            ids[model] = prep.namespace.root()
        assert ids["prefixgate-sim"] != ids["other-model"]
        # one model whose workers disagree cannot be served right: refused in one line
        servers.append(await _serve(Elsewhere(same)))
        mixed = load_settings(overrides={"worker_urls": [servers[1][1], servers[2][1]]}, environ={})
        with pytest.raises(TokenizerLoadError, match="workers of model 'other-model' use different") as e:
            await resolve_tokenizer(mixed)
        assert "--tokenizer-path DIR" in str(e.value)
        # an explicit tokenizer is the operator's word: nothing is compared
        given = load_settings(
            overrides={"worker_urls": [ours, servers[1][1]], "tokenizer_path": str(TOKENIZER_DIR)}, environ={}
        )
        assert await resolve_tokenizer(given) == given
    finally:
        for server, _ in servers:
            await server.stop(0)
        await node.stop(grace=0.2)


async def test_no_worker_up_within_the_wait_is_an_error_naming_the_flag() -> None:
    settings = load_settings(
        # one second instead of the default minute: the wait itself is what is tested
        overrides={"worker_urls": ["grpc://127.0.0.1:1"], "tokenizer_timeout_s": 1.0},
        environ={},
    )
    with pytest.raises(TokenizerLoadError, match=r"no answer \(UNAVAILABLE\).*--tokenizer-path DIR"):
        await resolve_tokenizer(settings)


def test_http_workers_and_our_own_nodes_keep_the_stand_in() -> None:
    for workers in (["http://127.0.0.1:1"], []):
        s = load_settings(overrides={"worker_urls": workers, "monolithic": ["127.0.0.1:1"]}, environ={})
        assert s.tokenizer == "" and s.tokenizer_path == ""
        from prefixgate.gateway.tokens.wiring import engine_path, gateway_tokenizer

        assert engine_path(s) is None and gateway_tokenizer(s).name == "bytes4"
