"""``prefixgate gateway --workers N``: N gateway processes on one port, one store between them.

One event loop uses one core. The supervisor binds the HTTP listener once and hands it to N
worker processes, each a whole gateway (both front ends, routing, health probes, KV events),
so the kernel spreads connections over them. They share the state (documents, pins, quotas,
usage, membership) exactly as replicas do: through ``--redis`` when it is given, else through a
private store the supervisor runs for them (``gateway.ops.embedded_store``). The index too is
shared through ``--redis``; on the private store each worker routes on its own in-process copy,
which the workers keep the same through the store's pub/sub (``cachetier.replicated``): no round
trip on a request's path.
Metrics are summed over the workers (prometheus_client's multiprocess mode), so a scrape of
any of them sees the whole gateway.

Signals: SIGTERM or SIGINT on the supervisor sends SIGTERM to every worker (each gives its
requests ``shutdown_grace_s``, as one gateway does) and waits for them; workers ignore Ctrl-C,
which reaches the whole process group. A worker that dies is replaced (at most
``MAX_RESTARTS`` in ``RESTART_WINDOW_S``, then the gateway stops with status 1); one that exits
before it is ready with a startup error stops the gateway with its status.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from types import FrameType

import structlog

from prefixgate.gateway.config import Settings

log = structlog.get_logger("prefixgate.supervisor")

#: A worker that dies is replaced, but no more than this many times in this window.
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
#: Time to wait for every worker to be serving.
READY_TIMEOUT_S = 120.0
#: Beyond the shutdown grace, how long workers get to close before they are killed.
STOP_MARGIN_S = 8.0
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
EXIT_STARTUP_FAILED = 3


def default_workers() -> int:
    """One worker per core this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS
        return max(1, os.cpu_count() or 1)


def worker_count(settings: Settings) -> int:
    return settings.workers if settings.workers > 0 else default_workers()


def bind_listener(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """The HTTP listener every worker accepts on (port 0: a free one, the same for all)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _die_with_parent() -> None:
    """On Linux, a worker gets SIGTERM when its supervisor is gone (even killed outright)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def worker_main(
    settings: Settings, sock: socket.socket, ready: Connection, index: int, count: int, replicated_index: bool
) -> None:
    """Worker ``index`` of ``count``: a whole gateway serving the supervisor's listener (runs in
    the child); ``replicated_index``: on the supervisor's own store (docs/workers.md)."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from prefixgate.cachetier.replicated import WorkerSlot
    from prefixgate.gateway.logging import configure_logging
    from prefixgate.gateway.ops import server

    configure_logging(settings.log_format, settings.log_level, {"worker": index})

    def on_ready() -> None:
        with contextlib.suppress(OSError):
            ready.send(os.getpid())

    # on the embedded store every worker applies the nodes' KV events to its own index; on a
    # user's Redis worker 0 alone writes them to the shared index, the others keep only their
    # mirror of it current (docs/workers.md)
    slot = WorkerSlot(index, count) if replicated_index else None
    code = server.run(
        settings,
        lambda: server.serve(
            settings, [sock], on_ready, (signal.SIGTERM,), index == 0, replicated_index=slot
        ),
    )
    sys.exit(code)


@dataclass
class Worker:
    index: int
    process: BaseProcess
    ready_pipe: Connection
    ready: bool = False
    started_at: float = field(default_factory=time.monotonic)
    stop_sent: bool = False


@dataclass
class Supervisor:
    """Starts, watches and stops the workers (see the module's docstring)."""

    settings: Settings
    count: int
    listener: socket.socket
    on_ready: Callable[[], None] | None = None
    #: the store is the supervisor's own: each worker routes on its own replicated index
    replicated_index: bool = False
    workers: dict[int, Worker] = field(default_factory=dict)
    stopping: int = 0  # the signal that began the stop
    restarts: list[float] = field(default_factory=list)
    exit_code: int = 0
    all_ready: bool = False
    kill_after: float = 0.0

    def __post_init__(self) -> None:
        self.ctx = multiprocessing.get_context("spawn")

    def worker_settings(self, index: int) -> Settings:
        """Worker 0 alone serves the metrics listener (its own port: one bind); every worker
        serves the gRPC front end on the same port (gRPC binds it with SO_REUSEPORT)."""
        s = dataclasses.replace(self.settings, workers=1)
        if index:
            s.prometheus_port = 0
        return s

    def start_worker(self, index: int) -> None:
        parent, child = self.ctx.Pipe(duplex=False)
        proc = self.ctx.Process(
            target=worker_main,
            args=(
                self.worker_settings(index),
                self.listener,
                child,
                index,
                self.count,
                self.replicated_index,
            ),
            name=f"prefixgate-worker-{index}",
            daemon=False,
        )
        proc.start()
        child.close()
        self.workers[index] = worker = Worker(index, proc, parent)
        log.info("worker_started", worker=index, pid=proc.pid)
        if self.stopping:  # the stop came while it was being started: it is not missed
            self._send_stop(worker)

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._signalled)
        for i in range(self.count):
            if self.stopping:
                break
            self.start_worker(i)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while self.workers:
            if not self.all_ready and not self.stopping and time.monotonic() > deadline:
                log.error("workers_not_ready", timeout_s=READY_TIMEOUT_S)
                self.exit_code = EXIT_STARTUP_FAILED
                self.stop(signal.SIGTERM)
            self._watch(0.5)
        return self.exit_code

    def _signalled(self, sig: int, frame: FrameType | None) -> None:
        self.stop(sig)

    def stop(self, sig: int) -> None:
        if self.stopping:
            return
        self.stopping = sig
        log.info("workers_stopping", signal=signal.Signals(sig).name, workers=len(self.workers))
        for w in self.workers.values():
            self._send_stop(w)
        self.kill_after = time.monotonic() + self.settings.shutdown_grace_s + STOP_MARGIN_S

    def _send_stop(self, w: Worker) -> None:
        """One SIGTERM per worker: a second would cut its open requests (a forced exit)."""
        if w.stop_sent:
            return
        w.stop_sent = True
        with contextlib.suppress(OSError):
            if w.process.pid is not None:
                os.kill(w.process.pid, signal.SIGTERM)

    def _watch(self, timeout: float) -> None:
        by_fd: dict[Connection | int, Worker] = {}
        for w in self.workers.values():
            by_fd[w.process.sentinel] = w
            if not w.ready:
                by_fd[w.ready_pipe] = w
        try:
            fired = wait(list(by_fd), timeout)
        except InterruptedError:
            fired = []
        for obj in fired:
            w = by_fd[obj]  # type: ignore[index]  # wait() returns what it was given
            if obj is w.ready_pipe:
                self._got_ready(w)
            elif not w.process.is_alive():
                self._exited(w)
        if self.stopping and time.monotonic() > self.kill_after:
            for w in self.workers.values():
                log.warning("worker_killed", worker=w.index, pid=w.process.pid)
                w.process.kill()

    def _got_ready(self, w: Worker) -> None:
        try:
            w.ready_pipe.recv()
        except (EOFError, OSError):
            return  # it exited: its sentinel says so
        w.ready = True
        log.info(
            "worker_ready",
            worker=w.index,
            pid=w.process.pid,
            seconds=round(time.monotonic() - w.started_at, 3),
        )
        if not self.all_ready and all(x.ready for x in self.workers.values()):
            self.all_ready = True
            if self.on_ready is not None:
                self.on_ready()

    def _exited(self, w: Worker) -> None:
        w.process.join()
        code = w.process.exitcode if w.process.exitcode is not None else 1
        del self.workers[w.index]
        w.ready_pipe.close()
        _mark_dead(w.process.pid)
        if self.stopping:
            # ended by the SIGTERM we sent, before it could handle it (still starting): as asked
            failed = 0 if code == -signal.SIGTERM else code
            if failed == 4 or (failed and not self.exit_code):
                self.exit_code = failed if failed > 0 else 1
            log.info("worker_stopped", worker=w.index, pid=w.process.pid, exit_code=code)
            return
        log.error("worker_exited", worker=w.index, pid=w.process.pid, exit_code=code, ready=w.ready)
        if not w.ready and code in (2, EXIT_STARTUP_FAILED):  # it will fail again: a setting
            self.exit_code = code
            self.stop(signal.SIGTERM)
            return
        now = time.monotonic()
        self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW_S] + [now]
        if len(self.restarts) > MAX_RESTARTS:
            log.error("workers_failing", restarts=len(self.restarts), window_s=RESTART_WINDOW_S)
            self.exit_code = 1
            self.stop(signal.SIGTERM)
            return
        self.start_worker(w.index)


def _mark_dead(pid: int | None) -> None:
    if pid is None or not os.environ.get(MULTIPROC_ENV):
        return
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]


def _exit_before_workers(sig: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def run_workers(settings: Settings, on_ready: Callable[[int], None] | None = None) -> int:
    """Serve ``settings`` with ``worker_count(settings)`` workers until a signal; the exit
    status as one gateway's (4 if a worker's grace cut requests). ``on_ready`` gets the port
    once every worker serves."""
    from prefixgate.gateway.ops import server

    # a stop asked for before the workers exist is a clean exit that still removes what was made
    # (the store, its socket, the metrics directory): the ``finally`` below runs
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_before_workers)
    prepared = asyncio.run(server.prepared(settings))
    if isinstance(prepared, int):
        return prepared
    settings = prepared
    count = worker_count(settings)
    try:
        listener = bind_listener(settings.host, settings.port)
    except OSError as e:
        print(f"prefixgate gateway: cannot listen on {settings.host}:{settings.port}: {e}", file=sys.stderr)
        return EXIT_STARTUP_FAILED
    settings.port = int(listener.getsockname()[1])
    metrics_dir = tempfile.mkdtemp(prefix="prefixgate-metrics-")
    os.environ[MULTIPROC_ENV] = metrics_dir
    store = None
    try:
        if not settings.redis:
            from prefixgate.gateway.ops.embedded_store import EmbeddedStore, EmbeddedStoreError

            try:
                store = EmbeddedStore.start()
            except EmbeddedStoreError as e:
                print(f"prefixgate gateway: {e}", file=sys.stderr)
                return EXIT_STARTUP_FAILED
            settings.redis = store.url
        port = settings.port

        def ready() -> None:
            kind = "redis" if store is None else "embedded"
            log.info("workers_ready", workers=count, port=port, store=kind)
            if on_ready is not None:
                on_ready(port)

        return Supervisor(settings, count, listener, ready, replicated_index=store is not None).run()
    finally:
        listener.close()
        if store is not None:
            store.stop()
        os.environ.pop(MULTIPROC_ENV, None)
        shutil.rmtree(metrics_dir, ignore_errors=True)
