"""PD bootstrap: the decode leg of a request finds the prefill leg that holds the same room.

SGLang's disaggregation hands the same ``GenerateRequest`` to a prefill and a decode engine at
once, with ``disaggregated_params{bootstrap_host, bootstrap_port, bootstrap_room}`` naming the
prefill engine's bootstrap listener (``docs/engines.md``, "SGLang PD: bootstrap host, port
and room"). Here that listener is a small TCP server on the prefill node (``--bootstrap-port``)
speaking one JSON line each way:

- decode -> prefill: ``{"room": R, "request_id": ID, "kv_address": "host:port"}`` (where the
  decode node takes KV pages: its gRPC port, ``prefixgate.v1.Node/TransferKV``);
- prefill -> decode, when the prefill leg takes the room: ``{"status": "prefilling"}``; then,
  once the pages are there, the handle and the first token (``backends.pd.HandedOff``:
  ``{"kv_handle": ..., "first_token": ..., "first_text": ..., "first_logprob": [token, logprob,
  [[token, logprob], ...]] or null (when asked), "finished": ..., "finish_reason": ...,
  "cached_tokens": ..., "prompt_tokens": ..., "transfer_seconds": ..., "transfer_bytes": ...}``)
  or ``{"error": MESSAGE, "code": GRPC_CODE_NAME}``.

Whichever leg arrives first waits for the other, bounded by the bootstrap timeout; once paired,
the decode leg waits for the handoff (prefill compute and transfer) up to ``HANDOFF_TIMEOUT_S``.
A bare connect and close (routers probe the port at registration) is ignored. The pages
themselves move over the node's existing KV transfer, with its format fingerprint check and
measured transfer time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog

from prefixgate.backends.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NodeError,
    ResourceExhausted,
    Unavailable,
)

log = structlog.get_logger("prefixgate.bootstrap")

MAX_LINE = 64 << 10
MAX_PENDING_ROOMS = 4096
DEFAULT_BOOTSTRAP_TIMEOUT_S = 30.0
HANDOFF_TIMEOUT_S = 600.0  # a paired decode leg waits this long for its pages at most


@dataclass(slots=True)
class DecodePeer:
    """A decode leg parked on the prefill node, waiting for its KV handle."""

    room: int
    request_id: str
    kv_address: str
    _reply: asyncio.Future[dict[str, Any]] = field(default_factory=asyncio.Future)
    _taken: asyncio.Event = field(default_factory=asyncio.Event)

    def take(self) -> None:
        """The prefill leg has the room: the decode leg now waits for the handoff itself."""
        self._taken.set()

    def reply(self, message: dict[str, Any]) -> None:
        if not self._reply.done():
            self._reply.set_result(message)


class BootstrapServer:
    """The prefill node's bootstrap listener and its table of rooms."""

    def __init__(self, host: str, port: int, timeout_s: float = DEFAULT_BOOTSTRAP_TIMEOUT_S) -> None:
        self.host = host
        self.port = port
        self.timeout_s = timeout_s
        self._rooms: dict[int, asyncio.Future[DecodePeer]] = {}
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, self.host, self.port, limit=MAX_LINE)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self._conns):
            task.cancel()
        if self._conns:
            await asyncio.gather(*self._conns, return_exceptions=True)
        for fut in self._rooms.values():
            fut.cancel()
        self._rooms.clear()

    def _room(self, room: int) -> asyncio.Future[DecodePeer]:
        fut = self._rooms.get(room)
        if fut is None:
            if len(self._rooms) >= MAX_PENDING_ROOMS:
                raise ResourceExhausted(f"{len(self._rooms)} bootstrap rooms pending", stage="transfer")
            fut = self._rooms[room] = asyncio.get_running_loop().create_future()
        return fut

    def _forget(self, room: int, fut: asyncio.Future[DecodePeer]) -> None:
        if self._rooms.get(room) is fut:
            del self._rooms[room]

    async def wait_decode(self, room: int, request_id: str, timeout: float | None = None) -> DecodePeer:
        """The prefill leg: the decode peer presenting ``room`` (it may already be waiting)."""
        fut = self._room(room)
        limit = self.timeout_s if timeout is None else min(timeout, self.timeout_s)
        try:
            peer = await asyncio.wait_for(asyncio.shield(fut), max(0.001, limit))
        except TimeoutError:
            raise DeadlineExceeded(
                f"no decode leg presented bootstrap room {room} within {limit:.1f}s", stage="transfer"
            ) from None
        finally:
            self._forget(room, fut)
        if peer.request_id and request_id and peer.request_id != request_id:
            peer.reply(
                {"error": f"room {room} belongs to request {request_id!r}", "code": "INVALID_ARGUMENT"}
            )
            raise InvalidArgument(
                f"bootstrap room {room}: decode leg is request {peer.request_id!r}", stage="transfer"
            )
        peer.take()
        return peer

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._conns.add(task)
        try:
            await self._conversation(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, ValueError) as e:
            log.debug("bootstrap connection dropped", error=str(e))
        finally:
            if task is not None:
                self._conns.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _conversation(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line = await asyncio.wait_for(reader.readline(), self.timeout_s)
        if not line.strip():
            return  # a probe: connect and close
        hello = json.loads(line)
        room, rid, address = int(hello["room"]), str(hello.get("request_id", "")), str(hello["kv_address"])
        try:
            fut = self._room(room)
        except NodeError as e:
            await _send(writer, {"error": e.message, "code": e.code.name})
            return
        if fut.done():
            await _send(writer, {"error": f"bootstrap room {room} is taken", "code": "ALREADY_EXISTS"})
            return
        peer = DecodePeer(room, rid, address)
        fut.set_result(peer)
        gone = asyncio.ensure_future(reader.read(1))  # the decode leg hanging up aborts its wait
        taken = asyncio.ensure_future(peer._taken.wait())
        try:
            waiters: set[asyncio.Future[Any]] = {peer._reply, gone, taken}
            done, _ = await asyncio.wait(waiters, timeout=self.timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if taken in done and not peer._reply.done() and gone not in done:
                await _send(writer, {"status": "prefilling"})
                waiters = {peer._reply, gone}
                done, _ = await asyncio.wait(
                    waiters, timeout=HANDOFF_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
                )
        finally:
            gone.cancel()
            taken.cancel()
        self._forget(room, fut)
        if peer._reply in done:
            await _send(writer, peer._reply.result())
        elif gone not in done:
            await _send(
                writer, {"error": f"room {room}: no prefill leg answered", "code": "DEADLINE_EXCEEDED"}
            )


async def _send(writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
    writer.write(json.dumps(message).encode() + b"\n")
    await writer.drain()


async def handshake(
    host: str, port: int, room: int, request_id: str, kv_address: str, timeout: float
) -> dict[str, Any]:
    """The decode leg: present ``room`` to the prefill node and wait for its KV handle: up to
    ``timeout`` for the prefill leg to take the room, then up to ``HANDOFF_TIMEOUT_S``."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, limit=MAX_LINE), timeout)
    except TimeoutError:
        raise Unavailable(
            f"bootstrap {host}:{port}: no connection within {timeout:.1f}s", stage="transfer"
        ) from None
    except OSError as e:
        raise Unavailable(f"bootstrap {host}:{port} unreachable: {e}", stage="transfer") from None
    try:
        await _send(writer, {"room": room, "request_id": request_id, "kv_address": kv_address})
        limit = timeout
        while True:
            try:
                line = await asyncio.wait_for(reader.readline(), limit)
            except TimeoutError:
                raise DeadlineExceeded(
                    f"bootstrap {host}:{port} room {room}: no KV handoff within {limit:.1f}s",
                    stage="transfer",
                ) from None
            if not line:
                raise Unavailable(
                    f"bootstrap {host}:{port} closed room {room} without an answer", stage="transfer"
                )
            reply: dict[str, Any] = json.loads(line)
            if reply.get("status") == "prefilling":
                limit = HANDOFF_TIMEOUT_S
                continue
            break
    except (ConnectionError, ValueError) as e:
        raise Unavailable(f"bootstrap {host}:{port} room {room}: {e}", stage="transfer") from None
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
    if "error" in reply:
        code = getattr(grpc.StatusCode, str(reply.get("code", "")), grpc.StatusCode.UNAVAILABLE)
        raise NodeError(f"prefill leg failed: {reply['error']}", stage="transfer", code=code)
    if not reply.get("kv_handle"):
        raise FailedPrecondition(f"bootstrap room {room}: prefill sent no KV handle", stage="transfer")
    return reply
