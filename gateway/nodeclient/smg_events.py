"""SMG ``SubscribeKvEvents`` batches -> the gateway's KV events, in the gateway's block hashes.

Engine block hashes are engine-specific (SGLang: a SHA-256 page chain; vLLM: a CBOR chain; ours:
xxh3 in another namespace), so they are never index keys here, only handles for ``removed`` and
``parent_block_hash``. Each stored block's token ids are hashed again with the gateway's own
chain (``cachetier.hashing``: the function prompts are hashed with, from the namespace root the
prompt would have), so an engine event and a prompt name the same block with the same id.

The engine's page size need not be the gateway's block size: tokens of a chain are carried over
from block to block until they fill gateway blocks (a 16-token engine page and a 64-token
gateway block: every fourth page completes one gateway block).

Events are read in columns (``gateway.tokenpool.kvcolumns``: a stored event's handles, sizes and
token ids as byte strings), made by a tokenizer child for a long prompt's batch and in the
gateway for the others. Pure: no I/O.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterable
from itertools import chain, repeat

from prefixgate.cachetier.hashing import block_hashes
from prefixgate.gateway.records import record
from prefixgate.gateway.tokenpool import kvcolumns
from prefixgate.gateway.vocab import EventKind

MAX_TRACKED_BLOCKS = 1 << 20  # engine blocks remembered per subscription (beyond: resubscribe)
_DEVICE_TIERS = (0, 1)  # unspecified (absent) or DEVICE
_LOCAL = (0, 1)  # unspecified or LOCAL
_MAIN_ATTENTION = ("", "full_attention", "mla_attention", "sink_full_attention")


@record
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
_COMPLETED = operator.itemgetter(2)


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
        """A ``KvBlocksStored`` message (``stored_columns`` of its columns)."""
        return self.stored_columns(kvcolumns.of_stored(msg))

    def stored_columns(self, ev: kvcolumns.Stored) -> list[Change]:
        """A ``KvBlocksStored``: its blocks form a chain after ``parent``.

        The chain's tokens are one byte string already (``kvcolumns``), hashed in one go (one
        ``block_hashes`` over all of them), then each engine block gets its entry: walking the
        blocks' messages one by one cost milliseconds a long prompt."""
        count = ev.blocks
        if ev.tier not in _DEVICE_TIERS or ev.locality not in _LOCAL or ev.spec_kind not in _MAIN_ATTENTION:
            self.skipped += count
            return []
        if ev.parent is not None:
            parent = self._blocks.get(ev.parent)
            if parent is None:  # its prefix is unknown: its blocks cannot be named
                self.skipped += count
                return []
            last, tail, _made, root = parent
        else:
            found = self._root_of(ev.lora, ev.salt)
            if found is None:
                self.skipped += count
                return []
            last, tail, root = found, b"", found
        sizes, declared, handles = ev.sizes, ev.declared, ev.handles
        if sizes != declared:  # a partial page is not cached: the chain ends before it
            for i, (n, size) in enumerate(zip(sizes, declared, strict=True)):
                if size and n != size:
                    self.skipped += 1
                    sizes, handles = sizes[:i], handles[:i]
                    break
        start = len(tail) // 4
        ends = list(itertools.accumulate(sizes, initial=start))[1:]  # each block's end, in tokens
        tokens = tail + ev.tokens[: (ends[-1] - start) * 4] if ends else tail
        bs = self.block_size
        made = block_hashes(tokens, bs, last)
        entries = self._blocks
        grows = len(entries) + len(handles) > MAX_TRACKED_BLOCKS
        if grows and len(entries.keys() | handles) > MAX_TRACKED_BLOCKS:
            raise Overflow
        done = 0  # gateway blocks completed by the engine blocks so far
        for handle, end in zip(handles, ends, strict=True):
            full = end // bs
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
        """The gateway blocks the removed engine blocks had completed (in C: a long prompt's
        2,000 removals in a Python loop took half a millisecond of the event loop)."""
        entries = filter(None, map(self._blocks.pop, engine_hashes, repeat(None)))
        gone = tuple(chain.from_iterable(map(_COMPLETED, entries)))
        return [Change(EventKind.REMOVED, 0, gone)] if gone else []

    def batch(self, events: Iterable[object]) -> list[Change]:
        """Every change one ``KvEventBatch`` 's events make, in order."""
        return self.apply(kvcolumns.of_events(events))

    def apply(self, events: Iterable[kvcolumns.Event]) -> list[Change]:
        """Every change a batch's events in columns make, in order."""
        out: list[Change] = []
        for ev in events:
            if isinstance(ev, kvcolumns.Stored):
                out += self.stored_columns(ev)
            elif isinstance(ev, kvcolumns.Removed):
                if ev.tier in _DEVICE_TIERS:  # a host copy going is not
                    out += self.removed(ev.handles)
            else:
                out.append(self.clear())
        return out


class BatchCursor:
    """One subscription's place in the engine's batches, per data-parallel rank (each numbers
    its own from 0), and the rehasher its new batches go through. Pure: run on the event loop
    for a short batch, on a worker thread for a long one, one batch at a time."""

    def __init__(self, rehash: ChainRehasher) -> None:
        self.rehash = rehash
        self._cursors: dict[int, int] = {}
        self.gap = ""  # why the subscription must start again (a batch was missed), once one was
        self.fresh = False  # the last batch taken was a new one

    def take(self, batch: kvcolumns.Batch) -> list[Change]:
        """The changes a batch makes: none for a load record or a batch seen before; none and
        ``gap`` set when one before it is missing. ``Overflow`` from the rehasher."""
        self.fresh = False
        if batch.load_only:  # the cursor stays
            return []
        n, rank = batch.sequence, batch.rank
        cursor = self._cursors.get(rank, -1)
        if n <= cursor:
            return []
        if n != cursor + 1:
            self.gap = f"gap on rank {rank}: {cursor} then {n}"
            return []
        self._cursors[rank] = n
        self.fresh = True
        return self.rehash.apply(batch.events)
