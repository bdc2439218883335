"""docker-compose.yml read as data, and its translation into local processes (pure, no I/O).

No Docker engine runs where the tests run, so the compose topology is booted by running each
prefixgate service's own ``command`` and ``environment`` as a local process, with every
``service:port`` the containers would resolve mapped to a loopback port. What is rewritten is
exactly what Docker's network would provide: addresses and listening ports. Everything else
(flags, profiles, settings) runs as written in the file.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"
CONTAINER_APP_DIR = "/app"  # WORKDIR of the Dockerfile: the source tree
LOOPBACK = "127.0.0.1"
ANY_ADDRESS = "0.0.0.0"
PORT_SETTINGS = ("PREFIXGATE_PORT", "PREFIXGATE_GRPC_PORT")

_INTERPOLATION = re.compile(r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")


def load_compose(path: Path = COMPOSE_FILE) -> dict[str, Any]:
    with open(path) as f:
        data = yaml.safe_load(f)
    assert isinstance(data, dict)
    return data


def services(compose: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return dict(compose["services"])


def is_prefixgate(service: Mapping[str, Any]) -> bool:
    """A service running our image: its command starts with the ``prefixgate`` console script."""
    command = service.get("command")
    return isinstance(command, list) and bool(command) and command[0] == "prefixgate"


def default_profile(service: Mapping[str, Any]) -> bool:
    """Started by a plain ``docker compose up`` (no ``profiles``)."""
    return not service.get("profiles")


def interpolate(value: str, env: Mapping[str, str]) -> str:
    """Compose variable interpolation: ``$$``, ``${V}``, ``${V:-d}``, ``${V-d}`` (``?`` forms fail)."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group("name"), m.group("op"), m.group("arg") or ""
        current = env.get(name)
        if op == ":-":
            return current if current else arg
        if op == "-":
            return arg if current is None else current
        if op in (":?", "?") and (current is None or (op == ":?" and not current)):
            raise ValueError(f"required variable {name} is not set: {arg}")
        return current or ""

    return _INTERPOLATION.sub(sub, value)


def environment(service: Mapping[str, Any], host_env: Mapping[str, str]) -> dict[str, str]:
    """The service's environment as the container would see it (list or mapping form)."""
    raw = service.get("environment") or {}
    if isinstance(raw, list):
        pairs = [item.partition("=") for item in raw]
        raw = {k: v for k, _, v in pairs}
    return {str(k): interpolate("" if v is None else str(v), host_env) for k, v in raw.items()}


def depends_on(service: Mapping[str, Any]) -> dict[str, str]:
    """``{dependency: condition}``; the short list form means ``service_started``."""
    raw = service.get("depends_on") or {}
    if isinstance(raw, list):
        return {name: "service_started" for name in raw}
    return {name: (spec or {}).get("condition", "service_started") for name, spec in raw.items()}


def start_order(svcs: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Dependencies first (stable: file order among peers); raises on a cycle or unknown name."""
    order: list[str] = []
    state: dict[str, str] = {}

    def visit(name: str, path: tuple[str, ...]) -> None:
        if name not in svcs:
            raise ValueError(f"{path[-1]} depends on unknown service {name!r}")
        if state.get(name) == "done":
            return
        if state.get(name) == "visiting":
            raise ValueError(f"dependency cycle: {' -> '.join((*path, name))}")
        state[name] = "visiting"
        for dep in depends_on(svcs[name]):
            visit(dep, (*path, name))
        state[name] = "done"
        order.append(name)

    for name in svcs:
        visit(name, (name,))
    return order


def flag_value(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def container_ports(service: Mapping[str, Any], host_env: Mapping[str, str]) -> list[int]:
    """Ports the service listens on inside its container: ``--port`` and the PREFIXGATE_*PORT settings."""
    ports: list[int] = []
    port_flag = flag_value(list(service.get("command") or []), "--port")
    if port_flag is not None:
        ports.append(int(port_flag))
    env = environment(service, host_env)
    ports += [int(env[k]) for k in PORT_SETTINGS if env.get(k, "0") not in ("", "0")]
    return ports


@dataclass(frozen=True)
class LocalService:
    """One compose service as a local process."""

    name: str
    argv: list[str]  # the prefixgate arguments (the command without "prefixgate")
    env: dict[str, str]  # the service's environment, addresses rewritten
    healthcheck: list[str] | None  # the compose healthcheck as a local command
    depends_on: dict[str, str]


def _rewrite_addresses(text: str, own: str, port_map: Mapping[tuple[str, int], int]) -> str:
    """``service:port`` → ``127.0.0.1:mapped``; the service's own loopback port → its mapped port."""
    for (svc, cport), hport in port_map.items():
        pattern = rf"(?<![\w.-]){re.escape(svc)}:{cport}(?!\d)"
        text = re.sub(pattern, f"{LOOPBACK}:{hport}", text)
        if svc == own:
            text = re.sub(
                rf"(?<![\w.-])(?:127\.0\.0\.1|localhost):{cport}(?!\d)", f"{LOOPBACK}:{hport}", text
            )
    return text


def _local_argv(name: str, argv: list[str], port_map: Mapping[tuple[str, int], int]) -> list[str]:
    out = list(argv)
    for i in range(len(out) - 1):
        if out[i] == "--host" and out[i + 1] == ANY_ADDRESS:
            out[i + 1] = LOOPBACK
        elif out[i] == "--port":
            out[i + 1] = str(port_map[(name, int(out[i + 1]))])
    return out


def _local_healthcheck(
    name: str, service: Mapping[str, Any], port_map: Mapping[tuple[str, int], int]
) -> list[str] | None:
    test = (service.get("healthcheck") or {}).get("test")
    if not test or test[0] == "NONE":
        return None
    if test[0] == "CMD-SHELL":
        return ["sh", "-c", _rewrite_addresses(test[1], name, port_map)]
    argv = [_rewrite_addresses(a, name, port_map) for a in test[1:]]
    if argv[0] == "python":
        argv[0] = sys.executable
    return [
        str(REPO / a.removeprefix(CONTAINER_APP_DIR + "/")) if a.startswith(CONTAINER_APP_DIR + "/") else a
        for a in argv
    ]


def local_plan(
    compose: Mapping[str, Any],
    port_map: Mapping[tuple[str, int], int],
    host_env: Mapping[str, str],
    extra_env: Mapping[str, str] | None = None,
) -> list[LocalService]:
    """The default-profile prefixgate services, in start order, ready to run on loopback.

    ``port_map`` maps ``(service, container port)`` to the loopback port standing in for it,
    for every service (ours and external ones like Redis).
    """
    svcs = services(compose)
    plan: list[LocalService] = []
    for name in start_order(svcs):
        svc = svcs[name]
        if not (is_prefixgate(svc) and default_profile(svc)):
            continue
        env = {k: _rewrite_addresses(v, name, port_map) for k, v in environment(svc, host_env).items()}
        if env.get("PREFIXGATE_HOST") == ANY_ADDRESS:
            env["PREFIXGATE_HOST"] = LOOPBACK
        for key in PORT_SETTINGS:
            if env.get(key, "0") not in ("", "0"):
                env[key] = str(port_map[(name, int(env[key]))])
        env.update(extra_env or {})
        plan.append(
            LocalService(
                name=name,
                argv=_local_argv(name, list(svc["command"][1:]), port_map),
                env=env,
                healthcheck=_local_healthcheck(name, svc, port_map),
                depends_on=depends_on(svc),
            )
        )
    return plan
