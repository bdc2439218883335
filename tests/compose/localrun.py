"""Run a compose plan (``topology.local_plan``) as local processes, as ``docker compose up`` would.

Services start in dependency order; a ``service_healthy`` dependency is waited for by running
that service's own healthcheck command until it passes, like Docker does. ``down`` stops them in
reverse order (``gateway.ops.processes``: SIGTERM, then SIGKILL after a grace period) and reports
leaked processes.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Mapping

from prefixgate.gateway.ops import processes
from prefixgate.gateway.ops.processes import Child
from tests.compose.topology import REPO, LocalService

HEALTH_INTERVAL_S = 0.25


def service_env(service: LocalService) -> dict[str, str]:
    """The service's environment over this process's, minus any PREFIXGATE_* set here."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXGATE_")}
    return {**base, **service.env}


class LocalCompose:
    def __init__(self, plan: list[LocalService], external: Mapping[str, Callable[[], bool]]) -> None:
        self.plan = {s.name: s for s in plan}
        self.external = dict(external)  # services not run here (Redis): name -> health probe
        self.procs: dict[str, Child] = {}
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
        argv = processes.prefixgate(*svc.argv)
        env = service_env(svc)
        self.procs[svc.name] = processes.start(svc.name, argv, env=env, inherit_env=False, cwd=REPO)

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
        for name in reversed(list(self.procs)):
            processes.stop_all([self.procs[name]], grace=grace)
        return {name: p.proc.returncode for name, p in self.procs.items()}

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
