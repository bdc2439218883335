"""Workers found at run time, without a restart: from a file and from DNS.

- **A file** (``discovery_file``): TOML ``[[worker]]`` tables, or a JSON list, each an smg worker
  body (``url``, ``worker_type``, ``bootstrap_port``, ``api_key``, ``labels``...: read by
  ``worker_spec``, as ``POST /workers`` reads it). Re-read when it changes (its size, time or
  inode: a Kubernetes ConfigMap is swapped in whole); a file that does not parse leaves the
  workers as they were and is said once.
- **Kubernetes** (``discovery_kubernetes``): pods by label selector, listed and watched
  (``cluster.k8s_discovery``).
- **DNS** (``discovery_dns``): ``ROLE=[SCHEME://]NAME:PORT [BOOTSTRAP_PORT]`` takes every A/AAAA
  address of NAME (a headless Service: one per ready pod), ``ROLE=[SCHEME://]_svc._proto.NAME``
  its SRV targets and ports; re-resolved every ``discovery_interval_s``. A name that no longer
  exists (NXDOMAIN, no answer) has no workers; one that cannot be resolved now (timeout, no
  server) keeps the workers it had.

Every replica and worker runs the same discovery, so nothing goes through the membership
records (``POST /workers`` and ``/admin/nodes`` keep theirs). Only the workers discovery added
are removed by it. A worker that goes is forgotten by the pool but its index entries stay
``discovery_forget_s``: one that comes back under the same address (an unready pod ready again)
is routed by the cache it kept; its KV events say what it lost. Later, they are cleared.

``plan`` is pure: which workers to add and to remove, given what was found and what is there.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import tomllib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from prefixgate.cachetier.tasks import stop_task
from prefixgate.gateway.cluster.worker_spec import ROLE_NAMES, parse_worker_body
from prefixgate.gateway.cluster.workers import WorkerOptions
from prefixgate.gateway.core.errors import GatewayError
from prefixgate.gateway.vocab import Role

log = structlog.get_logger("prefixgate.discovery")

#: Bounds: a file this large, or this many workers from one source, is a mistake, not a cluster.
MAX_FILE_BYTES = 1 << 20
MAX_WORKERS = 4096
DNS_TIMEOUT_S = 2.0


class KubernetesPods(Protocol):
    """Pods watched in Kubernetes (``cluster.k8s_discovery.KubernetesSource``)."""

    def start(self) -> None: ...

    def found(self) -> dict[str, Found]: ...

    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Found:
    role: str
    address: str
    options: WorkerOptions


def parse_workers(text: str, name: str) -> dict[str, Found]:
    """A discovery file's workers by address; ValueError says what is wrong (and where)."""
    try:
        if name.endswith(".json"):
            data: Any = json.loads(text)
        else:
            data = tomllib.loads(text).get("worker", [])
    except (ValueError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"{name}: {e}") from None
    if not isinstance(data, list) or not all(isinstance(w, dict) for w in data):
        raise ValueError(f"{name}: expected a list of worker tables ([[worker]] in TOML)")
    if len(data) > MAX_WORKERS:
        raise ValueError(f"{name}: {len(data)} workers, more than {MAX_WORKERS}")
    out: dict[str, Found] = {}
    for i, body in enumerate(data):
        try:
            role, address, options = parse_worker_body(body)
        except GatewayError as e:
            raise ValueError(f"{name}: worker {i + 1}: {e}") from None
        if address in out:
            raise ValueError(f"{name}: worker {i + 1}: {address} is listed twice")
        out[address] = Found(role, address, options)
    return out


@dataclass(frozen=True, slots=True)
class DnsEntry:
    role: str
    scheme: str  # "grpc://", "http://", or "" (a prefixgate node)
    name: str
    port: int | None  # None: SRV, each target's own
    bootstrap_port: int | None = None


def parse_dns_entry(entry: str) -> DnsEntry:
    """``ROLE=[SCHEME://]NAME:PORT [BOOTSTRAP_PORT]`` or ``ROLE=[SCHEME://]_svc._proto.NAME``."""
    role, sep, rest = entry.partition("=")
    kinds = ROLE_NAMES
    if not sep or role.strip() not in kinds:
        raise ValueError(f"discovery_dns {entry!r}: expected ROLE=NAME:PORT, ROLE one of {', '.join(kinds)}")
    parts = rest.split()
    if not parts or len(parts) > 2:
        raise ValueError(f"discovery_dns {entry!r}: expected ROLE=NAME:PORT [BOOTSTRAP_PORT]")
    target, scheme = parts[0], ""
    for s in ("grpc://", "http://", "https://"):
        if target.startswith(s):
            scheme, target = s, target[len(s) :]
    bootstrap = int(parts[1]) if len(parts) == 2 and parts[1].isdigit() else None
    if len(parts) == 2 and bootstrap is None:
        raise ValueError(f"discovery_dns {entry!r}: bootstrap port {parts[1]!r} is not a number")
    name, colon, port = target.rpartition(":")
    if target.startswith("_"):  # an SRV name: the ports are the records'
        return DnsEntry(kinds[role.strip()], scheme, target.rstrip("."), None, bootstrap)
    if not colon or not port.isdigit() or not name:
        raise ValueError(f"discovery_dns {entry!r}: expected NAME:PORT (or an SRV name _svc._proto.NAME)")
    return DnsEntry(kinds[role.strip()], scheme, name.rstrip("."), int(port), bootstrap)


def discovered(role: str, scheme: str, host: str, port: int, bootstrap_port: int | None = None) -> Found:
    """A worker found at ``host:port`` (an IPv6 address bracketed), for ``role``; a bootstrap port
    counts for a prefill worker only."""
    shown = f"[{host}]" if ":" in host else host
    bootstrap = bootstrap_port if role == Role.PREFILL.value else None
    options = WorkerOptions(split=role != Role.MONOLITHIC.value, bootstrap_port=bootstrap)
    return Found(role, f"{scheme}{shown}:{port}", options)


def found_at(entry: DnsEntry, hosts: Sequence[tuple[str, int]]) -> dict[str, Found]:
    """The workers of one name's answer: (address, port) pairs."""
    found = [discovered(entry.role, entry.scheme, h, p, entry.bootstrap_port) for h, p in hosts[:MAX_WORKERS]]
    return {f.address: f for f in found}


def plan(found: Mapping[str, Found], managed: set[str], present: set[str]) -> tuple[list[Found], list[str]]:
    """(to add, to remove): what was found and is not in the pool; what discovery added and is
    no longer found. A worker in the pool that discovery did not add (the command line, the
    admin API) is never removed by it."""
    add = [f for a, f in sorted(found.items()) if a not in present]
    remove = sorted(a for a in managed if a not in found and a in present)
    return add, remove


class DnsResolver:
    """A/AAAA and SRV answers, from the system's resolver or ``server`` (``HOST[:PORT]``)."""

    def __init__(self, server: str = "") -> None:
        import dns.asyncresolver

        self.resolver = dns.asyncresolver.Resolver(configure=not server)
        if server:
            host, _, port = server.rpartition(":") if server.count(":") == 1 else (server, "", "")
            self.resolver.nameservers = [host or server]
            if port:
                self.resolver.port = int(port)
        self.resolver.lifetime = DNS_TIMEOUT_S

    async def hosts(self, entry: DnsEntry) -> list[tuple[str, int]] | None:
        """The answer's (address, port) pairs; [] for a name with none; None: no answer now."""
        import dns.exception
        import dns.resolver

        try:
            if entry.port is None:
                srv = await self.resolver.resolve(entry.name, "SRV")
                out: list[tuple[str, int]] = []
                for r in srv:
                    for ip in await self._addresses(str(r.target).rstrip(".")):
                        out.append((ip, int(r.port)))
                return sorted(set(out))
            return sorted({(ip, entry.port) for ip in await self._addresses(entry.name)})
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return []
        except (dns.exception.Timeout, dns.resolver.NoNameservers, OSError) as e:
            log.warning("discovery_dns_unanswered", name=entry.name, error=repr(e)[:200])
            return None

    async def _addresses(self, name: str) -> list[str]:
        import dns.resolver

        out: list[str] = []
        for kind in ("A", "AAAA"):
            try:
                out += [str(r) for r in await self.resolver.resolve(name, kind)]
            except dns.resolver.NoAnswer:
                continue
        return out


class Discovery:
    """Brings the pool in line with the file and the DNS names every ``interval_s``."""

    def __init__(
        self,
        file: str,
        dns_entries: Sequence[str],
        dns_server: str,
        interval_s: float,
        forget_s: float,
        *,
        present: Callable[[], set[str]],
        add: Callable[[Found], Awaitable[object]],
        forget: Callable[[str], Awaitable[str | None]],
        clear: Callable[[str], Awaitable[int]],
        kubernetes: KubernetesPods | None = None,
    ) -> None:
        """``forget(address)``: out of the pool, its node id (None: not there); ``clear(id)``:
        its index entries dropped; ``kubernetes``: pods watched (``cluster.k8s_discovery``)."""
        self.kubernetes = kubernetes
        self.file = file
        self.entries = [parse_dns_entry(e) for e in dns_entries]
        self.resolver = DnsResolver(dns_server) if self.entries else None
        self.interval_s, self.forget_s = interval_s, forget_s
        self._present, self._add, self._forget, self._clear = present, add, forget, clear
        self.managed: set[str] = set()
        self.gone: dict[str, tuple[str, float]] = {}  # address -> (node id, when it went)
        self._file_key: tuple[int, int, int] | None = None
        self._from_file: dict[str, Found] = {}
        self._from_dns: dict[int, dict[str, Found]] = {}
        self._bad_file = ""
        self._task: asyncio.Task[None] | None = None

    @property
    def configured(self) -> bool:
        return bool(self.file or self.entries or self.kubernetes)

    def _read_file(self) -> dict[str, Found]:
        try:
            st = os.stat(self.file)
        except OSError as e:
            self._said_bad(f"{self.file}: {e.strerror}")
            return self._from_file
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        if key == self._file_key:
            return self._from_file
        try:
            if st.st_size > MAX_FILE_BYTES:
                raise ValueError(f"{self.file}: {st.st_size} bytes, more than {MAX_FILE_BYTES}")
            with open(self.file, encoding="utf-8") as f:
                self._from_file = parse_workers(f.read(MAX_FILE_BYTES + 1), self.file)
        except (OSError, UnicodeDecodeError, ValueError) as e:
            self._said_bad(str(e))
            return self._from_file
        self._file_key, self._bad_file = key, ""
        log.info("discovery_file_read", file=self.file, workers=len(self._from_file))
        return self._from_file

    def _said_bad(self, why: str) -> None:
        if why != self._bad_file:
            self._bad_file = why
            log.warning("discovery_file_refused", error=why[:500], kept=len(self._from_file))

    async def found(self) -> dict[str, Found]:
        out: dict[str, Found] = dict(self._read_file()) if self.file else {}
        if self.resolver is not None:
            for i, entry in enumerate(self.entries):
                hosts = await self.resolver.hosts(entry)
                if hosts is not None:
                    self._from_dns[i] = found_at(entry, hosts)
                out.update(self._from_dns.get(i, {}))
        if self.kubernetes is not None:
            out.update(self.kubernetes.found())
        return out

    async def sync(self) -> tuple[int, int]:
        """One pass; (added, removed)."""
        found = await self.found()
        present = self._present()
        add, remove = plan(found, self.managed, present)
        added = 0
        for f in add:
            try:
                await self._add(f)
            except ValueError as e:
                log.warning("discovery_add_refused", address=f.address, error=str(e)[:300])
                continue
            self.managed.add(f.address)
            self.gone.pop(f.address, None)
            added += 1
        for address in remove:
            self.managed.discard(address)
            node_id = await self._forget(address)
            if node_id is not None:
                self.gone[address] = (node_id, time.monotonic())
        self.managed &= self._present() | set(found)
        now = time.monotonic()
        for address, (node_id, at) in list(self.gone.items()):
            if now - at >= self.forget_s and address not in self._present():
                del self.gone[address]
                cleared = await self._clear(node_id)
                log.info("discovery_index_cleared", address=address, node=node_id, index_blocks=cleared)
        if add or remove:
            log.info("discovery_synced", added=added, removed=len(remove), workers=len(found))
        return added, len(remove)

    async def _loop(self) -> None:
        while True:
            try:
                await self.sync()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a source failing leaves the pool as it is
                log.warning("discovery_sync_failed", error=repr(e)[:300])
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        if self.configured and self._task is None:
            if self.kubernetes is not None:
                self.kubernetes.start()
            self._task = asyncio.create_task(self._loop(), name="discovery")

    async def close(self) -> None:
        task, self._task = self._task, None
        await stop_task(task)
        if self.kubernetes is not None:
            await self.kubernetes.close()
