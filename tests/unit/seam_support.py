"""A pipeline over scripted fake nodes: the whole execution path, no process, no socket."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from prefixgate.cachetier.memory import MemoryIndex
from prefixgate.cachetier.tokenizer import Bytes4Tokenizer
from prefixgate.gateway.cluster.nodes import Node, NodePool
from prefixgate.gateway.config import Settings
from prefixgate.gateway.core.pipeline import Pipeline, Prepared
from prefixgate.gateway.core.request import RequestContext
from prefixgate.gateway.metrics import Metrics
from prefixgate.gateway.nodeclient.fake import FakeNodeClient, fake_status
from prefixgate.gateway.state.documents import DocumentStore
from prefixgate.openai.schema import ParsedRequest, parse_request


class Harness:
    def __init__(self, pipeline: Pipeline, clients: dict[str, FakeNodeClient]) -> None:
        self.pipeline = pipeline
        self.pool = pipeline.pool
        self.clients = clients

    def node(self, address: str) -> Node:
        node = self.pool.by_id(address)
        assert node is not None
        return node

    def prep(self, prompt_tokens: int = 400, max_tokens: int = 8) -> Prepared:
        return prepared(self.pipeline, "x" * (4 * prompt_tokens), max_tokens)


def completion(pipeline: Pipeline, prompt: str, max_tokens: int = 8) -> ParsedRequest:
    """A completion request for ``prompt``, parsed as ``pipeline``'s gateway would."""
    s = pipeline.settings
    body = {"model": s.default_model, "prompt": prompt, "max_tokens": max_tokens}
    return parse_request(
        body,
        "completion",
        models={s.default_model},
        default_max_tokens=16,
        max_tokens_limit=64,
        max_documents=4,
    )


def prepared(pipeline: Pipeline, prompt: str, max_tokens: int = 8) -> Prepared:
    """A completion request for ``prompt``, prepared by ``pipeline`` (parsed, tokenized, hashed)."""
    return pipeline.prepare(completion(pipeline, prompt, max_tokens), RequestContext("tenant"))


@asynccontextmanager
async def harness(*nodes: tuple[str, FakeNodeClient], **settings: Any) -> AsyncIterator[Harness]:
    """A pipeline whose pool holds these (role, fake) nodes, each polled once."""
    clients = {c.address: c for _, c in nodes}
    pool = NodePool(connect=clients.__getitem__, probe_timeout_s=0.2, poll=False)
    for role, c in nodes:
        if c.status_script == fake_status(c.address, "decode") and role != "decode":
            c.status_script = fake_status(c.address, role)
        pool.add(role, c.address)
    for n in pool.nodes.values():
        await pool.refresh(n)
    pipeline = Pipeline(
        Settings(**settings), pool, MemoryIndex(), Bytes4Tokenizer(), Metrics(), DocumentStore()
    )
    try:
        yield Harness(pipeline, clients)
    finally:
        await pipeline.close()
        await pool.close()
