"""A node: engine + block pool + queues + KV handles + event log; every rpc minus the wire.

Any role serves every operation (a decode node can run a whole request, a prefill node can
receive pages); the role is a label the gateway routes by. Every resource a request takes (a
queue slot, pool references, a reservation, a decode slot, a KV handle) is given back in a
``finally``, so a cancelled call leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace

import structlog

from prefixgate.backends.admission import Admission, QueueFull, Ticket
from prefixgate.backends.engine import (
    MAX_GROUP,
    DecodeJob,
    Engine,
    PrefillJob,
    PrefillOutput,
    Sampling,
    TokenLogprob,
    Tokens,
)
from prefixgate.backends.errors import (
    AlreadyExists,
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from prefixgate.backends.events import DEFAULT_EVENT_BUFFER, EventLog
from prefixgate.backends.generation import Chunk, Generation
from prefixgate.backends.kvpages import KVFormat, Page, checksum, format_mismatch
from prefixgate.backends.pool import BlockPool, PoolExhausted
from prefixgate.backends.profiles import MAX_RATE, CostProfile
from prefixgate.backends.transfer import KVSender, TransferAck, TransferHeader, WirePage
from prefixgate.cachetier.tokenizer import unpack_ids
from prefixgate.gateway.vocab import Role

log = structlog.get_logger("prefixgate.node")

ROLES = tuple(r.value for r in Role)
DEFAULT_CAPACITY_BLOCKS = 4096
# Tokens a prefill computes before a waiting prefill gets a turn (SGLang's --chunked-prefill-size,
# at its value for large GPUs); 0 turns chunking off.
DEFAULT_CHUNKED_PREFILL = 8192
# How waiting prefills are ordered, as vLLM's --scheduling-policy: ``priority`` (lower first,
# equal ones in arrival order) or ``fcfs`` (arrival order). vLLM defaults to fcfs; our node to
# priority: it is only reached through the gateway, which sends 0 unless a request was given
# another, so with every priority equal the order is fcfs's.
DEFAULT_SCHEDULING_POLICY = "priority"
DEFAULT_LOOPBACK_BYTES_PER_S = 1e9  # first guess of the transfer rate before any is measured
RATE_EWMA = 0.2
RATE_MIN_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class NodeConfig:
    role: str = "monolithic"
    node_id: str = ""
    capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS
    max_queue: int = 64  # prefills waiting for a slot
    max_concurrency: int = 1  # prefills computing at once
    max_decode_streams: int = 256  # Decode + Generate streams at once
    handle_ttl_s: float = 60.0  # a received KV handle never decoded is dropped after this
    max_handles: int = 1024  # pending handles; the oldest is dropped beyond this
    event_buffer: int = DEFAULT_EVENT_BUFFER
    transfer_timeout_s: float = 60.0
    chunked_prefill_size: int = DEFAULT_CHUNKED_PREFILL  # 0: a prefill keeps its slot to the end
    # The longest prompt served, in tokens; 0: the whole pool's (``capacity_blocks`` full blocks).
    context_length: int = 0
    scheduling_policy: str = DEFAULT_SCHEDULING_POLICY  # the order of waiting prefills
    stream_interval: int = MAX_GROUP  # tokens a streamed chunk holds at most


@dataclass(frozen=True, slots=True)
class PrefillCall:
    request_id: str
    tokens: bytes
    block_hashes: Sequence[int]
    sampling: Sampling
    decode_address: str = ""
    pin_seconds: float = 0.0
    skip_first_token: bool = False
    timeout: float | None = None  # what is left of the caller's deadline
    resumed: int = 0  # the last ``resumed`` of ``tokens`` are output already shown (``resumed_generation``)
    priority: int = 0  # among waiting prefills, lower first (``scheduling_policy`` priority)


@dataclass(frozen=True, slots=True)
class PrefillResult:
    request_id: str
    prompt_tokens: int
    cached_tokens: int
    first_token: int
    first_text: str
    kv_handle: str
    queue_seconds: float
    prefill_seconds: float
    transfer_seconds: float
    transfer_bytes: int
    state: int
    finished: bool
    finish_reason: str
    first_logprob: TokenLogprob | None = None  # when asked, and the first token is shown


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    node_id: str
    role: str
    engine: str
    kv_format: KVFormat
    capacity_blocks: int
    used_blocks: int  # held, cached ones included
    pinned_blocks: int
    queued_requests: int
    queued_tokens: int
    running_requests: int
    max_queue: int
    max_concurrency: int
    profile: CostProfile  # wall-clock figures (already multiplied by time_scale)
    time_scale: float
    kv_event_seq: int
    instance_id: str
    prefix_hit_tokens: int
    prompt_tokens: int
    pending_handles: int
    features: frozenset[str] = frozenset()  # the engine's (``Engine.features``)
    evictable_blocks: int = 0  # of ``used_blocks``: cached, unreferenced, unpinned (reclaimable)
    reserved_blocks: int = 0  # room taken by running prefills for blocks they are computing
    max_context_tokens: int = 0  # the longest prompt served (``Node.context_tokens``)

    @property
    def in_use_blocks(self) -> int:
        """Blocks no new request may reclaim: ``capacity - (free + evictable)``, SGLang's used."""
        return max(0, self.used_blocks + self.reserved_blocks - self.evictable_blocks)


@dataclass(slots=True)
class KVHandle:
    kv_handle: str
    request_id: str
    tokens: bytes
    hashes: tuple[int, ...]  # referenced in the pool until decoded or expired
    tail: bytes
    first_token: int
    state: int
    sampling: Sampling
    cached_tokens: int  # what the prefill node reused (reported in Decode's usage)
    expires_at: float


@dataclass(frozen=True, slots=True)
class _Run:
    """A finished prefill whose request still references its whole chain."""

    hashes: Sequence[int]
    cached_blocks: int
    output: PrefillOutput
    queue_s: float
    prefill_s: float


class Node:
    def __init__(self, engine: Engine, config: NodeConfig, sender: KVSender | None = None) -> None:
        if config.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {config.role!r}")
        self.engine = engine
        self.config = config
        self.node_id = config.node_id
        self.sender = sender
        self.block_size = engine.kv_format.block_size
        self.events = EventLog(self._pool_snapshot, buffer=config.event_buffer)
        self.pool: BlockPool[Page] = BlockPool(config.capacity_blocks, listener=self.events)
        self.prefills = Admission(config.max_concurrency, config.max_queue, policy=config.scheduling_policy)
        self.streams = Admission(config.max_decode_streams, 0)
        self.handles: OrderedDict[str, KVHandle] = OrderedDict()
        self.prompt_tokens = 0
        self.prefix_hit_tokens = 0
        floor = engine.transfer_floor_seconds(1 << 20)
        # Shipped KV bytes per wall-clock second: the modelled link until a transfer of at least
        # RATE_MIN_BYTES is measured, then a moving average of measurements (pacing included).
        self.transfer_rate = min((1 << 20) / floor, MAX_RATE) if floor > 0 else DEFAULT_LOOPBACK_BYTES_PER_S
        self.transfer_rate_measured = False
        self._sweeper: asyncio.Task[None] | None = None
        self._generate_prefills = 0

    def _pool_snapshot(self) -> list[tuple[int, int]]:
        return self.pool.snapshot()

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(self._sweep_handles(), name=f"node-sweeper-{self.node_id}")

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None
        while self.handles:
            _, h = self.handles.popitem(last=False)
            self.pool.release(h.hashes)
        self.events.close()
        if self.sender is not None:
            await self.sender.close()

    async def _sweep_handles(self) -> None:
        period = min(1.0, max(0.05, self.config.handle_ttl_s / 4))
        while True:
            await asyncio.sleep(period)
            self.expire_handles()

    def expire_handles(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        n = 0
        while self.handles:
            key, h = next(iter(self.handles.items()))
            if h.expires_at > now:
                break
            del self.handles[key]
            self.pool.release(h.hashes)
            n += 1
            log.info("kv handle expired", kv_handle=key, request_id=h.request_id)
        return n

    # -- prefill -----------------------------------------------------------------------------

    def _validate(self, tokens: bytes, hashes: Sequence[int], resumed: int = 0) -> int:
        if not tokens:
            raise InvalidArgument("empty prompt: tokens has no bytes")
        if len(tokens) % 4:
            raise InvalidArgument(
                f"tokens must be packed uint32 (a multiple of 4 bytes), got {len(tokens)} bytes"
            )
        n = len(tokens) // 4
        full = n // self.block_size
        if len(hashes) != full:
            raise InvalidArgument(
                f"block_hashes has {len(hashes)} entries but the prompt has {full} full blocks"
                f" ({n} tokens, block_size {self.block_size})"
            )
        if any(h == 0 for h in hashes):
            raise InvalidArgument("block_hashes must be nonzero")
        if not 0 <= resumed < n:
            raise InvalidArgument(f"resumed {resumed} of a {n}-token sequence: the prompt must remain")
        self._check_context(n, "pool")
        return n

    @property
    def context_tokens(self) -> int:
        """The longest prompt this node serves: ``context_length``, never more than its whole
        pool holds (the default)."""
        pool = self.pool.capacity * self.block_size
        return min(pool, self.config.context_length) if self.config.context_length > 0 else pool

    def _check_context(self, n: int, stage: str) -> None:
        """The client's prompt, over this node's context for good: refused in the words the
        gateway recognises as a refusal for length."""
        limit = self.context_tokens
        if n > limit:
            raise InvalidArgument(f"prompt has {n} tokens, the context holds {limit}", stage=stage)

    async def _prefill_run(
        self,
        tokens: bytes,
        hashes: Sequence[int],
        sampling: Sampling,
        first_token: bool,
        resumed: int = 0,
        priority: int = 0,
    ) -> _Run:
        """Queue, reuse the cached prefix, compute the rest, store it. The caller must release
        ``hashes`` from the pool afterwards."""
        n = len(tokens) // 4
        bs = self.block_size
        guess = n - self.pool.leading(hashes) * bs
        try:
            ticket: Ticket = await self.prefills.acquire(guess, priority)
        except QueueFull as e:
            raise ResourceExhausted(f"prefill {e}", stage="queue") from None
        t0 = time.monotonic()
        waited = ticket.waited_s  # before any turn it gives to others (that is prefill time)
        try:
            k = self.pool.acquire(hashes)
            try:
                need = len(hashes) - k
                try:
                    self.pool.reserve(need)
                except PoolExhausted as e:
                    raise ResourceExhausted(str(e), stage="pool") from None
                try:
                    cached = k * bs
                    ticket.tokens = n - cached
                    ticket.expected_s = self.engine.prefill_seconds(n - cached, cached)

                    async def checkpoint(done: int) -> None:
                        """Between chunks: prefills waiting in line go first (a chunked prefill
                        does not hold the engine for its whole prompt), then the rest of this one;
                        by priority, those it does not go before."""
                        if not self.prefills.yields_to(ticket):
                            return
                        rest = max(0, n - cached - done)
                        ticket.tokens = rest
                        await self.prefills.yield_turn(ticket)
                        ticket.expected_s = self.engine.prefill_seconds(rest, cached + done)

                    job = PrefillJob(
                        tokens,
                        hashes,
                        k,
                        [p.data for p in self.pool.payloads(hashes[:k])],
                        sampling,
                        first_token,
                        chunk_tokens=self.config.chunked_prefill_size,
                        checkpoint=checkpoint if self.config.chunked_prefill_size > 0 else None,
                        resumed=resumed,
                    )
                    out = await self.engine.prefill(job)
                except BaseException:
                    self.pool.unreserve(need)
                    raise
                self.pool.commit(hashes, k, [Page.of(d) for d in out.new_pages], need)
            except BaseException:
                self.pool.release(hashes[:k])
                raise
        finally:
            self.prefills.release(ticket)
        self.prompt_tokens += n
        self.prefix_hit_tokens += k * bs
        return _Run(hashes, k, out, waited, time.monotonic() - t0)

    async def prefill(self, call: PrefillCall) -> PrefillResult:
        n = self._validate(call.tokens, call.block_hashes, call.resumed)
        hashes = list(call.block_hashes)
        first = not call.skip_first_token
        run = await self._prefill_run(call.tokens, hashes, call.sampling, first, call.resumed, call.priority)
        try:
            if call.pin_seconds > 0:
                self.pool.pin(hashes, call.pin_seconds)
            out = run.output
            first_text, finished, reason, first_lp = "", False, "", None
            if not call.skip_first_token:
                gen = self._generation(call.sampling, call.tokens, call.resumed)
                ids, first_text = gen.push([out.first_token])
                finished, reason = gen.finished, gen.finish_reason
                first_lp = out.first_logprob if ids else None
            handle, t_s, t_bytes = "", 0.0, 0
            if call.decode_address and not call.skip_first_token:  # even when finished: Decode ends it
                ack, t_s = await self._push(call, run)
                handle, t_bytes = ack.kv_handle, ack.bytes
            cached = run.cached_blocks * self.block_size
            log.debug(
                "prefill done",
                prompt_tokens=n,
                cached_tokens=cached,
                queue_s=round(run.queue_s, 6),
                prefill_s=round(run.prefill_s, 6),
                transfer_s=round(t_s, 6),
                decode_address=call.decode_address,
            )
            return PrefillResult(
                request_id=call.request_id,
                prompt_tokens=n - call.resumed,
                cached_tokens=cached,
                first_token=out.first_token,
                first_text=first_text,
                kv_handle=handle,
                queue_seconds=run.queue_s,
                prefill_seconds=run.prefill_s,
                transfer_seconds=t_s,
                transfer_bytes=t_bytes,
                state=out.state,
                finished=finished,
                finish_reason=reason,
                first_logprob=first_lp,
            )
        finally:
            self.pool.release(hashes)

    async def _push(self, call: PrefillCall, run: _Run) -> tuple[TransferAck, float]:
        if self.sender is None:
            raise FailedPrecondition("this node has no KV sender", stage="transfer")
        fmt = self.engine.kv_format
        bs = self.block_size
        pages = [
            WirePage(i, h, bs, p.data, p.checksum)
            for i, (h, p) in enumerate(zip(run.hashes, self.pool.payloads(run.hashes), strict=True))
        ]
        tail = run.output.tail_page
        if tail:
            pages.append(WirePage(len(pages), 0, len(tail) // fmt.bytes_per_token, tail, checksum(tail)))
        header = TransferHeader(
            request_id=call.request_id,
            kv_handle=uuid.uuid4().hex,
            format=fmt,
            tokens=call.tokens,
            num_pages=len(pages),
            first_token=run.output.first_token,
            state=run.output.state,
            sampling=call.sampling,
        )
        timeout = self.config.transfer_timeout_s
        if call.timeout is not None:
            timeout = max(0.001, min(timeout, call.timeout))
        start = time.monotonic()
        ack = await self.sender.send(
            call.decode_address, header, pages, cached_tokens=run.cached_blocks * bs, timeout=timeout
        )
        floor = self.engine.transfer_floor_seconds(ack.bytes)
        spent = time.monotonic() - start
        if floor > spent:
            await asyncio.sleep(floor - spent)
        seconds = time.monotonic() - start
        if ack.bytes >= RATE_MIN_BYTES and seconds > 0:  # small transfers measure latency, not rate
            rate = ack.bytes / seconds
            if self.transfer_rate_measured:
                rate = (1 - RATE_EWMA) * self.transfer_rate + RATE_EWMA * rate
            self.transfer_rate = rate
            self.transfer_rate_measured = True
        return ack, seconds

    # -- receiving KV pages ------------------------------------------------------------------

    async def receive(
        self, header: TransferHeader, pages: AsyncIterator[WirePage], cached_tokens: int = 0
    ) -> TransferAck:
        ours = self.engine.kv_format
        mismatch = format_mismatch(ours, header.format)
        if mismatch:
            raise FailedPrecondition("KV format mismatch: " + "; ".join(mismatch), stage="transfer")
        if not header.tokens or len(header.tokens) % 4:
            raise InvalidArgument("transfer header: tokens must be nonempty packed uint32", stage="transfer")
        n = len(header.tokens) // 4
        bs = self.block_size
        full, rest = divmod(n, bs)
        expected = full + (1 if rest else 0)
        if header.num_pages != expected:
            raise InvalidArgument(
                f"transfer header: num_pages {header.num_pages},"
                f" but {n} tokens make {expected} pages of {bs}",
                stage="transfer",
            )
        self._check_context(n, "transfer")
        if full > self.pool.capacity:
            raise ResourceExhausted(
                f"prompt needs {full} KV blocks, this node holds {self.pool.capacity}", stage="pool"
            )
        self.expire_handles()
        key = header.kv_handle or uuid.uuid4().hex
        if key in self.handles:
            raise AlreadyExists(f"kv handle {key!r} already pending", stage="transfer")

        received: list[WirePage] = []
        total = 0
        async for page in pages:
            i = len(received)
            if i >= expected:
                raise InvalidArgument(f"more than the announced {expected} pages", stage="transfer")
            want_tokens = bs if i < full else rest
            if page.index != i or page.num_tokens != want_tokens:
                raise InvalidArgument(
                    f"page {i}: got index {page.index} with {page.num_tokens} tokens, expected {want_tokens}",
                    stage="transfer",
                )
            if (page.block_hash == 0) != (i >= full):
                raise InvalidArgument(
                    f"page {i}: block_hash must be {'0' if i >= full else 'set'}", stage="transfer"
                )
            if len(page.data) != want_tokens * ours.bytes_per_token:
                raise InvalidArgument(
                    f"page {i}: {len(page.data)} bytes, expected {want_tokens * ours.bytes_per_token}",
                    stage="transfer",
                )
            if checksum(page.data) != page.checksum:
                raise DataLoss(f"page {i}: checksum mismatch", stage="transfer")
            received.append(page)
            total += len(page.data)
        if len(received) != expected:
            raise InvalidArgument(f"got {len(received)} of {expected} announced pages", stage="transfer")

        hashes = [p.block_hash for p in received[:full]]
        k = self.pool.acquire(hashes)
        try:
            need = full - k
            try:
                self.pool.reserve(need)
            except PoolExhausted as e:
                raise ResourceExhausted(str(e), stage="pool") from None
            self.pool.commit(hashes, k, [Page(p.data, p.checksum) for p in received[k:full]], need)
        except BaseException:
            self.pool.release(hashes[:k])
            raise
        tail = received[full].data if rest else b""
        self.handles[key] = KVHandle(
            kv_handle=key,
            request_id=header.request_id,
            tokens=header.tokens,
            hashes=tuple(hashes),
            tail=tail,
            first_token=header.first_token,
            state=header.state,
            sampling=header.sampling,
            cached_tokens=cached_tokens,
            expires_at=time.monotonic() + self.config.handle_ttl_s,
        )
        while len(self.handles) > self.config.max_handles:
            old_key, old = self.handles.popitem(last=False)
            self.pool.release(old.hashes)
            log.warning("kv handle dropped: too many pending", kv_handle=old_key, request_id=old.request_id)
        log.debug("kv received", kv_handle=key, pages=len(received), bytes=total, reused_pages=k)
        return TransferAck(key, len(received), total, k)

    # -- decode and generate -----------------------------------------------------------------

    async def _acquire_stream(self) -> Ticket:
        try:
            return await self.streams.acquire()
        except QueueFull:
            raise ResourceExhausted(
                f"decode streams full ({self.streams.max_running} running)", stage="decode"
            ) from None

    async def decode(
        self, kv_handle: str, sampling: Sampling | None = None, resumed: int = 0
    ) -> AsyncIterator[Chunk]:
        """Continue a request whose pages arrived with ``receive``. The handle is single use.
        ``resumed``: as the prefill's (``resumed_generation``)."""
        ticket = await self._acquire_stream()
        try:
            handle = self.handles.pop(kv_handle, None)
            if handle is None or handle.expires_at <= time.monotonic():
                if handle is not None:
                    self.pool.release(handle.hashes)
                raise NotFound(f"kv handle {kv_handle!r} unknown or expired", stage="decode")
            try:
                s = sampling if sampling is not None else handle.sampling
                if not 0 <= resumed < len(handle.tokens) // 4:
                    raise InvalidArgument(f"resumed {resumed} of a {len(handle.tokens) // 4}-token sequence")
                gen = self._generation(s, handle.tokens, resumed)
                gen.push([handle.first_token])
                pages = [p.data for p in self.pool.payloads(handle.hashes)]
                if handle.tail:
                    pages.append(handle.tail)
                job = DecodeJob(
                    handle.tokens,
                    pages,
                    handle.first_token,
                    handle.state,
                    s,
                    gen.remaining,
                    resumed,
                    self.config.stream_interval,
                )
                prompt = len(handle.tokens) // 4 - resumed
                wait = ticket.waited_s
                async for chunk in self._decode_chunks(gen, job, prompt, handle.cached_tokens):
                    chunk.queue_seconds = wait
                    yield chunk
            finally:
                self.pool.release(handle.hashes)
        finally:
            self.streams.release(ticket)

    async def generate(
        self,
        tokens: bytes,
        block_hashes: Sequence[int],
        sampling: Sampling,
        resumed: int = 0,
        priority: int = 0,
    ) -> AsyncIterator[Chunk]:
        """The whole request here: prefill with prefix reuse, then decode. Same tokens as the
        split path. ``resumed``, ``priority``: as the prefill's (``PrefillCall``)."""
        n = self._validate(tokens, block_hashes, resumed)
        hashes = list(block_hashes)
        ticket = await self._acquire_stream()
        try:
            self._generate_prefills += 1  # holds a stream slot too: count the request once
            try:
                run = await self._prefill_run(tokens, hashes, sampling, True, resumed, priority)
            finally:
                self._generate_prefills -= 1
            try:
                cached = run.cached_blocks * self.block_size
                gen = self._generation(sampling, tokens, resumed)
                ids, text = gen.push([run.output.first_token])
                first = Chunk(ids, text, queue_seconds=run.queue_s, prefill_seconds=run.prefill_s)
                if ids and run.output.first_logprob is not None:
                    first.logprobs = [run.output.first_logprob]
                n -= resumed  # the prompt the client sent: the rest is output
                yield self._usage(first, gen, n, cached)
                if gen.finished:
                    return
                pages = [p.data for p in self.pool.payloads(hashes)]
                if run.output.tail_page:
                    pages.append(run.output.tail_page)
                job = DecodeJob(
                    tokens,
                    pages,
                    run.output.first_token,
                    run.output.state,
                    sampling,
                    gen.remaining,
                    resumed,
                    self.config.stream_interval,
                )
                async for chunk in self._decode_chunks(gen, job, n, cached):
                    yield chunk
            finally:
                self.pool.release(hashes)
        finally:
            self.streams.release(ticket)

    def _generation(self, sampling: Sampling, tokens: bytes, resumed: int) -> Generation:
        """A fresh ``Generation``, past the ``resumed`` output tokens that end ``tokens``.

        ``resumed_generation``: a generation broken elsewhere continues here from its prompt and
        the tokens already shown. They are pushed as they were there (their text discarded: it was
        shown), so the count of output tokens, the text held back for a stop string and what is
        released next are exactly as on the node that broke; the text joins seamlessly. The
        request's ``max_tokens`` is what is left to generate after them.
        """
        if resumed:  # ``max_tokens`` is what is left after them
            sampling = replace(sampling, max_tokens=sampling.max_tokens + resumed)
        gen = Generation(sampling, self.engine.eos_token, self.engine.token_text)
        if resumed:
            gen.push(unpack_ids(tokens[len(tokens) - 4 * resumed :]))
        return gen

    async def _decode_chunks(
        self, gen: Generation, job: DecodeJob, prompt_tokens: int, cached_tokens: int
    ) -> AsyncIterator[Chunk]:
        if gen.finished:  # the first token already ended it: just the usage
            yield self._usage(Chunk(), gen, prompt_tokens, cached_tokens)
            return
        groups = self.engine.decode(job)
        try:
            async for group in groups:
                ids, text = gen.push(group)
                chunk = Chunk(ids, text)
                if isinstance(group, Tokens) and group.logprobs:  # aligned: ids is a prefix of group
                    chunk.logprobs = group.logprobs[: len(ids)]
                yield self._usage(chunk, gen, prompt_tokens, cached_tokens)
                if gen.finished:
                    return
            tail = gen.end()
            yield self._usage(Chunk([], tail), gen, prompt_tokens, cached_tokens)
        finally:
            await groups.aclose()

    @staticmethod
    def _usage(chunk: Chunk, gen: Generation, prompt_tokens: int, cached_tokens: int) -> Chunk:
        """Every chunk carries the usage so far; the last one also its finish_reason."""
        chunk.finish_reason = gen.finish_reason
        chunk.prompt_tokens = prompt_tokens
        chunk.completion_tokens = gen.count
        chunk.cached_tokens = cached_tokens
        return chunk

    # -- cache control and stats -------------------------------------------------------------

    def evict(self, hashes: Sequence[int] = (), everything: bool = False) -> list[int]:
        evicted = self.pool.evict(hashes, everything=everything)
        log.info("evicted", blocks=len(evicted), requested=len(hashes), all=everything)
        return evicted

    def pin(self, hashes: Sequence[int], seconds: float) -> tuple[int, int]:
        return self.pool.pin(hashes, seconds)

    def snapshot(self) -> NodeSnapshot:
        e = self.engine
        profile = replace(e.profile.effective(e.time_scale), transfer_bytes_per_s=self.transfer_rate)
        counts = self.pool.counts()
        return NodeSnapshot(
            node_id=self.node_id,
            role=self.config.role,
            engine=e.name,
            kv_format=e.kv_format,
            capacity_blocks=counts.capacity,
            used_blocks=counts.used,
            pinned_blocks=counts.pinned,
            queued_requests=len(self.prefills.waiting) + len(self.streams.waiting),
            queued_tokens=self.prefills.work_tokens(),
            running_requests=max(
                0, len(self.prefills.running) + len(self.streams.running) - self._generate_prefills
            ),
            max_queue=self.config.max_queue,
            max_concurrency=self.config.max_concurrency,
            profile=profile,
            time_scale=e.time_scale,
            kv_event_seq=self.events.seq,
            instance_id=self.events.instance_id,
            prefix_hit_tokens=self.prefix_hit_tokens,
            prompt_tokens=self.prompt_tokens,
            pending_handles=len(self.handles),
            features=frozenset(getattr(e, "features", ())),
            evictable_blocks=counts.evictable,
            reserved_blocks=counts.reserved,
            max_context_tokens=self.context_tokens,
        )
