"""The gateway owns prompt tokens: the engine's tokenizer and chat template, loaded once.

Engines of the SMG gRPC protocol take token ids only. The gateway renders the chat with the
model's own template, tokenizes it with the model's own tokenizer and hashes those very ids, so
the blocks it routes on are the blocks the engine caches, and it sends the engine exactly the
ids it hashed.

API (everything else in this package is internal):

``await load_engine_tokenizer(path=None, workers=(), *, cache_dir=None, backend=None,
timeout_s=60, segment_cache_bytes=64 MiB, local_paths=True) -> EngineTokenizer``
    From the local directory ``path``; else from the first of ``workers`` (``grpc://HOST:PORT``
    or ``HOST:PORT`` addresses of SMG engines) that gives one: the ``tokenizer_path`` of its
    ``GetModelInfo`` when it exists here, the bundle kept on disk for it, or its ``GetTokenizer``
    stream (sha256-verified, safely unpacked, kept under ``cache_dir``, by default
    ``$XDG_CACHE_HOME/prefixgate/tokenizers``). Raises ``TokenizerLoadError``.
``open_tokenizer_dir(path) -> EngineTokenizer``
    The synchronous local-directory case.

``EngineTokenizer`` (a ``cachetier.tokenizer.Tokenizer``: ids travel as packed LE uint32):
    ``name`` (``engine:<sha256 of tokenizer.json, 16 hex>``, part of the block-hash namespace),
    ``encode(text) -> bytes`` / ``encode_ids(text) -> list[int]`` (equal to the tokenizer's
    ``encode(text, add_special_tokens=False)``, with repeated template segments from a cache),
    ``decode(bytes)`` / ``decode_ids(ids, skip_special_tokens=True)``, ``hf`` (the
    ``tokenizers.Tokenizer``, e.g. for an incremental decoder), ``eos_token_ids``,
    ``bos_token_id``, ``pad_token_id``, ``special_ids``, ``special_tokens`` (``bos_token`` ... as
    text), ``vocab_size``, ``token_to_id``, ``template`` (``ChatTemplate`` or None),
    ``apply_chat_template(messages, tools=None, add_generation_prompt=True)`` (as given),
    ``render_chat`` / ``encode_chat(messages, documents=, tools=, normalize=) -> (Layout, bytes)``
    (prefixgate's canonical chat through the template, then ids), ``segment_stats``.

``ChatEncoder`` is the protocol the pipeline checks for (``chat_encoder``): a tokenizer that renders
chats itself.

In a running gateway the instance is ``GatewayService.tokenizer`` (the same object as
``Pipeline.tokenizer``) when the ``tokenizer`` setting is ``engine``/``engine:DIR`` or
``tokenizer_path`` is set (``wiring``); with ``engine`` and no path it is loaded from the workers in
``GatewayService.start``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, cast

from prefixgate.gateway.tokens.bundle import BundleCache, BundleError, default_cache_dir
from prefixgate.gateway.tokens.engine import DEFAULT_SEGMENT_CACHE_BYTES, EngineTokenizer, TokenizerLoadError
from prefixgate.gateway.tokens.loader import fetch_bundle, load_engine_tokenizer, open_tokenizer_dir
from prefixgate.gateway.tokens.template import ChatTemplate, ChatTemplateError, TemplateLimitError
from prefixgate.openai.normalize import Document, Layout


class ChatEncoder(Protocol):
    name: str

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        documents: Sequence[Document] = (),
        tools: Sequence[Any] | None = None,
        normalize: bool = True,
    ) -> tuple[Layout, bytes]: ...


def chat_encoder(tokenizer: object) -> ChatEncoder | None:
    """``tokenizer`` as a ``ChatEncoder`` when it renders chats itself, else None. An attribute
    check: ``isinstance`` against a runtime Protocol walks its members every call, some 3 % of a
    small request's CPU."""
    return cast(ChatEncoder, tokenizer) if callable(getattr(tokenizer, "encode_chat", None)) else None


__all__ = [
    "DEFAULT_SEGMENT_CACHE_BYTES",
    "BundleCache",
    "BundleError",
    "ChatEncoder",
    "ChatTemplate",
    "ChatTemplateError",
    "EngineTokenizer",
    "TemplateLimitError",
    "TokenizerLoadError",
    "chat_encoder",
    "default_cache_dir",
    "fetch_bundle",
    "load_engine_tokenizer",
    "open_tokenizer_dir",
]
