"""The gateway with the engine tokenizer: block hashes over the model's real token ids."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from prefixgate.backends.hftok import TOKENIZER_DIR
from prefixgate.backends.server import NodeServer, start_node
from prefixgate.cachetier.hashing import block_hashes
from prefixgate.cachetier.tokenizer import unpack_ids
from prefixgate.gateway.config import Settings, load_settings
from prefixgate.gateway.core.request import RequestContext
from prefixgate.gateway.core.service import GatewayService
from prefixgate.gateway.httpfront.app import create_app
from prefixgate.gateway.tokens import EngineTokenizer
from prefixgate.openai.schema import ParsedRequest, parse_request

HF = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
BS = 16
SYSTEM = ("You answer questions about prefix caches in one short sentence. " * 8).strip()  # canonical


def chat(svc: GatewayService, messages: list[dict[str, Any]], **extra: Any) -> ParsedRequest:
    s = svc.settings
    body = {"model": s.default_model, "messages": messages, **extra}
    return parse_request(
        body,
        "chat",
        models=svc.models,
        default_max_tokens=s.default_max_tokens,
        max_tokens_limit=s.max_tokens_limit,
        max_documents=s.max_documents,
    )


def test_the_default_tokenizer_is_unchanged() -> None:
    assert GatewayService(Settings()).tokenizer.name == "bytes4"


def test_the_tokenizer_path_setting_from_flags_toml_and_environment(tmp_path: Path) -> None:
    d = str(TOKENIZER_DIR)
    assert load_settings(overrides={"tokenizer_path": d}, environ={}).tokenizer_path == d
    assert load_settings(environ={"PREFIXGATE_TOKENIZER_PATH": d}).tokenizer_path == d
    with pytest.raises(ValueError, match="tokenizer_path"):
        load_settings(overrides={"tokenizer_path": str(tmp_path / "missing")}, environ={})
    with pytest.raises(ValueError, match="tokenizer"):
        load_settings(overrides={"tokenizer": "sentencepiece"}, environ={})
    toml = tmp_path / "g.toml"
    toml.write_text(f'[gateway]\ntokenizer = "engine:{TOKENIZER_DIR}"\n')
    svc = GatewayService(load_settings(toml, environ={}))
    assert isinstance(svc.tokenizer, EngineTokenizer) and svc.tokenizer.name.startswith("engine:")


def test_prepare_hashes_the_ids_the_engine_template_gives() -> None:
    svc = GatewayService(Settings(tokenizer_path=str(TOKENIZER_DIR), block_size=BS))
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a page?"}]
    prep = svc.pipeline.prepare(chat(svc, messages), RequestContext(""))
    rendered = HF.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = HF.encode(rendered, add_special_tokens=False)
    assert unpack_ids(prep.tokens) == expected and prep.prompt_tokens == len(expected)
    assert prep.hashes == block_hashes(prep.tokens, BS, prep.namespace.root())
    assert len(prep.hashes) == len(expected) // BS
    assert prep.namespace.root() != svc.pipeline.namespace(svc.settings.default_model, "other-tenant").root()
    from prefixgate.gateway.core.cache_ops import prompt_basis

    assert prompt_basis(svc, prep).rendering == "model template"
    bare = GatewayService(Settings(block_size=BS))
    assert (
        prompt_basis(bare, bare.pipeline.prepare(chat(bare, messages), RequestContext(""))).rendering
        == "gateway"
    )


def test_a_template_refusal_is_a_400() -> None:
    from prefixgate.gateway.core.errors import InvalidRequest

    svc = GatewayService(Settings(tokenizer_path=str(TOKENIZER_DIR)))
    with pytest.raises(InvalidRequest):
        svc.pipeline.prepare(
            chat(svc, [{"role": "user", "content": "x"}], documents=[{"id": "a b", "text": "t"}]),
            RequestContext(""),
        )


@pytest.fixture
async def node() -> AsyncIterator[NodeServer]:
    ns = await start_node("monolithic", "127.0.0.1", 0, time_scale=0.0, block_size=BS)
    try:
        yield ns
    finally:
        await ns.stop(grace=0.2)


async def _serve(settings: Settings) -> tuple[GatewayService, httpx.AsyncClient]:
    svc = GatewayService(settings)
    await svc.start()
    transport = httpx.ASGITransport(app=create_app(svc))
    return svc, httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=30)


SOURCES: dict[str, tuple[dict[str, Any], str]] = {
    "tokenizer_path": ({"tokenizer_path": str(TOKENIZER_DIR)}, str(TOKENIZER_DIR)),
    "worker's tokenizer_path": ({"tokenizer": "engine"}, "tokenizer_path"),
    "GetTokenizer": ({"tokenizer": "engine", "tokenizer_worker_paths": False}, "bundle"),
}


@pytest.mark.parametrize("source", list(SOURCES))
async def test_a_repeated_prefix_is_found_cached_on_the_node(
    node: NodeServer, source: str, tmp_path: Path
) -> None:
    options, origin = SOURCES[source]
    settings = Settings(
        monolithic=[f"grpc://{node.address}"],
        block_size=BS,
        stats_interval_s=0.2,
        tokenizer_cache_dir=str(tmp_path),
        **options,
    )
    svc, client = await _serve(settings)
    try:
        assert isinstance(svc.tokenizer, EngineTokenizer) and svc.pipeline.tokenizer is svc.tokenizer
        assert origin in svc.tokenizer.origin
        cached: list[int] = []
        for question in ("What is a page?", "What is a block?"):
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
            r = await client.post(
                "/v1/chat/completions",
                json={
                    "model": settings.default_model,
                    "messages": messages,
                    "max_tokens": 4,
                    "temperature": 0,
                },
            )
            assert r.status_code == 200, r.text
            cached.append(int(r.headers["x-prefixgate-cached-tokens"]))
            prompt = HF.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            assert r.json()["usage"]["prompt_tokens"] == len(HF.encode(prompt, add_special_tokens=False))
        shared = len(HF.encode(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n", add_special_tokens=False))
        assert cached[0] == 0 and cached[1] == shared // BS * BS
        # What the segment cache holds is exported: what the gateway's memory grew by, no leak.
        held = svc.tokenizer.segment_stats.bytes
        assert held > 0
        scraped = (await client.get("/metrics")).text
        series = f'prefixgate_tokenizer_cache_bytes{{tokenizer="{svc.tokenizer.name}"}}'
        assert f"{series} {float(held)}" in scraped
    finally:
        await client.aclose()
        await svc.stop()
