"""Our own nodes on 127.0.0.1, reached over ``grpc://`` (the SMG engine protocol) by the gateway's
SMG adapter, as an SGLang worker would be."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from tokenizers import Tokenizer

from prefixgate.backends.hftok import TOKENIZER_DIR
from prefixgate.backends.server import NodeServer, start_node
from prefixgate.cachetier.hashing import Namespace
from prefixgate.gateway.nodeclient import connect
from prefixgate.gateway.nodeclient.smg_common import SmgNodeClient, SmgOptions

BS = 16
MODEL = "prefixgate-sim"
TOK_NAME = "hf:test"
HF = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))

StartNode = Callable[..., Awaitable[NodeServer]]
Client = Callable[..., SmgNodeClient]


def root_of(model: str, lora: str, salt: str) -> int | None:
    return None if lora else Namespace(model or MODEL, salt, BS, TOK_NAME).root()


def chat_ids(text: str) -> list[int]:
    rendered = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    return list(HF.encode(rendered, add_special_tokens=False).ids)


@pytest.fixture
async def nodes() -> AsyncIterator[StartNode]:
    """``await nodes(role, **start_node options)``: sim engine, 16-token blocks, no waiting."""
    started: list[NodeServer] = []

    async def make(role: str = "monolithic", **options: Any) -> NodeServer:
        options.setdefault("time_scale", 0.0)
        options.setdefault("block_size", BS)
        if role == "prefill":
            options.setdefault("bootstrap_port", 0)
        ns = await start_node(role, "127.0.0.1", 0, **options)
        started.append(ns)
        return ns

    yield make
    for ns in started:
        await ns.stop(grace=0.2)


@pytest.fixture
async def client() -> AsyncIterator[Client]:
    """``client(node_server, **SmgOptions fields)``: a ``grpc://`` client, closed after the test."""
    made: list[SmgNodeClient] = []

    def make(ns: NodeServer, **options: Any) -> SmgNodeClient:
        options.setdefault("block_size", BS)
        options.setdefault("root_of", root_of)
        options.setdefault("codec", HF)
        c = connect(f"grpc://{ns.address}", smg=SmgOptions(**options))
        assert isinstance(c, SmgNodeClient)
        made.append(c)
        return c

    yield make
    for c in made:
        await c.close()
