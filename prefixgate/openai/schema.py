"""Parse and validate OpenAI-shaped request bodies into a typed request."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
import xxhash

from prefixgate.gateway.core.errors import NotFound, TooLarge, invalid
from prefixgate.gateway.scheduling.classes import MAX_PRIORITY as MAX_PRIORITY
from prefixgate.openai.constraint import Constraint, from_response_format
from prefixgate.openai.features import Feature
from prefixgate.openai.normalize import DOCUMENT_ID_ALPHABET, MAX_DOCUMENT_ID, Document, is_document_id
from prefixgate.openai.tool_messages import check_tool_messages, check_tools

MAX_STOP = 4
MAX_STOP_LEN = 256
MAX_SEED = 2**63 - 1
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 16_384
MAX_JSON_VALUES = 131_072
MAX_N = 16  # choices per request: each is a full generation on the nodes
MAX_TOP_LOGPROBS = 20  # chat; completions allow at most 5, as OpenAI
MAX_COMPLETION_LOGPROBS = 5
MAX_LOGIT_BIAS = 1024
MAX_TOKEN_ID = 2**32 - 1


@dataclass(slots=True)
class Sampling:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    # Which of the request's ``n`` choices this is: an engine mixes it into its sampling seed,
    # so choices differ from each other yet each is reproducible under a ``seed``.
    choice: int = 0
    logprobs: bool = False  # report each output token's log probability
    top_logprobs: int = 0  # and this many most likely alternatives per position
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    # Output decoded with special tokens shown (but the end of turn): a tool-call parser whose
    # markers are special tokens needs them, as SGLang decodes when tools are given.
    keep_special_tokens: bool = False
    # What the output must match (``response_format``, or a forced tool call): the engine's
    # constrained decoding.
    constraint: Constraint | None = None
    # The client takes the output as it is made (SSE, the gRPC API's Generate); False: it takes
    # the answer whole, so a node may answer in one message (docs/engines.md, Whole answers).
    stream: bool = True


def choice_seed(seed: int, choice: int) -> int:
    """The seed of choice ``choice`` of a request seeded with ``seed`` (a 64-bit value; choice 0
    keeps the request's seed): each choice its own stream, each reproducible."""
    if choice == 0:
        return seed & 0xFFFFFFFFFFFFFFFF
    return xxhash.xxh3_64_intdigest(f"{seed}:{choice}".encode())


@dataclass(slots=True)
class ParsedRequest:
    kind: str  # "chat" | "completion"
    model: str
    sampling: Sampling
    messages: list[dict[str, Any]] = field(default_factory=list)
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    documents: list[Document] = field(default_factory=list)
    document_ids: list[str] = field(default_factory=list)
    tools: list[Any] | None = None
    stream: bool = False
    include_usage: bool = False
    user: str = ""
    max_tokens_given: bool = False
    max_tokens_param: str = "max_tokens"  # the field that gave it (max_completion_tokens wins)
    pin_seconds: float = 0.0
    n: int = 1
    response_format: dict[str, Any] | None = None
    tool_choice: Any = None
    cache_salt: str = ""  # the client's own division of its tenant's cache namespace
    priority: int = 0  # lower is handled earlier (vLLM's meaning); 0: the default
    priority_given: bool = False  # the client sent ``priority``
    # Engine-dependent features the request asks for, each with the field that asks for it.
    needs: dict[Feature, str] = field(default_factory=dict)


def count_values(value: Any, limit: int) -> int:
    """How many JSON values ``value`` holds (itself included), counting no further than ``limit + 1``."""
    count = 0
    pending = [value]
    while pending and count <= limit:
        v = pending.pop()
        count += 1
        if isinstance(v, dict):
            pending.extend(v.values())
        elif isinstance(v, list):
            pending.extend(v)
    return count + len(pending)


def parse_json(raw: bytes, max_values: int = MAX_JSON_VALUES) -> dict[str, Any]:
    """A JSON object body, holding at most ``max_values`` values in all (the cost of parsing and
    validating a body grows with its values, not its bytes)."""
    if not raw:
        raise invalid("request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid(f"request body is not valid UTF-8 (byte {e.start})", code="invalid_encoding") from None
    try:
        body = orjson.loads(text)
    except orjson.JSONDecodeError as e:
        raise invalid(f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    # every value starts at a byte of its own: a body of no more bytes than values needs no count
    if len(raw) > max_values and count_values(body, max_values) > max_values:
        raise TooLarge(f"request body has more than {max_values} JSON values", code="too_many_values")
    return body


def _int(body: Mapping[str, Any], key: str, lo: int, hi: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise invalid(f"'{key}' must be an integer", key)
    if not lo <= v <= hi:
        raise invalid(f"'{key}' must be between {lo} and {hi}, got {v}", key)
    return v


def _float(body: Mapping[str, Any], key: str, lo: float, hi: float) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise invalid(f"'{key}' must be a number", key)
    if not lo <= v <= hi:
        raise invalid(f"'{key}' must be between {lo} and {hi}, got {v}", key)
    return float(v)


def _bool(body: Mapping[str, Any], key: str) -> bool:
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise invalid(f"'{key}' must be a boolean", key)
    return v


def _str(body: Mapping[str, Any], key: str, max_len: int = 256) -> str:
    v = body.get(key)
    if v is None:
        return ""
    if not isinstance(v, str):
        raise invalid(f"'{key}' must be a string", key)
    if len(v) > max_len:
        raise invalid(f"'{key}' is longer than {max_len} characters", key)
    return v


def _cache_salt(body: Mapping[str, Any]) -> str:
    """vLLM's ``cache_salt``; SGLang's ``extra_key`` is its own name for the same thing, so a
    body giving it is told to use the one the gateway carries to every engine."""
    if body.get("extra_key") is not None:
        raise invalid("'extra_key' is not taken; send 'cache_salt' (a string)", "extra_key")
    return _str(body, "cache_salt")


def parse_documents(body: Mapping[str, Any], max_documents: int) -> tuple[list[Document], list[str]]:
    docs: list[Document] = []
    raw = body.get("documents")
    if raw is not None:
        if not isinstance(raw, list):
            raise invalid("'documents' must be an array of {id, text} objects", "documents")
        if len(raw) > max_documents:
            raise invalid(f"at most {max_documents} documents per request", "documents")
        for i, d in enumerate(raw):
            if not isinstance(d, Mapping):
                raise invalid("each document must be an object with 'id' and 'text'", f"documents[{i}]")
            did, text = d.get("id"), d.get("text")
            if not isinstance(text, str):
                raise invalid("document 'text' must be a string", f"documents[{i}].text")
            if did is None:
                did = f"doc-{i}"
            docs.append(Document(document_id(did, f"documents[{i}].id"), text))
    ids: list[str] = []
    raw_ids = body.get("document_ids")
    if raw_ids is not None:
        if not isinstance(raw_ids, list) or not all(isinstance(x, str) for x in raw_ids):
            raise invalid("'document_ids' must be an array of strings", "document_ids")
        if len(raw_ids) + len(docs) > max_documents:
            raise invalid(f"at most {max_documents} documents per request", "document_ids")
        ids = [document_id(x, f"document_ids[{i}]") for i, x in enumerate(raw_ids)]
    return docs, ids


def document_id(value: Any, param: str) -> str:
    """A document id from a request: it is written inside a template marker, so only a safe
    alphabet is accepted (400 naming the field otherwise)."""
    if not isinstance(value, str) or not is_document_id(value):
        raise invalid(
            f"a document id is 1 to {MAX_DOCUMENT_ID} of {DOCUMENT_ID_ALPHABET}; got {str(value)[:64]!r}",
            param,
            code="invalid_document_id",
        )
    return value


def _stop(body: Mapping[str, Any]) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise invalid("'stop' must be a string or an array of strings", "stop")
    if len(items) > MAX_STOP:
        raise invalid(f"'stop' takes at most {MAX_STOP} sequences", "stop")
    if any(not s or len(s) > MAX_STOP_LEN for s in items):
        raise invalid(f"each stop sequence must have 1 to {MAX_STOP_LEN} characters", "stop")
    return list(items)


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise invalid("only best_of=1 is supported; use n for several choices", "best_of")
    if body.get("echo"):
        raise invalid("'echo' is not supported", "echo")


def _logprobs(body: Mapping[str, Any], kind: str, sampling: Sampling, needs: dict[Feature, str]) -> None:
    """Chat: ``logprobs`` (bool) and ``top_logprobs`` (0-20, needs ``logprobs``). Completions:
    ``logprobs`` (0-5), the number of alternatives per position."""
    if kind == "chat":
        sampling.logprobs = _bool(body, "logprobs")
        top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if top:
            if not sampling.logprobs:
                raise invalid("'top_logprobs' needs 'logprobs' set to true", "top_logprobs")
            sampling.top_logprobs = top
    else:
        top = _int(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
        if top is not None:
            sampling.logprobs, sampling.top_logprobs = True, top
    if sampling.logprobs:
        needs[Feature.LOGPROBS] = "logprobs"


def _logit_bias(body: Mapping[str, Any]) -> dict[int, float]:
    """``{"token id": bias}``, bias in [-100, 100] (OpenAI's bounds)."""
    v = body.get("logit_bias")
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise invalid("'logit_bias' must be an object mapping token ids to numbers", "logit_bias")
    if len(v) > MAX_LOGIT_BIAS:
        raise invalid(f"'logit_bias' takes at most {MAX_LOGIT_BIAS} tokens", "logit_bias")
    out: dict[int, float] = {}
    for key, bias in v.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) <= MAX_TOKEN_ID):
            raise invalid(f"'logit_bias' keys must be token ids, got {str(key)[:32]!r}", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
            raise invalid(f"'logit_bias' values must be numbers in [-100, 100], got {bias!r}", "logit_bias")
        out[int(key)] = float(bias)
    return out


def _response_format(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """``{"type": "text" | "json_object" | "json_schema", ...}``; None for plain text."""
    v = body.get("response_format")
    if v is None:
        return None
    if not isinstance(v, Mapping):
        raise invalid("'response_format' must be an object", "response_format")
    kind = v.get("type")
    if kind == "text":
        return None
    if kind == "json_schema":
        schema = v.get("json_schema")
        if not isinstance(schema, Mapping) or not isinstance(schema.get("name"), str):
            raise invalid("'response_format.json_schema' needs a 'name'", "response_format.json_schema")
    elif kind != "json_object":
        raise invalid(
            "'response_format.type' must be 'text', 'json_object' or 'json_schema'", "response_format.type"
        )
    return dict(v)


def _tool_choice(body: Mapping[str, Any], tools: list[Any] | None) -> Any:
    """``none``, ``auto``, ``required`` or a named function that must be among ``tools``."""
    v = body.get("tool_choice")
    if v is None:
        return None
    if not tools:
        raise invalid("'tool_choice' is only allowed when 'tools' are given", "tool_choice")
    if v in ("none", "auto", "required"):
        return v
    fn = v.get("function") if isinstance(v, Mapping) and v.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str):
        raise invalid(
            "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name'}}",
            "tool_choice",
        )
    names = {t.get("function", {}).get("name") for t in tools if isinstance(t, Mapping)}
    if name not in names:
        raise invalid(f"'tool_choice' names function {name!r}, which is not in 'tools'", "tool_choice")
    return v


def _image_params(messages: list[Any]) -> str | None:
    """The first image content part, as the field naming it (``messages[i].content[j]``)."""
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, Mapping) else None
        if isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, Mapping) and part.get("type") == "image_url":
                    return f"messages[{i}].content[{j}]"
    return None


def check_message_count(count: int, max_messages: int) -> None:
    """Refuse too many messages before any work is done per message."""
    if count > max_messages:
        raise TooLarge(
            f"'messages' has {count} entries; this gateway accepts at most {max_messages}",
            param="messages",
            code="too_many_messages",
        )


def check_messages(messages: list[Any], max_messages: int, max_content_parts: int) -> None:
    """Cheap bounds on a chat's shape (count, content parts), before rendering it."""
    check_message_count(len(messages), max_messages)
    parts = 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise invalid("each message must be an object", f"messages[{i}]")
        content = m.get("content")
        if isinstance(content, list):
            parts += len(content)
            if parts > max_content_parts:
                raise TooLarge(
                    f"the messages have more than {max_content_parts} content parts in all",
                    param=f"messages[{i}].content",
                    code="too_many_content_parts",
                )


def parse_request(
    body: Mapping[str, Any],
    kind: str,
    *,
    models: set[str],
    default_max_tokens: int,
    max_tokens_limit: int,
    max_documents: int,
    max_messages: int = MAX_MESSAGES,
    max_content_parts: int = MAX_CONTENT_PARTS,
) -> ParsedRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' is required and must be a string", "model")
    if model not in models:
        raise NotFound(
            f"The model '{model}' does not exist; available: {', '.join(sorted(models))}",
            param="model",
            code="model_not_found",
        )
    _refuse_unsupported(body)
    max_tokens = _int(body, "max_completion_tokens", 1, 2**31)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1, 2**31)
    given = max_tokens is not None
    if max_tokens is not None and max_tokens > max_tokens_limit:
        param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        raise invalid(f"'{param}' is {max_tokens}; this gateway allows at most {max_tokens_limit}", param)
    temperature = _float(body, "temperature", 0.0, 2.0)
    top_p = _float(body, "top_p", 0.0, 1.0)
    seed = _int(body, "seed", -MAX_SEED, MAX_SEED)
    needs: dict[Feature, str] = {}
    stream = _bool(body, "stream")
    sampling = Sampling(
        max_tokens=max_tokens or default_max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        seed=seed,
        stop=_stop(body),
        logit_bias=_logit_bias(body),
        stream=stream,
    )
    if sampling.logit_bias:
        needs[Feature.LOGIT_BIAS] = "logit_bias"
    if seed is not None and sampling.temperature > 0:  # greedy output is the same with any seed
        needs[Feature.SEED] = "seed"
    _logprobs(body, kind, sampling, needs)
    response_format = _response_format(body)
    if response_format is not None:
        needs[Feature.RESPONSE_FORMAT] = "response_format"
        sampling.constraint = from_response_format(response_format)
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, Mapping):
            raise invalid("'stream_options' must be an object", "stream_options")
        include_usage = _bool(opts, "include_usage")
    docs, doc_ids = parse_documents(body, max_documents)
    req = ParsedRequest(
        kind=kind,
        model=model,
        sampling=sampling,
        documents=docs,
        document_ids=doc_ids,
        stream=stream,
        include_usage=include_usage,
        user=_str(body, "user"),
        cache_salt=_cache_salt(body),
        max_tokens_given=given,
        max_tokens_param="max_completion_tokens"
        if body.get("max_completion_tokens") is not None
        else "max_tokens",
        n=_int(body, "n", 1, MAX_N) or 1,
        # within the scheduler's bound, which every engine's field holds (negated too)
        priority=_int(body, "priority", -MAX_PRIORITY, MAX_PRIORITY) or 0,
        priority_given=body.get("priority") is not None,
        response_format=response_format,
        needs=needs,
    )
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise invalid("'tools' must be an array", "tools")
        check_tools(tools)
        req.tools = tools
    req.tool_choice = _tool_choice(body, req.tools)
    if req.tools and req.tool_choice != "none":  # with "none" the tools only inform the prompt
        needs[Feature.TOOLS] = "tools"
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise invalid("'messages' must be a non-empty array", "messages")
        check_messages(messages, max_messages, max_content_parts)
        check_tool_messages(messages)
        req.messages = messages
        image = _image_params(messages)
        if image is not None:
            needs[Feature.IMAGES] = image
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            req.prompt = prompt
        elif (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            if any(not 0 <= t < 2**32 for t in prompt):
                raise invalid("token ids in 'prompt' must be between 0 and 2^32-1", "prompt")
            req.prompt_token_ids = list(prompt)
        elif isinstance(prompt, list) and len(prompt) > 1:
            raise invalid("batched prompts are not supported; send one prompt per request", "prompt")
        else:
            raise invalid("'prompt' must be a string or an array of token ids", "prompt")
    return req
