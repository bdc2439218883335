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


@dataclass(frozen=True, slots=True)
class _Entry:
    """An engine block as the gateway sees it: the last full gateway block at or before its end
    (``last``; the namespace root when none yet), the tokens after that (``tail``), the gateway
    blocks its tokens completed (``made``) and the root of its namespace."""

    last: int
    tail: bytes
    made: tuple[int, ...]
    root: int


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
        """A ``KvBlocksStored``: its blocks form a chain after ``parent_block_hash``."""
        m: object = msg
        tier = getattr(m, "tier", 0) if m.HasField("tier") else 0  # type: ignore[attr-defined]
        loc = getattr(m, "locality", 0) if m.HasField("locality") else 0  # type: ignore[attr-defined]
        kind = m.kv_cache_spec_kind if m.HasField("kv_cache_spec_kind") else ""  # type: ignore[attr-defined]
        blocks = list(m.blocks)  # type: ignore[attr-defined]
        if tier not in _DEVICE_TIERS or loc not in _LOCAL or kind not in _MAIN_ATTENTION:
            self.skipped += len(blocks)
            return []
        lora = m.lora_name if m.HasField("lora_name") else ""  # type: ignore[attr-defined]
        salt = m.cache_salt if m.HasField("cache_salt") else ""  # type: ignore[attr-defined]
        if m.HasField("parent_block_hash"):  # type: ignore[attr-defined]
            parent = self._blocks.get(m.parent_block_hash)  # type: ignore[attr-defined]
            if parent is None:  # its prefix is unknown: its blocks cannot be named
                self.skipped += len(blocks)
                return []
            state = parent
        else:
            root = self._root_of(lora, salt)
            if root is None:
                self.skipped += len(blocks)
                return []
            state = _Entry(root, b"", (), root)
        first_parent = state.last
        made: list[int] = []
        for b in blocks:
            ids = list(b.token_ids)
            if b.block_size and len(ids) != b.block_size:  # a partial page is not cached
                self.skipped += 1
                break
            tail = state.tail + pack_ids(ids)
            full = len(tail) // (4 * self.block_size)
            new = tuple(block_hashes(tail, self.block_size, state.last)) if full else ()
            rest = tail[full * 4 * self.block_size :]
            state = _Entry(new[-1] if new else state.last, rest, new, state.root)
            if len(self._blocks) >= MAX_TRACKED_BLOCKS and b.block_hash not in self._blocks:
                raise Overflow
            self._blocks[b.block_hash] = state
            made.extend(new)
        if not made:
            return []
        return [Change(EventKind.STORED, 0 if first_parent == state.root else first_parent, tuple(made))]

    def removed(self, engine_hashes: Iterable[int]) -> list[Change]:
        gone: list[int] = []
        for h in engine_hashes:
            e = self._blocks.pop(h, None)
            if e is not None:
                gone.extend(e.made)
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
