"""Constrained decoding as the gateway asks engines for it: what the output must match.

A ``Constraint`` is what the SMG engine protocol carries in ``SamplingParams.constraint``:
``json_schema`` (the schema's JSON text), ``regex``, ``ebnf`` (SGLang ``ebnf_grammar``, vLLM
``grammar``) or ``structural_tag`` (xgrammar's ``{"type": "structural_tag", "format": ...}``
JSON, taken by SGLang and vLLM alike). ``response_format`` becomes a JSON schema: ``json_object``
the schema ``{"type": "object"}`` (as SGLang and smg do), ``json_schema`` its ``schema``. Pure.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prefixgate.gateway.core.errors import invalid

KINDS = ("json_schema", "regex", "ebnf", "structural_tag")
JSON_OBJECT = json.dumps({"type": "object"})


@dataclass(frozen=True, slots=True)
class Constraint:
    kind: str  # one of KINDS
    text: str


def from_response_format(response_format: Mapping[str, Any] | None) -> Constraint | None:
    """The constraint of a validated ``response_format`` (None for plain text)."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "json_object":
        return Constraint("json_schema", JSON_OBJECT)
    if kind != "json_schema":
        return None
    spec = response_format.get("json_schema")
    schema = spec.get("schema", {}) if isinstance(spec, Mapping) else {}
    if not isinstance(schema, Mapping) and not isinstance(schema, bool):
        raise invalid(
            "'response_format.json_schema.schema' must be a JSON schema object",
            "response_format.json_schema.schema",
        )
    return Constraint("json_schema", json.dumps(schema, separators=(",", ":"), ensure_ascii=False))
