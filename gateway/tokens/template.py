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

The template comes with the worker's tokenizer, so it is bounded like any other engine input: a
render stops itself past ``RENDER_TIMEOUT_S`` or ``MAX_RENDER_CHARS`` of output (``TemplateLimitError``).
A thread cannot be stopped from outside, so the sandbox checks the deadline itself: every loop
iterates through a guard, every call from the template goes through the environment's ``call``;
``*`` and ``**`` refuse results past the bounds before computing them (one such operation could
otherwise outlast any deadline). Renders run off the event loop (``gateway.core.runner``), so even a
render up to its bound never holds the gateway's other requests.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, cast

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

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
# A real chat template renders the largest chat the gateway takes (4096 messages, an 8 MiB body)
# in well under 0.3 s and to about the size of the chat; past ten times that, it runs away.
RENDER_TIMEOUT_S = 2.0
MAX_RENDER_CHARS = 32 << 20  # four times the largest body: more is no rendering of the chat
MAX_INT_BITS = 1 << 16  # of an integer a template computes with ``*`` or ``**``


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


class TemplateLimitError(RuntimeError):
    """A render past its time or output bound (or recursing without end): the template runs
    away, whatever the chat; the server's configuration is at fault, not the request."""


class RenderOverBudget(Exception):
    """A render ran past the budget of the thread it runs on (``budget``): not the template's
    fault yet, only too long for that thread; the caller renders it again where it may take its
    whole time."""


_render = threading.local()  # the running render's deadline, per thread (renders run on many)


@contextlib.contextmanager
def budget(seconds: float) -> Iterator[None]:
    """Renders on this thread inside the block stop with ``RenderOverBudget`` past ``seconds``
    (when that is shorter than their own bound): a render on the event loop must be short."""
    _render.budget = seconds
    try:
        yield
    finally:
        _render.budget = None


def _check_deadline() -> None:
    deadline: float | None = getattr(_render, "deadline", None)
    if deadline is not None and time.monotonic() > deadline:
        if getattr(_render, "budgeted", False):
            raise RenderOverBudget(f"the chat template ran past {_render.budget:g} s on this thread")
        raise TemplateLimitError(f"the chat template ran for more than {_render.timeout_s:g} s")


def _too_large(what: str) -> TemplateLimitError:
    limit: int = getattr(_render, "max_chars", MAX_RENDER_CHARS)
    return TemplateLimitError(f"the chat template builds {what} over {limit} characters")


def _size(value: Any) -> int:
    return len(value) if isinstance(value, str | list | tuple) else 0


class _Bounds(jinja2.ext.Extension):
    """What the compiled template iterates its loops through (see ``_Bounded``)."""

    def iterate(self, seq: Iterable[Any]) -> Iterable[Any]:
        deadline: float | None = getattr(_render, "deadline", None)
        return seq if deadline is None else _Guarded(seq, deadline)


class _Guarded:
    """A loop's sequence, the deadline checked at every step (its length, when it has one,
    kept for ``loop.length`` and friends)."""

    __slots__ = ("_deadline", "_seq")

    def __init__(self, seq: Iterable[Any], deadline: float) -> None:
        self._seq = seq
        self._deadline = deadline

    def __iter__(self) -> Iterator[Any]:
        deadline, clock = self._deadline, time.monotonic
        for item in self._seq:
            if clock() > deadline:
                _check_deadline()  # raises
            yield item

    def __len__(self) -> int:
        return len(self._seq)  # type: ignore[arg-type]  # TypeError without one, as jinja expects


class _Bounded(NodeTransformer):
    """Rewrites a parsed template: ``for x in seq`` iterates ``_Bounds.iterate(seq)``."""

    def __init__(self, identifier: str) -> None:
        self.identifier = identifier

    def _call(self, method: str, args: list[nodes.Expr], lineno: int) -> nodes.Call:
        attr = nodes.ExtensionAttribute(self.identifier, method, lineno=lineno)
        return nodes.Call(attr, args, [], None, None, lineno=lineno)

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = self._call("iterate", [cast(nodes.Expr, node.iter)], node.lineno)
        return node


class _Environment(ImmutableSandboxedEnvironment):
    """The sandbox, checking the running render's deadline at every call from the template and
    the size of what ``*`` and ``**`` would build before building it. ``+`` and ``~`` are left
    alone: templates use them everywhere and checking each would make every render several times
    slower; what they build is bounded by the deadline only."""

    intercepted_binops = frozenset({"*", "**"})

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _check_deadline()
        return super().call(__context, __obj, *args, **kwargs)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_deadline()
        limit: int = getattr(_render, "max_chars", MAX_RENDER_CHARS)
        ints = type(left) is int and type(right) is int
        if operator == "**" and ints and right > 0 and abs(left) > 1:
            if abs(left).bit_length() * right > MAX_INT_BITS:
                raise TemplateLimitError(f"the chat template computes a number over {MAX_INT_BITS} bits")
        elif operator == "*" and ints:
            if abs(left).bit_length() + abs(right).bit_length() > MAX_INT_BITS:
                raise TemplateLimitError(f"the chat template computes a number over {MAX_INT_BITS} bits")
        elif operator == "*":
            n = right if type(right) is int else left if type(left) is int else 0
            if n > 0 and max(_size(left), _size(right)) * n > limit:
                raise _too_large("a value")
        return super().call_binop(context, operator, left, right)


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


def _environment() -> _Environment:
    env = _Environment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols, _Bounds]
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


def _compile(env: _Environment, text: str) -> jinja2.Template:
    """The template, its loops and joins bounded (``_Bounded``)."""
    tree = env.parse(text)
    _Bounded(_Bounds.identifier).visit(tree)
    tree.set_environment(env)
    template = env.from_string(tree)
    # Its globals are a ChainMap over the environment's (so that later changes show), which every
    # render copies into a dict key by key in Python; nothing changes them after this.
    template.globals = dict(template.globals)
    return template


class ChatTemplate:
    """A compiled chat template plus the special-token variables it is rendered with; a render
    stops past ``timeout_s`` or ``max_chars`` of output (``TemplateLimitError``)."""

    def __init__(
        self,
        source: str | Mapping[str, str],
        variables: Mapping[str, Any] | None = None,
        *,
        timeout_s: float = RENDER_TIMEOUT_S,
        max_chars: int = MAX_RENDER_CHARS,
    ) -> None:
        env = _environment()
        sources = {"default": source} if isinstance(source, str) else dict(source)
        if not sources:
            raise ValueError("empty chat template")
        try:
            self._templates = {name: _compile(env, text) for name, text in sources.items()}
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template does not compile: {e}") from None
        self.sources = sources
        self.variables = dict(variables or {})
        self.timeout_s = timeout_s
        self.max_chars = max_chars

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
        """The chat as the model sees it (``apply_chat_template(..., tokenize=False)``); raises
        ``ChatTemplateError`` when the template refuses the chat, ``TemplateLimitError`` past the
        bounds."""
        values = {**self.variables, **kwargs}
        allowed: float | None = getattr(_render, "budget", None)
        _render.budgeted = allowed is not None and allowed < self.timeout_s
        limit = allowed if allowed is not None and _render.budgeted else self.timeout_s
        _render.deadline = time.monotonic() + limit
        _render.timeout_s, _render.max_chars = self.timeout_s, self.max_chars
        try:
            out: list[str] = []
            size = 0
            for piece in self._pick(tools).generate(
                messages=list(messages),
                tools=list(tools) if tools else None,
                documents=list(documents) if documents else None,
                add_generation_prompt=add_generation_prompt,
                **values,
            ):
                size += len(piece)
                if size > self.max_chars:
                    raise TemplateLimitError(f"the chat template renders over {self.max_chars} characters")
                out.append(piece)
            _check_deadline()
            return "".join(out)
        except (ChatTemplateError, TemplateLimitError, RenderOverBudget):
            raise
        except RecursionError:
            raise TemplateLimitError("the chat template recurses without end") from None
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError, ArithmeticError) as e:
            raise ChatTemplateError(f"chat template failed: {e}") from None
        finally:
            _render.deadline = None
