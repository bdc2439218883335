"""Constrained decoding on a node: a request's constraint as an allowed-token mask per step.

The constraint is what the SMG engine protocol carries (``SamplingParams.constraint``): a JSON
schema, a regex, an EBNF grammar or a structural tag (xgrammar's ``{"type": "structural_tag",
"format": ...}``, which SGLang and vLLM take). It is compiled with llguidance (a Rust grammar
engine with no GPU stack, that reads the shipped ``tokenizer.json`` directly) against the node's
tokenizer; at each decode step the mask of tokens that keep the output inside the grammar is
applied to the logits before sampling or argmax, and the chosen token advances the matcher. The
end token is allowed exactly when the output so far is complete.

JSON is compact (no free whitespace between tokens: a small model left free to choose it spends
its tokens on blanks). A constraint that does not compile is refused before any compute with
FAILED_PRECONDITION and trailer ``smg-constraint-failed: engine`` (SGLang's way of saying the
grammar failed); so is one that leaves the model no token it can output.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

import llguidance
import llguidance.numpy as llnp
import numpy as np
from numpy.typing import NDArray

from prefixgate.backends.engine import Constraint
from prefixgate.backends.errors import FailedPrecondition
from prefixgate.backends.hftok import TOKENIZER_DIR, load

CONSTRAINT_TRAILER = ("smg-constraint-failed", "engine")
KINDS = ("json_schema", "regex", "ebnf", "structural_tag")
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}
MAX_CONSTRAINT_CHARS = 1 << 20


class ConstraintFailed(FailedPrecondition):
    """The request's constraint cannot be compiled or followed (the request's fault)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, stage="request")
        self.trailers = (CONSTRAINT_TRAILER,)


@lru_cache(maxsize=1)
def tokenizer() -> llguidance.LLTokenizer:
    """The shipped tokenizer as llguidance sees it; the end token is ``<|im_end|>``."""
    shipped = load()
    return llguidance.LLTokenizer(
        (TOKENIZER_DIR / "tokenizer.json").read_text(), eos_token=shipped.eos_token_id
    )


def _lark_string(s: str) -> str:
    return json.dumps(s)  # a JSON string literal is a Lark string literal


def _schema(value: Any) -> dict[str, Any]:
    if value is True or value is None:
        value = {}
    if not isinstance(value, Mapping):
        raise ConstraintFailed("structural_tag: json_schema must be an object")
    schema = dict(value)
    options = dict(schema.get("x-guidance") or {})
    schema["x-guidance"] = {**JSON_OPTIONS, **options}
    return schema


class _Lark:
    """xgrammar's structural tag formats as one Lark grammar (rules r0, r1, ...)."""

    def __init__(self) -> None:
        self.rules: list[str] = []

    def rule(self, body: str) -> str:
        name = f"r{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name

    def tag(self, t: Any) -> str:
        if not isinstance(t, Mapping):
            raise ConstraintFailed("structural_tag: a tag must be an object")
        begin, end = t.get("begin", ""), t.get("end", "")
        if not isinstance(begin, str) or not isinstance(end, str):
            raise ConstraintFailed("structural_tag: tag begin and end must be strings")
        parts = [_lark_string(begin)] if begin else []
        parts.append(self.format(t.get("content")))
        if end:
            parts.append(_lark_string(end))
        return self.rule(" ".join(parts))

    def format(self, f: Any) -> str:
        if not isinstance(f, Mapping):
            raise ConstraintFailed("structural_tag: a format must be an object")
        kind = f.get("type")
        if kind == "const_string":
            value = f.get("value")
            if not isinstance(value, str):
                raise ConstraintFailed("structural_tag: const_string needs a string value")
            return self.rule(_lark_string(value)) if value else self.rule('""')
        if kind == "json_schema":
            return self.rule("%json " + json.dumps(_schema(f.get("json_schema"))))
        if kind == "any_text":
            return self.rule(r"/(.|\n)*/")
        if kind in ("sequence", "or"):
            elements = f.get("elements")
            if not isinstance(elements, list) or not elements:
                raise ConstraintFailed(f"structural_tag: {kind} needs a non-empty elements list")
            names = [self.format(e) for e in elements]
            return self.rule((" " if kind == "sequence" else " | ").join(names))
        if kind == "tag":
            return self.tag(f)
        if kind == "tags_with_separator":
            tags = f.get("tags")
            sep = f.get("separator", "")
            if not isinstance(tags, list) or not tags or not isinstance(sep, str):
                raise ConstraintFailed("structural_tag: tags_with_separator needs tags and a separator")
            one = self.rule(" | ".join(self.tag(t) for t in tags))
            if f.get("stop_after_first"):
                body = one
            elif sep:
                body = f"{one} ({_lark_string(sep)} {one})*"
            else:
                body = f"{one}+"
            return self.rule(body if f.get("at_least_one") else f"({body})?")
        raise ConstraintFailed(f"structural_tag: format type {kind!r} is not supported by this engine")


def structural_tag_lark(text: str) -> str:
    """The Lark grammar of a structural tag (``{"type": "structural_tag", "format": {...}}``)."""
    try:
        tag = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConstraintFailed(f"structural_tag is not valid JSON: {e}") from None
    if not isinstance(tag, Mapping) or "format" not in tag:
        raise ConstraintFailed(
            "structural_tag must be an object with a 'format' (the legacy form is not supported)"
        )
    lark = _Lark()
    top = lark.format(tag["format"])
    return "\n".join([f"start: {top}", *lark.rules]) + "\n"


@lru_cache(maxsize=256)
def compiled(constraint: Constraint) -> str:
    """The llguidance grammar of ``constraint``, checked against the tokenizer (cached)."""
    kind, text = constraint.kind, constraint.text
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise ConstraintFailed(f"{kind} is longer than {MAX_CONSTRAINT_CHARS} characters")
    try:
        if kind == "json_schema":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(text)
        elif kind == "ebnf":
            grammar = llguidance.grammar_from("ebnf", text)
        elif kind == "structural_tag":
            grammar = llguidance.LLMatcher.grammar_from_lark(structural_tag_lark(text))
        else:
            raise ConstraintFailed(f"unknown constraint {kind!r}; use one of {', '.join(KINDS)}")
    except ValueError as e:
        raise ConstraintFailed(f"{kind}: {e}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer())
    if error:
        raise ConstraintFailed(f"{kind} does not compile: {error.strip()[:500]}")
    return grammar


def check(constraint: Constraint) -> None:
    """Raise ``ConstraintFailed`` when ``constraint`` cannot be used."""
    compiled(constraint)


class Guide:
    """One sequence's matcher, as a mask over an engine's output classes (``outputs[c]`` = the
    token id of class ``c``)."""

    __slots__ = ("_bits", "_matcher", "_outputs")

    def __init__(self, constraint: Constraint, outputs: NDArray[np.uint32]) -> None:
        tok = tokenizer()
        self._matcher = llguidance.LLMatcher(tok, compiled(constraint))
        if self._matcher.is_error():
            raise ConstraintFailed(f"{constraint.kind}: {self._matcher.get_error()}")
        self._outputs = outputs.astype(np.int64)
        self._bits = llnp.allocate_token_bitmask(1, tok.vocab_size)

    def allowed(self) -> NDArray[np.bool_]:
        """Which output classes may come next (never none: that is ``ConstraintFailed``)."""
        llnp.fill_next_token_bitmask(self._matcher, self._bits)
        if self._matcher.is_error():
            raise ConstraintFailed(f"constraint failed: {self._matcher.get_error()}")
        words = self._bits[0].view(np.uint32)
        ids = self._outputs
        mask: NDArray[np.bool_] = ((words[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1).astype(bool)
        if not mask.any():
            raise ConstraintFailed("the constraint allows no token this model can output")
        return mask

    def advance(self, tokens: Sequence[int]) -> None:
        """The tokens chosen (the end token included, when it was)."""
        for t in tokens:
            if self._matcher.is_stopped():
                return
            if not self._matcher.consume_token(int(t)):
                raise ConstraintFailed(f"constraint failed: {self._matcher.get_error()}")
