"""An OpenAI ``/v1/embeddings`` request, checked: its inputs (a string, strings, token ids, lists
of token ids), ``encoding_format`` and ``dimensions``; what prefixgate's nodes and the gateway
both read. Pure: no I/O."""

from __future__ import annotations

import base64
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prefixgate.gateway.core.errors import invalid

#: OpenAI's bounds: at most 2048 inputs a request; token ids are below 2**31.
MAX_INPUTS = 2048
MAX_TOKEN_ID = 2**31 - 1
FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "user"})
ENCODINGS = ("float", "base64")


@dataclass(frozen=True, slots=True)
class EmbeddingsRequest:
    model: str
    inputs: tuple[str | tuple[int, ...], ...]  # a text, or a text's token ids
    encoding_format: str = "float"
    dimensions: int | None = None

    @property
    def text_chars(self) -> int:
        return sum(len(i) for i in self.inputs if isinstance(i, str))


def _token_list(value: list[Any], param: str) -> tuple[int, ...]:
    ok = all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in value)
    if not value or not ok:
        raise invalid(f"'{param}' token ids must be a non-empty list of integers from 0", param)
    return tuple(value)


def parse_embeddings(body: Mapping[str, Any], default_model: str = "") -> EmbeddingsRequest:
    """The request; InvalidRequest (400) names the field at fault."""
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise invalid(f"unknown field {unknown[0]!r} for embeddings", unknown[0])
    model = body.get("model", default_model)
    if not isinstance(model, str) or not model:
        raise invalid("'model' is required", "model")
    raw = body.get("input")
    inputs: list[str | tuple[int, ...]]
    if isinstance(raw, str):
        inputs = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(x, int) and not isinstance(x, bool) for x in raw):
        inputs = [_token_list(raw, "input")]
    elif isinstance(raw, list) and raw:
        inputs = []
        for i, item in enumerate(raw):
            if isinstance(item, str):
                inputs.append(item)
            elif isinstance(item, list):
                inputs.append(_token_list(item, f"input[{i}]"))
            else:
                raise invalid(f"'input[{i}]' must be a string or a list of token ids", "input")
    else:
        raise invalid("'input' must be a string, a list of strings or a list of token ids", "input")
    if len(inputs) > MAX_INPUTS:
        raise invalid(f"'input' has {len(inputs)} items; at most {MAX_INPUTS}", "input")
    if any(isinstance(i, str) and not i for i in inputs):
        raise invalid("'input' must not contain an empty string", "input")
    encoding = body.get("encoding_format", "float")
    if encoding not in ENCODINGS:
        raise invalid(f"'encoding_format' must be one of {', '.join(ENCODINGS)}", "encoding_format")
    dimensions = body.get("dimensions")
    if dimensions is not None and (
        isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1
    ):
        raise invalid("'dimensions' must be a positive integer", "dimensions")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise invalid("'user' must be a string", "user")
    return EmbeddingsRequest(model, tuple(inputs), str(encoding), dimensions)


def encode_vector(vector: Sequence[float], encoding: str) -> list[float] | str:
    """As OpenAI sends one: floats, or base64 of little-endian float32."""
    if encoding == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return list(vector)


def response_body(
    model: str, vectors: Sequence[Sequence[float]], encoding: str, tokens: int
) -> dict[str, Any]:
    data = [
        {"object": "embedding", "index": i, "embedding": encode_vector(v, encoding)}
        for i, v in enumerate(vectors)
    ]
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
