"""The model's own chat template, rendered the way Hugging Face ``apply_chat_template`` does.

Engines of the SMG protocol take token ids only, so the gateway renders the chat itself; the
tokens it sends (and hashes) must be exactly the ones the engine's own template would give. This
module mirrors ``transformers``' template environment: a sandboxed, immutable Jinja environment
with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``{% generation %}``
block that renders its body, ``raise_exception``, ``strftime_now`` and a ``tojson`` filter that
keeps non-ASCII text (``ensure_ascii=False``). The tokenizer's special tokens (``bos_token``,
``eos_token``, ...) are template variables; ``tools`` and ``documents`` pass through.

Where the template comes from, in the order SMG reads it: ``chat_template.json`` >
``chat_template.jinja`` > any other ``*.jinja`` > ``tokenizer_config.json``'s ``chat_template``
(a string, or a list of named templates: ``tool_use`` when tools are given and it exists, else
``default``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from prefixgate.openai.normalize import NormalizationError

SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class ChatTemplateError(NormalizationError):
    """The template refused the chat (``raise_exception``) or failed to render it: the request's
    fault, so it becomes a 400 as other normalization errors do."""

    def __init__(self, message: str, param: str | None = "messages") -> None:
        super().__init__(message, param)


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: marks assistant text for training masks; the
    rendered text is the body, unchanged (as ``transformers`` renders it)."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares it a plain attribute)

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body", [])
        return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def token_text(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def read_template_source(directory: Path, config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """The directory's chat template (see the module docstring for the order)."""
    cj = directory / "chat_template.json"
    if cj.is_file():
        value = json.loads(cj.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(value, str):
            return value
    main = directory / "chat_template.jinja"
    if main.is_file():
        return main.read_text(encoding="utf-8")
    others = sorted(directory.glob("*.jinja"))
    if others:
        return others[0].read_text(encoding="utf-8")
    value = config.get("chat_template")
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {
            str(t["name"]): str(t["template"])
            for t in value
            if isinstance(t, Mapping)
            and isinstance(t.get("name"), str)
            and isinstance(t.get("template"), str)
        }
        return named or None
    return None


class ChatTemplate:
    """A compiled chat template plus the special-token variables it is rendered with."""

    def __init__(self, source: str | Mapping[str, str], variables: Mapping[str, Any] | None = None) -> None:
        env = _environment()
        sources = {"default": source} if isinstance(source, str) else dict(source)
        if not sources:
            raise ValueError("empty chat template")
        try:
            self._templates = {name: env.from_string(text) for name, text in sources.items()}
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template does not compile: {e}") from None
        self.sources = sources
        self.variables = dict(variables or {})

    @property
    def source(self) -> str:
        """The default template's text."""
        return self.sources.get("default", next(iter(self.sources.values())))

    def _pick(self, tools: Sequence[Any] | None) -> jinja2.Template:
        if tools and "tool_use" in self._templates:
            return self._templates["tool_use"]
        return self._templates.get("default", next(iter(self._templates.values())))

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Any] | None = None,
        documents: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """The chat as the model sees it (``apply_chat_template(..., tokenize=False)``)."""
        values = {**self.variables, **kwargs}
        try:
            return self._pick(tools).render(
                messages=list(messages),
                tools=list(tools) if tools else None,
                documents=list(documents) if documents else None,
                add_generation_prompt=add_generation_prompt,
                **values,
            )
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
            raise ChatTemplateError(f"chat template failed: {e}") from None
