"""Run a compose plan (``topology.local_plan``) as local processes, as ``docker compose up`` would.

Services start in dependency order; a ``service_healthy`` dependency is waited for by running
that service's own healthcheck command until it passes, like Docker does. ``down`` stops them in
reverse order (SIGTERM, then SIGKILL after a grace period) and reports leaked processes.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping

from tests.compose.topology import REPO, LocalService
from tests.helpers import Proc

PR_SET_PDEATHSIG = 1
HEALTH_INTERVAL_S = 0.25


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    """If the test process dies, the services get SIGTERM instead of living on (Linux)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def service_env(service: LocalService) -> dict[str, str]:
    """The service's environment over this process's, minus any PREFIXGATE_* set here."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXGATE_")}
    return {**base, "PYTHONUNBUFFERED": "1", **service.env}


class LocalCompose:
    def __init__(self, plan: list[LocalService], external: Mapping[str, Callable[[], bool]]) -> None:
        self.plan = {s.name: s for s in plan}
        self.external = dict(external)  # services not run here (Redis): name -> health probe
        self.procs: dict[str, Proc] = {}
        self.healthy: set[str] = set()
        self.health_checks = 0

    def up(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        for name, svc in self.plan.items():
            for dep, condition in svc.depends_on.items():
                if condition == "service_healthy":
                    self.wait_healthy(dep, deadline)
                elif dep in self.plan and dep not in self.procs:
                    raise RuntimeError(f"{name} depends on {dep}, not started")
            self.start(svc)
        for name in self.plan:
            self.wait_healthy(name, deadline)

    def start(self, svc: LocalService) -> None:
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefixgate.cli", *svc.argv],
            cwd=REPO,
            env=service_env(svc),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        p = Proc(proc)
        p.start_reader()
        self.procs[svc.name] = p

    def check(self, name: str) -> bool:
        """One run of the service's healthcheck (or the external probe)."""
        if name in self.external:
            return self.external[name]()
        hc = self.plan[name].healthcheck
        if hc is None:
            return self.procs[name].proc.poll() is None
        self.health_checks += 1
        env = service_env(self.plan[name])
        try:
            return subprocess.run(hc, env=env, capture_output=True, timeout=15).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def wait_healthy(self, name: str, deadline: float) -> None:
        while name not in self.healthy:
            proc = self.procs.get(name)
            if proc is not None and proc.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.proc.returncode}:\n{self.tail(name)}")
            if self.check(name):
                self.healthy.add(name)
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} not healthy in time:\n{self.tail(name)}")
            time.sleep(HEALTH_INTERVAL_S)

    def tail(self, name: str, lines: int = 30) -> str:
        proc = self.procs.get(name)
        return "" if proc is None else "\n".join(list(proc.lines)[-lines:])

    def down(self, grace: float = 15.0) -> dict[str, int]:
        """Stop every service, dependants first; returns the exit codes."""
        codes: dict[str, int] = {}
        for name in reversed(list(self.procs)):
            p = self.procs[name]
            if p.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.proc.pid, signal.SIGTERM)
            try:
                p.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.proc.pid, signal.SIGKILL)
                p.proc.wait(timeout=5)
            p.stop()  # joins the output reader
            codes[name] = p.proc.returncode
        return codes

    def leaked(self) -> list[str]:
        """Services whose process group still has a live process after ``down``."""
        out = []
        for name, p in self.procs.items():
            try:
                os.killpg(p.proc.pid, 0)
            except ProcessLookupError:
                continue
            except PermissionError:
                pass
            out.append(name)
        return out
