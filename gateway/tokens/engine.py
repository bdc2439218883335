"""The engine's tokenizer, owned by the gateway: chat template, token ids, special ids.

Loaded from a tokenizer directory (``tokenizer.json`` is required; ``tokenizer_config.json``,
``generation_config.json``, ``config.json`` and template files are read when present). It is a
``cachetier.tokenizer.Tokenizer`` (packed LE uint32 ids), so the pipeline hashes its ids like any
other tokenizer's, and it renders chats itself (``encode_chat``): canonical messages, the model's
own template, then ids through the segment cache. Its ``name`` is derived from the content of
``tokenizer.json``, so gateways with the same tokenizer share block hashes whatever path it came
from.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from prefixgate.cachetier import fastbpe
from prefixgate.cachetier.tokenizer import unpack_ids
from prefixgate.gateway.tokens.chat import canonical_messages, escape_value
from prefixgate.gateway.tokens.segments import CacheStats, SegmentEncoder, added_tokens
from prefixgate.gateway.tokens.template import (
    SPECIAL_TOKEN_KEYS,
    ChatTemplate,
    ChatTemplateError,
    read_template_source,
    token_text,
)
from prefixgate.openai.normalize import Document, Layout, Segment

DEFAULT_SEGMENT_CACHE_BYTES = 64 << 20


class TokenizerLoadError(RuntimeError):
    """A tokenizer directory or bundle that cannot be used."""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TokenizerLoadError(f"{path}: {e}") from None
    return value if isinstance(value, dict) else {}


def _ids(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8"))


# ``fastbpe.build`` 's verdict for each tokenizer.json (by sha256) this process has loaded: a
# gateway loads its tokenizer up to three times as it starts (the workers' one, each worker's,
# its own), and the checks are the costly part of a load (1 s for a 60K-token vocabulary).
_FAST_VERDICTS: dict[str, tuple[fastbpe.FastBPE | None, str]] = {}
_FAST_VERDICTS_KEPT = 16


def _fast_encoder(sha256: str, parsed: dict[str, Any], hf: Any) -> tuple[fastbpe.FastBPE | None, str]:
    verdict = _FAST_VERDICTS.get(sha256)
    if verdict is None:
        verdict = fastbpe.build(parsed, hf)
        if len(_FAST_VERDICTS) >= _FAST_VERDICTS_KEPT:
            _FAST_VERDICTS.clear()
        _FAST_VERDICTS[sha256] = verdict
    return verdict


class EngineTokenizer:
    """A model's tokenizer and chat template (see the module docstring)."""

    def __init__(
        self,
        directory: str | Path,
        *,
        origin: str = "",
        segment_cache_bytes: int = DEFAULT_SEGMENT_CACHE_BYTES,
    ) -> None:
        from tokenizers import Tokenizer as _HF

        self.directory = d = Path(directory)
        tj = d / "tokenizer.json"
        if not tj.is_file():
            raise TokenizerLoadError(f"{d}: no tokenizer.json (a Hugging Face fast tokenizer is required)")
        raw = tj.read_bytes()
        self.sha256 = hashlib.sha256(raw).hexdigest()
        self.name = f"engine:{self.sha256[:16]}"
        self.origin = origin or str(d)
        self.served_model = ""  # the model of the worker it came from, when it came from one
        try:
            self.hf = _HF.from_str(raw.decode("utf-8"))
            parsed = json.loads(raw)
        except Exception as e:  # tokenizers raises plain Exception subclasses
            raise TokenizerLoadError(f"{tj}: {e}") from None
        # a prompt is never cut or padded behind the client's back (the length limits say no
        # instead), and segments must tokenize exactly as the whole text does
        self.hf.no_truncation()
        self.hf.no_padding()
        self.config = _read_json(d / "tokenizer_config.json")
        generation = _read_json(d / "generation_config.json")
        model_config = _read_json(d / "config.json")
        self.added = added_tokens(parsed)
        self.special_ids = frozenset(
            i
            for t in parsed.get("added_tokens") or ()
            if isinstance(t, dict) and t.get("special") and isinstance(i := t.get("id"), int)
        )
        self.special_tokens: dict[str, str] = {}
        for key in SPECIAL_TOKEN_KEYS:
            text = token_text(self.config.get(key))
            if text is not None:
                self.special_tokens[key] = text
        eos: list[int] = []
        if "eos_token" in self.special_tokens:
            tid = self.hf.token_to_id(self.special_tokens["eos_token"])
            if tid is not None:
                eos.append(tid)
        for v in (*_ids(generation.get("eos_token_id")), *_ids(model_config.get("eos_token_id"))):
            if v not in eos:
                eos.append(v)
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        bos = self.special_tokens.get("bos_token")
        self.bos_token_id: int | None = self.hf.token_to_id(bos) if bos else None
        pad = self.special_tokens.get("pad_token")
        self.pad_token_id: int | None = self.hf.token_to_id(pad) if pad else None
        self.vocab_size: int = self.hf.get_vocab_size(with_added_tokens=True)
        source = read_template_source(d, self.config)
        self.template_source = json.dumps(source, sort_keys=True) if source is not None else None
        variables: dict[str, Any] = dict(self.special_tokens)
        extra = self.config.get("additional_special_tokens")
        if isinstance(extra, list):
            variables["additional_special_tokens"] = [t for t in map(token_text, extra) if t is not None]
        self.template: ChatTemplate | None = None
        if source is not None:
            try:
                self.template = ChatTemplate(source, variables)
            except ValueError as e:
                raise TokenizerLoadError(f"{d}: {e}") from None
        # tiktoken encodes where it gives these ids; ``fast_refusal`` says why not otherwise
        self.fast, self.fast_refusal = _fast_encoder(self.sha256, parsed, self.hf)
        self.segments = SegmentEncoder(self.hf, self.added, segment_cache_bytes, self.fast)

    @property
    def identity(self) -> tuple[str, str | None]:
        """What makes two tokenizers interchangeable: the same ids and the same chat template."""
        return self.name, self.template_source

    @property
    def encoder_facts(self) -> dict[str, str]:
        """What encodes its new text, for the load log: tiktoken, or tokenizers and why."""
        if self.fast is not None:
            return {"encoder": "tiktoken"}
        return {"encoder": "tokenizers", "tiktoken_refused": self.fast_refusal}

    def __repr__(self) -> str:
        return f"EngineTokenizer({self.name}, from {self.origin})"

    # -- the Tokenizer protocol (packed LE uint32 ids) -----------------------------------------

    def encode(self, text: str) -> bytes:
        """Packed ids of ``text``, equal to ``encode(text, add_special_tokens=False)`` (segment cache)."""
        return self.segments.encode(text)

    def decode(self, tokens: bytes) -> str:
        return str(self.hf.decode(unpack_ids(tokens), skip_special_tokens=False))

    # -- ids as lists -----------------------------------------------------------------------

    def encode_ids(self, text: str) -> list[int]:
        return unpack_ids(self.encode(text))

    def decode_ids(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        tid = self.hf.token_to_id(token)
        return int(tid) if tid is not None else None

    @property
    def segment_stats(self) -> CacheStats:
        return self.segments.cache.stats

    # -- chat --------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """The model's template over ``messages`` as given (no normalization, no escaping)."""
        if self.template is None:
            raise ChatTemplateError(f"the tokenizer at {self.origin} has no chat template", "messages")
        return self.template.render(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        documents: Sequence[Document] = (),
        tools: Sequence[Any] | None = None,
        normalize: bool = True,
    ) -> str:
        """prefixgate's canonical chat through the model's template (``chat.canonical_messages``)."""
        tools_in = escape_value(list(tools), normalize) if tools else None
        chat = canonical_messages(messages, documents=documents, normalize=normalize)
        try:
            return self.apply_chat_template(chat, tools=tools_in)
        except ChatTemplateError:
            if not documents:
                raise
        # the template refused documents as messages of their own: put them in the system message
        chat = canonical_messages(messages, documents=documents, normalize=normalize, documents_apart=False)
        return self.apply_chat_template(chat, tools=tools_in)

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        documents: Sequence[Document] = (),
        tools: Sequence[Any] | None = None,
        normalize: bool = True,
    ) -> tuple[Layout, bytes]:
        """The rendered chat (a layout of its template segments) and its packed ids."""
        text = self.render_chat(messages, documents=documents, tools=tools, normalize=normalize)
        return self.layout(text), self.encode(text)

    def layout(self, text: str) -> Layout:
        """``text`` as a layout whose segments are the cache's segments (byte offsets)."""
        segments: list[Segment] = []
        offset = 0
        for i, piece in enumerate(self.segments.finder.split(text)):
            end = offset + _utf8_len(piece)
            segments.append(Segment("template", f"segment[{i}]", offset, end))
            offset = end
        return Layout(text, segments)
