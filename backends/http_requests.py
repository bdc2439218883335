"""The HTTP face's requests, as the node takes them: the prompt's tokens and block hashes
(``Renderer``), the sampling of an OpenAI body or of SGLang's ``/generate``, each choice's
sampling, and which leg of a PD pair a body asks for (``pd_request``). Pure but for the shipped
tokenizer, loaded once."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from prefixgate.backends.engine import Constraint, Engine, Sampling
from prefixgate.backends.hftok import TOKENIZER_DIR
from prefixgate.backends.pd import Room
from prefixgate.cachetier.hashing import Namespace, block_hashes
from prefixgate.cachetier.tokenizer import pack_ids
from prefixgate.gateway.core.errors import invalid
from prefixgate.gateway.tokens import EngineTokenizer, open_tokenizer_dir
from prefixgate.openai.normalize import NormalizationError, render_completion
from prefixgate.openai.schema import MAX_N, MAX_SEED, ParsedRequest, choice_seed

DEFAULT_MODEL = "prefixgate-sim"


@dataclass(frozen=True, slots=True)
class HTTPOptions:
    model: str = DEFAULT_MODEL
    normalize: bool = False  # render as the gateway does with normalization on
    max_body_bytes: int = 16 * 1024 * 1024
    default_max_tokens: int = 256
    max_tokens_limit: int = 8_192
    max_documents: int = 256


@dataclass(frozen=True, slots=True)
class Prompt:
    tokens: bytes  # packed LE uint32
    hashes: list[int]

    @property
    def count(self) -> int:
        return len(self.tokens) // 4


@lru_cache(maxsize=1)
def shipped_tokenizer() -> EngineTokenizer:
    """The tokenizer and chat template every node ships (one per process: the segment cache is shared)."""
    return open_tokenizer_dir(TOKENIZER_DIR)


class Renderer:
    """Request bodies -> prompt tokens and block hashes: the shipped tokenizer and its chat template."""

    def __init__(self, model: str, block_size: int, normalize: bool) -> None:
        self.tokenizer = shipped_tokenizer()
        self.block_size = block_size
        self.normalize = normalize
        self.root = Namespace(model, "", block_size, self.tokenizer.name).root()

    def tokens(self, req: ParsedRequest) -> bytes:
        if req.document_ids:
            raise invalid(
                "document_ids are resolved by the gateway; send 'documents' to a node", "document_ids"
            )
        try:
            if req.kind == "chat":
                _layout, tokens = self.tokenizer.encode_chat(
                    req.messages, documents=req.documents, tools=req.tools, normalize=self.normalize
                )
                return tokens
            if req.prompt_token_ids is not None:
                return pack_ids(req.prompt_token_ids)
            layout = render_completion(req.prompt or "", documents=req.documents, normalize=self.normalize)
        except NormalizationError as e:
            raise invalid(str(e), e.param) from None
        return self.tokenizer.encode(layout.text)

    def text_tokens(self, text: str) -> bytes:
        return self.tokenizer.encode(render_completion(text, normalize=self.normalize).text)

    def prompt(self, tokens: bytes) -> Prompt:
        if not tokens:
            raise invalid("the prompt is empty", "prompt")
        return Prompt(tokens, block_hashes(tokens, self.block_size, self.root))


def sampling_of(req: ParsedRequest, engine: Engine) -> Sampling:
    """The node's sampling for ``req``: log probabilities on an engine that has them, and
    ``response_format`` as the engine's constraint where the engine can follow one (a 400 naming
    the field otherwise, or when its schema does not compile, as OpenAI-compatible servers answer)."""
    s = req.sampling
    if s.logprobs and "logprobs" not in engine.features:
        raise invalid("log probabilities are not supported by this node's engine", "logprobs")
    sampling = Sampling.normalized(
        s.max_tokens, s.temperature, s.top_p, s.seed, s.stop, logprobs=s.logprobs, top_logprobs=s.top_logprobs
    )
    if s.constraint is None:
        return sampling
    if "response_format" not in engine.features:
        raise invalid(f"'response_format' is not supported by the {engine.name} engine", "response_format")
    constraint = Constraint(s.constraint.kind, s.constraint.text)
    from prefixgate.backends import grammar  # llguidance and numpy: a fifth of a node's start

    try:
        grammar.check(constraint)
    except grammar.ConstraintFailed as e:
        raise invalid(e.message, "response_format") from None
    return replace(sampling, constraint=constraint)


def choice_sampling(sampling: Sampling, index: int) -> Sampling:
    """Choice ``index`` of a request's ``n``: its own sampling stream (choice 0 is the request as
    sent). Seeded: the seed the gateway gives choice ``index`` when it runs ``n`` as ``n``
    requests (``schema.choice_seed``), so choice ``i`` is reproducible and the same either way;
    unseeded: the engine mixes ``index`` into the seed it draws from the prompt."""
    if index == 0:
        return sampling
    if sampling.seed is not None:
        return replace(sampling, seed=choice_seed(sampling.seed, index) & MAX_SEED)
    return replace(sampling, choice=index)


def sglang_sampling(body: Mapping[str, Any]) -> Sampling:
    """``sampling_params`` of SGLang's ``/generate``."""
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, Mapping):
        raise invalid("'sampling_params' must be an object", "sampling_params")
    try:
        max_new = int(sp.get("max_new_tokens", 128))
        temperature = float(sp.get("temperature", 1.0))
        top_p = float(sp.get("top_p", 1.0))
    except (TypeError, ValueError):
        raise invalid("sampling_params: numbers expected", "sampling_params") from None
    stop = sp.get("stop") or []
    stop = [stop] if isinstance(stop, str) else [s for s in stop if isinstance(s, str)]
    seed = sp.get("sampling_seed")
    return Sampling.normalized(
        max(1, max_new), temperature, top_p, seed if isinstance(seed, int) else None, stop
    )


# -- PD requests ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PDRequest:
    leg: str  # "prefill" | "decode" | "sglang" (the node's role decides)
    rooms: tuple[Room, ...] = ()  # one, or one per choice (SGLang's lists)

    @property
    def room(self) -> Room | None:
        return self.rooms[0] if self.rooms else None

    def rooms_for(self, n: int) -> list[Room]:
        """The room of each of ``n`` choices: the lists' entries when there is one per choice
        (sglang-router sends lists of ``n`` for a chat with ``n``), else, as SGLang's engines
        expand one room, ``bootstrap_room + i`` for choice ``i``."""
        if len(self.rooms) == n:
            return list(self.rooms)
        if len(self.rooms) == 1:
            r = self.rooms[0]
            return [replace(r, room=r.room + i) for i in range(n)]
        raise invalid(
            f"'bootstrap_room' has {len(self.rooms)} rooms for {n} choices: give one, or one per choice",
            "bootstrap_room",
        )


def _int(v: Any, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int | str):
        raise invalid(f"'{name}' must be an integer", name)
    try:
        return int(v)
    except ValueError:
        raise invalid(f"'{name}' must be an integer", name) from None


def _each(v: Any, name: str, count: int) -> list[Any]:
    """SGLang's bootstrap field ``v`` as ``count`` values: a list of them, or one for all."""
    if not isinstance(v, list):
        return [v] * count
    if len(v) == 1:
        return v * count
    if len(v) != count:
        raise invalid(f"'{name}' has {len(v)} entries, 'bootstrap_room' {count}", name)
    return v


def _sglang_rooms(body: Mapping[str, Any]) -> tuple[Room, ...]:
    """SGLang's ``bootstrap_host/port/room``: one each, or lists of one per choice."""
    raw = body["bootstrap_room"]
    rooms = [_int(r, "bootstrap_room") for r in (raw if isinstance(raw, list) else [raw])]
    if not rooms or len(rooms) > MAX_N:
        raise invalid(f"'bootstrap_room' must hold 1 to {MAX_N} rooms", "bootstrap_room")
    out = []
    hosts = _each(body.get("bootstrap_host"), "bootstrap_host", len(rooms))
    ports = _each(body.get("bootstrap_port"), "bootstrap_port", len(rooms))
    for host, port, room in zip(hosts, ports, rooms, strict=True):
        if not isinstance(host, str) or not host:
            raise invalid("'bootstrap_host' is required with 'bootstrap_room'", "bootstrap_host")
        out.append(Room(host.strip("[]"), 0 if port is None else _int(port, "bootstrap_port"), room))
    return tuple(out)


def pd_request(body: Mapping[str, Any]) -> PDRequest | None:
    """The PD part of a request body (None: a whole request)."""
    if body.get("bootstrap_room") is not None:
        return PDRequest("sglang", _sglang_rooms(body))
    params = body.get("kv_transfer_params")
    if params is None:
        return None
    if not isinstance(params, Mapping):
        raise invalid("'kv_transfer_params' must be an object", "kv_transfer_params")
    if params.get("do_remote_decode"):
        return PDRequest("prefill")
    if params.get("do_remote_prefill"):
        host = params.get("remote_host")
        if not isinstance(host, str) or not host:
            raise invalid("kv_transfer_params.remote_host is required", "kv_transfer_params")
        port = _int(params.get("remote_port"), "kv_transfer_params.remote_port")
        room = _int(params.get("bootstrap_room"), "kv_transfer_params.bootstrap_room")
        return PDRequest("decode", (Room(host.strip("[]"), port, room),))
    return None
