"""OpenAPI 3.0 description of the client API (served at ``/openapi.json``)."""

from __future__ import annotations

from typing import Any

from prefixgate.openai.normalize import DOCUMENT_ID_PATTERN, MAX_DOCUMENT_ID
from prefixgate.openai.schema import MAX_COMPLETION_LOGPROBS, MAX_N, MAX_TOP_LOGPROBS

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": "string", "nullable": True},
                "code": {"type": "string", "nullable": True},
            },
        }
    },
}

_DOCUMENT_ID = {"type": "string", "pattern": DOCUMENT_ID_PATTERN, "maxLength": MAX_DOCUMENT_ID}
_DOCUMENT = {
    "type": "object",
    "required": ["text"],
    "properties": {"id": _DOCUMENT_ID, "text": {"type": "string"}},
}

_COMMON = {
    "model": {"type": "string"},
    "max_tokens": {"type": "integer", "minimum": 1, "nullable": True},
    "max_completion_tokens": {"type": "integer", "minimum": 1, "nullable": True},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2, "nullable": True},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1, "nullable": True},
    "seed": {"type": "integer", "nullable": True},
    "stop": {
        "nullable": True,
        "oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 4}],
    },
    "stream": {"type": "boolean", "nullable": True},
    "stream_options": {
        "type": "object",
        "nullable": True,
        "properties": {"include_usage": {"type": "boolean"}},
    },
    "user": {"type": "string"},
    "n": {"type": "integer", "minimum": 1, "maximum": MAX_N, "nullable": True},
    "logit_bias": {
        "type": "object",
        "nullable": True,
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
    },
    "documents": {"type": "array", "items": _DOCUMENT},
    "document_ids": {"type": "array", "items": _DOCUMENT_ID},
}

_MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {
            "nullable": True,
            "oneOf": [
                {"type": "string"},
                {
                    "type": "array",
                    "items": {
                        "oneOf": [
                            {
                                "type": "object",
                                "required": ["type", "text"],
                                "properties": {
                                    "type": {"type": "string", "enum": ["text"]},
                                    "text": {"type": "string"},
                                },
                            },
                            {
                                "type": "object",
                                "required": ["type", "image_url"],
                                "properties": {
                                    "type": {"type": "string", "enum": ["image_url"]},
                                    "image_url": {
                                        "type": "object",
                                        "required": ["url"],
                                        "properties": {
                                            "url": {"type": "string"},
                                            "detail": {"type": "string"},
                                        },
                                    },
                                },
                            },
                        ]
                    },
                },
            ],
        },
        "name": {"type": "string"},
    },
}

_TOKENS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
_EMBEDDINGS = {
    "type": "object",
    "required": ["input"],
    "additionalProperties": False,
    "properties": {
        "model": {"type": "string"},
        "input": {
            "oneOf": [
                {"type": "string", "minLength": 1},
                {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 2048,
                    "items": {"type": "string", "minLength": 1},
                },
                _TOKENS,
                {"type": "array", "minItems": 1, "maxItems": 2048, "items": _TOKENS},
            ]
        },
        "encoding_format": {"type": "string", "enum": ["float", "base64"]},
        "dimensions": {"type": "integer", "minimum": 1},
        "user": {"type": "string"},
    },
}

_USAGE = {
    "type": "object",
    "properties": {
        "prompt_tokens": {"type": "integer"},
        "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
        "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": {"type": "integer"}}},
    },
}


def _list_response(description: str, **extra: Any) -> dict[str, Any]:
    """A 200 whose body is an OpenAI list: ``object``, ``data`` (and ``extra`` properties)."""
    properties = {
        "object": {"type": "string"},
        "data": {"type": "array", "items": {"type": "object"}},
        **extra,
    }
    schema = {"type": "object", "required": ["data"], "properties": properties}
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*codes: int) -> dict[str, Any]:
    return {
        str(c): {
            "description": "error",
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        }
        for c in codes
    }


def _completion_op(summary: str, body_schema: str) -> dict[str, Any]:
    return {
        "summary": summary,
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{body_schema}"}}},
        },
        "responses": {
            "200": {
                "description": "a completion (JSON) or a stream of server-sent events",
                "content": {
                    "application/json": {"schema": {"type": "object", "properties": {"usage": _USAGE}}},
                    "text/event-stream": {"schema": {"type": "string"}},
                },
            },
            **_errors(400, 401, 404, 413, 422, 429, 502, 503),
        },
    }


def openapi_spec(models: list[str]) -> dict[str, Any]:
    return {
        "openapi": "3.0.3",
        "info": {"title": "prefixgate", "version": "1", "description": "OpenAI-compatible gateway"},
        "paths": {
            "/v1/chat/completions": {"post": _completion_op("Chat completion", "ChatRequest")},
            "/v1/completions": {"post": _completion_op("Text completion", "CompletionRequest")},
            "/v1/models": {
                "get": {
                    "summary": "Served models",
                    "responses": {"200": _list_response("models")},
                }
            },
            "/v1/embeddings": {
                "post": {
                    "summary": "Embeddings, from a worker that serves them",
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": _EMBEDDINGS}},
                    },
                    "responses": {
                        "200": _list_response(
                            "one embedding per input, in order",
                            model={"type": "string"},
                            usage={"type": "object"},
                        ),
                        **_errors(400, 401, 404, 413, 429, 503),
                    },
                }
            },
            "/v1/documents": {
                "post": {
                    "summary": "Register a document",
                    "requestBody": {"required": True, "content": {"application/json": {"schema": _DOCUMENT}}},
                    "responses": {
                        "201": {
                            "description": "registered",
                            "content": {
                                "application/json": {
                                    "schema": {
                                        "type": "object",
                                        "required": ["id"],
                                        "properties": {"id": {"type": "string"}},
                                    }
                                }
                            },
                        },
                        **_errors(400, 401, 413, 429),
                    },
                }
            },
            "/v1/usage": {
                "get": {
                    "summary": "The caller's tenant usage: tokens per model and their value",
                    "responses": {"200": {"description": "the tenant's figures"}, **_errors(401, 503)},
                }
            },
            "/v1/documents/{doc_id}": {
                "parameters": [
                    {"name": "doc_id", "in": "path", "required": True, "schema": {"type": "string"}}
                ],
                "get": {
                    "summary": "A registered document",
                    "responses": {"200": {"description": "the document"}, **_errors(401, 404)},
                },
                "delete": {
                    "summary": "Forget a document",
                    "responses": {"200": {"description": "deleted"}, **_errors(401, 404)},
                },
            },
        },
        "components": {
            "schemas": {
                "Error": _ERROR,
                "ChatRequest": {
                    "type": "object",
                    "required": ["model", "messages"],
                    "properties": {
                        **_COMMON,
                        "model": {"type": "string", "enum": models},
                        "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
                        "tools": {"type": "array", "items": {"type": "object"}},
                        "tool_choice": {"nullable": True, "oneOf": [{"type": "string"}, {"type": "object"}]},
                        "response_format": {
                            "type": "object",
                            "nullable": True,
                            "properties": {
                                "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
                                "json_schema": {"type": "object"},
                            },
                        },
                        "logprobs": {"type": "boolean", "nullable": True},
                        "top_logprobs": {
                            "type": "integer",
                            "minimum": 0,
                            "maximum": MAX_TOP_LOGPROBS,
                            "nullable": True,
                        },
                    },
                },
                "CompletionRequest": {
                    "type": "object",
                    "required": ["model", "prompt"],
                    "properties": {
                        **_COMMON,
                        "model": {"type": "string", "enum": models},
                        "prompt": {
                            "oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer"}}]
                        },
                        "logprobs": {
                            "type": "integer",
                            "minimum": 0,
                            "maximum": MAX_COMPLETION_LOGPROBS,
                            "nullable": True,
                        },
                    },
                },
            }
        },
    }
