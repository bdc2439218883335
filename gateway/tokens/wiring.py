"""The gateway's tokenizer from its settings.

``tokenizer`` is unset (auto, the default), ``engine``, ``engine:DIR`` or ``bytes4``
(``hf:DIR/tokenizer.json`` was turned into ``engine:DIR`` by ``config``). ``engine`` means the
model's own tokenizer and chat template: from ``tokenizer_path`` (``--tokenizer-path``, TOML,
``PREFIXGATE_TOKENIZER_PATH``) when set, else from the workers when the gateway starts (their
``tokenizer_path`` or ``GetTokenizer``, see ``loader``). Setting ``tokenizer_path`` alone selects
``engine`` too. Unset means ``engine`` when a ``grpc://`` worker is configured (it takes the
model's token ids, so nothing else can feed it), else ``bytes4``: our own nodes hash any ids, and
OpenAI-compatible HTTP workers tokenize themselves (the gateway's tokens only place prefixes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import structlog

from prefixgate.cachetier.tokenizer import Tokenizer, load_tokenizer
from prefixgate.gateway.cluster.workers import id_workers
from prefixgate.gateway.config import Settings
from prefixgate.gateway.tokenpool.pool import TokenizerPool
from prefixgate.gateway.tokens.engine import EngineTokenizer, TokenizerLoadError
from prefixgate.gateway.tokens.loader import (
    load_engine_tokenizer,
    open_tokenizer_dir,
    wait_engine_tokenizer,
    worker_tokenizers,
)

log = structlog.get_logger("prefixgate.tokens")


def engine_path(settings: Settings) -> str | None:
    """The local directory to load, "" when the workers must give it, None when not ``engine``."""
    spec = settings.tokenizer
    if spec.startswith("engine:"):
        return spec[len("engine:") :]
    if spec == "engine" or settings.tokenizer_path:
        return settings.tokenizer_path
    if spec == "" and id_workers(settings):
        return ""
    return None


def gateway_tokenizer(settings: Settings) -> Tokenizer:
    """The tokenizer to start with: the engine's when it is local, else the ``tokenizer`` spec
    (for ``engine`` from the workers, ``bytes4`` until ``worker_tokenizer`` replaces it)."""
    path = engine_path(settings)
    if path:
        return open_tokenizer_dir(path, segment_cache_bytes=settings.tokenizer_segment_cache_bytes)
    if path is None:
        return load_tokenizer(settings.tokenizer or "bytes4")
    return load_tokenizer("bytes4")


def model_tokenizers(settings: Settings) -> dict[str, Tokenizer]:
    """The tokenizers of models whose workers do not take the default one (``model_tokenizers``)."""
    out: dict[str, Tokenizer] = {}
    for entry in settings.model_tokenizers:
        model, _, directory = entry.partition("=")
        out[model] = open_tokenizer_dir(directory, segment_cache_bytes=settings.tokenizer_segment_cache_bytes)
    return out


def worker_addresses(settings: Settings) -> list[str]:
    """Workers that may speak the SMG protocol (not the HTTP ones), in the order configured."""
    out: list[str] = []
    extra = getattr(settings, "worker_urls", None) or []  # smg-style worker flags, where present
    for a in [*settings.prefill, *settings.decode, *settings.monolithic, *extra]:
        if a and not a.startswith(("http://", "https://")) and a not in out:
            out.append(a)
    return out


async def resolve_tokenizer(settings: Settings) -> Settings:
    """Settings in which the engine tokenizer the workers must give is a local directory, fetched
    before the gateway serves (``wait_engine_tokenizer``: the workers' ``tokenizer_path`` or
    ``GetTokenizer`` bundle, waiting ``tokenizer_timeout_s`` for workers not up yet). Raises
    ``TokenizerLoadError`` saying what to pass when no worker gives one."""
    if engine_path(settings) != "":
        return settings
    try:
        tok = await wait_engine_tokenizer(
            worker_addresses(settings),
            wait_s=settings.tokenizer_timeout_s,
            cache_dir=settings.tokenizer_cache_dir or None,
            timeout_s=settings.tokenizer_timeout_s,
            segment_cache_bytes=settings.tokenizer_segment_cache_bytes,
            local_paths=settings.tokenizer_worker_paths,
        )
    except TokenizerLoadError as e:
        raise TokenizerLoadError(
            f"{e}; pass --tokenizer-path DIR (the model's tokenizer.json and tokenizer_config.json)"
        ) from None
    others = await worker_tokenizers(
        worker_addresses(settings),
        cache_dir=settings.tokenizer_cache_dir or None,
        timeout_s=min(settings.tokenizer_timeout_s, 10.0),
        local_paths=settings.tokenizer_worker_paths,
    )
    per_model: dict[str, EngineTokenizer] = {}
    for t in (tok, *others):
        known = per_model.setdefault(t.served_model, t)
        if known.identity != t.identity:  # one model's workers must take the same prompts
            raise TokenizerLoadError(
                f"workers of model {t.served_model!r} use different tokenizers ({known.origin}: "
                f"{known.name}; {t.origin}: {t.name}); pass --tokenizer-path DIR if they take the same ids"
            )
    extra = [f"{m}={t.directory}" for m, t in per_model.items() if m and t.identity != tok.identity]
    for m, t in per_model.items():
        log.info("tokenizer_loaded", model=m, tokenizer=t.name, origin=t.origin, **t.encoder_facts)
    return dataclasses.replace(
        settings, tokenizer="engine", tokenizer_path=str(tok.directory), model_tokenizers=extra
    )


async def worker_tokenizer(settings: Settings) -> EngineTokenizer | None:
    """The engine tokenizer from the workers, when ``engine`` is asked for without a path."""
    if engine_path(settings) != "":
        return None
    return await load_engine_tokenizer(
        workers=worker_addresses(settings),
        cache_dir=settings.tokenizer_cache_dir or None,
        timeout_s=settings.tokenizer_timeout_s,
        segment_cache_bytes=settings.tokenizer_segment_cache_bytes,
        local_paths=settings.tokenizer_worker_paths,
    )


def tokenizer_pools(settings: Settings, tokenizers: Iterable[Tokenizer]) -> list[TokenizerPool]:
    """``tokenizer_processes`` tokenizer processes for each engine tokenizer among
    ``tokenizers``, given to it for its long uncached texts (``gateway.tokenpool``); the caller
    closes them. None at 0, nor for tokenizers that are not an engine's."""
    pools: list[TokenizerPool] = []
    if settings.tokenizer_processes <= 0:
        return pools
    for tok in dict.fromkeys(tokenizers):  # one model's tokenizer may serve several names
        if isinstance(tok, EngineTokenizer):
            pool = TokenizerPool(
                tok.directory, tok.sha256, settings.tokenizer_processes, fast=tok.fast is not None
            )
            tok.segments.remote = pool
            pools.append(pool)
    return pools
