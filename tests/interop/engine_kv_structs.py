"""The engines' KV event wire types, declared as they publish them, for encoding test batches.

Only the msgspec struct layout (names, field order, options) matters on the wire; these mirror:

- vLLM (main, 2026), ``vllm/distributed/kv_events.py`` at
  https://github.com/vllm-project/vllm/tree/0181ea3173e53eea8cf04a86891488e3dc89bb34 :
  plain structs (tagged maps ``{"type": "BlockStored", ...}``, map envelope ``{ts, events,
  data_parallel_rank}``), block hashes ``int | bytes``.
- SGLang (before 0.5.23), ``python/sglang/srt/disaggregation/kv_events.py`` at
  https://github.com/sgl-project/sglang/tree/006d053f182f9b488d2bd841afa06d5f9120a258 :
  ``array_like=True`` structs (``["BlockStored", hashes, parent,
  token_ids, block_size, lora_id]`` inside ``[ts, events]``).

SGLang 0.5.23 (tagged-map events in an array envelope) is exercised with its own module, loaded
from its wheel, in ``test_zmq_kv_events.py``.
"""

from __future__ import annotations

from typing import Any

import msgspec


class VllmEventBatch(msgspec.Struct, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VllmKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    pass


class VllmBlockStored(VllmKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VllmBlockRemoved(VllmKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class VllmAllBlocksCleared(VllmKVCacheEvent, tag="AllBlocksCleared"):
    pass


class SglangEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]


class SglangKVCacheEvent(
    msgspec.Struct,
    array_like=True,  # type: ignore[call-arg]
    omit_defaults=True,  # type: ignore[call-arg]
    gc=False,  # type: ignore[call-arg]
    tag=True,
):
    pass


class SglangBlockStored(SglangKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class SglangBlockRemoved(SglangKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]


class SglangAllBlocksCleared(SglangKVCacheEvent, tag="AllBlocksCleared"):
    pass
