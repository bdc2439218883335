"""SMG ``SubscribeKvEvents`` batches -> the gateway's KV events, in the gateway's block hashes.

Engine block hashes are engine-specific (SGLang: a SHA-256 page chain; vLLM: a CBOR chain; ours:
xxh3 in another namespace), so they are never index keys here, only handles for ``removed`` and
``parent_block_hash``. Each stored block's token ids are hashed again with the gateway's own
chain (``cachetier.hashing``: the function prompts are hashed with, from the namespace root the
prompt would have), so an engine event and a prompt name the same block with the same id.

The engine's page size need not be the gateway's block size: tokens of a chain are carried over
from block to block until they fill gateway blocks (a 16-token engine page and a 64-token
gateway block: every fourth page completes one gateway block). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prefixgate.cachetier.hashing import block_hashes
from prefixgate.cachetier.tokenizer import pack_ids
from prefixgate.gateway.vocab import EventKind

MAX_TRACKED_BLOCKS = 1 << 20  # engine blocks remembered per subscription (beyond: resubscribe)
_DEVICE_TIERS = (0, 1)  # unspecified (absent) or DEVICE
_LOCAL = (0, 1)  # unspecified or LOCAL
_MAIN_ATTENTION = ("", "full_attention", "mla_attention", "sink_full_attention")


@dataclass(frozen=True, slots=True)
class Change:
    """One change to the gateway's view of the node (``parent`` 0: a chain from the root)."""

    kind: EventKind
    parent: int = 0
    hashes: tuple[int, ...] = ()


# An engine block as the gateway sees it: the last full gateway block at or before its end (the
# namespace root when none yet), the tokens after that (packed), the gateway blocks its tokens
# completed, and the root of its namespace. A tuple: engines with small pages (SGLang's default is
# one token) store hundreds of these a request, and a tuple is made several times faster than a
# dataclass instance.
_Entry = tuple[int, bytes, tuple[int, ...], int]
_NONE: tuple[int, ...] = ()


class Overflow(Exception):
    """More engine blocks than this translator keeps track of: clear and resubscribe."""


class ChainRehasher:
    """Turns one subscription's engine events into ``Change`` s.

    ``root_of(cache_salt)`` is the namespace root a prompt of that salt is hashed from (None: no
    prompt of the gateway lives in that namespace, e.g. a LoRA adapter's; such blocks are skipped).
    """

    def __init__(self, block_size: int, root_of: Callable[[str, str], int | None]) -> None:
        self.block_size = block_size
        self._root_of = root_of
        self._blocks: dict[int, _Entry] = {}
        self.skipped = 0  # blocks that could not be placed (unknown parent, other tier, ...)

    def __len__(self) -> int:
        return len(self._blocks)

    def clear(self) -> Change:
        self._blocks.clear()
        return Change(EventKind.CLEARED)

    def stored(self, msg: object) -> list[Change]:
        """A ``KvBlocksStored``: its blocks form a chain after ``parent_block_hash``.

        The chain's tokens are packed and hashed in one go (one ``block_hashes`` over all of
        them), then each engine block gets its entry: hashing block by block cost tens of
        microseconds a request with 64-token pages and milliseconds with one-token pages."""
        m: Any = msg
        tier = m.tier if m.HasField("tier") else 0
        loc = m.locality if m.HasField("locality") else 0
        kind = m.kv_cache_spec_kind if m.HasField("kv_cache_spec_kind") else ""
        blocks = m.blocks
        if tier not in _DEVICE_TIERS or loc not in _LOCAL or kind not in _MAIN_ATTENTION:
            self.skipped += len(blocks)
            return []
        if m.HasField("parent_block_hash"):
            parent = self._blocks.get(m.parent_block_hash)
            if parent is None:  # its prefix is unknown: its blocks cannot be named
                self.skipped += len(blocks)
                return []
            last, tail, _made, root = parent
        else:
            lora = m.lora_name if m.HasField("lora_name") else ""
            salt = m.cache_salt if m.HasField("cache_salt") else ""
            found = self._root_of(lora, salt)
            if found is None:
                self.skipped += len(blocks)
                return []
            last, tail, root = found, b"", found
        chain: list[int] = []  # the blocks' token ids (a slice of a repeated field is the fastest copy)
        ends: list[int] = []  # each engine block's end, in tokens from the start of ``tail``
        handles: list[int] = []
        end = len(tail) // 4
        for b in blocks:
            ids = b.token_ids
            n = len(ids)
            if b.block_size and n != b.block_size:  # a partial page is not cached
                self.skipped += 1
                break
            chain += ids[:]
            end += n
            ends.append(end)
            handles.append(b.block_hash)
        tokens = tail + pack_ids(chain)
        bs = self.block_size
        made = block_hashes(tokens, bs, last)
        entries = self._blocks
        done = 0  # gateway blocks completed by the engine blocks so far
        for handle, end in zip(handles, ends, strict=True):
            full = end // bs
            if len(entries) >= MAX_TRACKED_BLOCKS and handle not in entries:
                raise Overflow
            entries[handle] = (
                made[full - 1] if full else last,
                tokens[full * bs * 4 : end * 4],
                tuple(made[done:full]) if full > done else _NONE,
                root,
            )
            done = full
        if not made:
            return []
        return [Change(EventKind.STORED, 0 if last == root else last, tuple(made))]

    def removed(self, engine_hashes: Iterable[int]) -> list[Change]:
        gone: list[int] = []
        for h in engine_hashes:
            e = self._blocks.pop(h, None)
            if e is not None:
                gone.extend(e[2])
        return [Change(EventKind.REMOVED, 0, tuple(gone))] if gone else []

    def batch(self, events: Iterable[object]) -> list[Change]:
        """Every change one ``KvEventBatch`` 's events make, in order."""
        out: list[Change] = []
        for ev in events:
            which = ev.WhichOneof("data")  # type: ignore[attr-defined]
            if which == "stored":
                out += self.stored(ev.stored)  # type: ignore[attr-defined]
            elif which == "removed":
                r = ev.removed  # type: ignore[attr-defined]
                if (r.tier if r.HasField("tier") else 0) in _DEVICE_TIERS:  # a host copy going is not
                    out += self.removed(r.block_hashes)
            elif which == "cleared":
                out.append(self.clear())
        return out
