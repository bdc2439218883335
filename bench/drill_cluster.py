"""Real processes for fault drills: our nodes and a gateway on loopback, and a load driver.

What the fault drills (``tests/faults``) and ``prefixgate bench chaos`` start and drive: nodes on
fixed loopback ports (a node restarted comes back on the same address, as the gateway knows it),
on our own protocol or as ``grpc://`` workers, a gateway in front of them, and requests whose
outcome (status, route, stream end, error event) is recorded, never raised.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families

from prefixgate.gateway.ops import processes
from prefixgate.gateway.ops.processes import Child
from prefixgate.gateway.ops.stack import free_port


def spawn(
    args: list[str],
    env: dict[str, str] | None = None,
    open_files: int = 0,
    *,
    log: Path | None = None,
    cwd: Path | None = None,
) -> Child:
    """``prefixgate ARGS`` as a child, logging JSON; ``open_files`` > 0: its RLIMIT_NOFILE;
    ``log``: its output also goes to that file (appended: a restarted node keeps one log)."""
    return processes.start(
        f"prefixgate {args[0]}",
        processes.prefixgate(*args),
        env={"PREFIXGATE_LOG_FORMAT": "json", **(env or {})},
        cwd=cwd,
        open_files=open_files,
        log=log,
    )


@dataclass
class NodeProc:
    role: str
    node_id: str
    port: int
    args: list[str]
    proc: Child | None = None
    scheme: str = ""  # "grpc://": the gateway talks to the node over the SMG engine protocol
    bootstrap_port: int = 0  # a prefill node's SGLang bootstrap port (SMG protocol, PD)
    log_dir: Path | None = None  # its output also goes to LOG_DIR/NODE_ID.log

    @property
    def address(self) -> str:
        return f"{self.scheme}127.0.0.1:{self.port}"

    @property
    def gateway_id(self) -> str:
        """The node's name in the gateway (headers, /admin/nodes): an SMG engine names no node
        id, so the gateway names it by its address."""
        return self.address if self.scheme else self.node_id

    @property
    def worker_entry(self) -> list[str]:
        """The node as ``--prefill``/``--decode`` takes it (URL, then a bootstrap port)."""
        return [self.address, str(self.bootstrap_port)] if self.bootstrap_port else [self.address]

    def launch(self) -> None:
        """Start the node; ``start`` also waits for its ready line."""
        self.proc = spawn(
            [
                "node",
                "--role",
                self.role,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--node-id",
                self.node_id,
                "--ready-line",
                *(["--bootstrap-port", str(self.bootstrap_port)] if self.bootstrap_port else []),
                *self.args,
            ],
            log=self.log_dir / f"{self.node_id}.log" if self.log_dir else None,
        )

    def wait_ready(self) -> None:
        assert self.proc is not None
        self.proc.wait_until(processes.printed(processes.NODE_READY), 30)

    def start(self) -> None:
        self.launch()
        self.wait_ready()

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.stop(signal.SIGKILL)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


@dataclass
class Cluster:
    prefill: list[NodeProc]
    decode: list[NodeProc]
    gateway_args: list[str] = field(default_factory=list)
    gateway_env: dict[str, str] = field(default_factory=dict)
    gateway_open_files: int = 0  # > 0: the gateway's RLIMIT_NOFILE
    port: int = 0
    gateway: Child | None = None
    protocol: str = "prefixgate"
    # The gateway's status poll (the health probe), quick so drills notice a node's fate sooner;
    # None: the gateway's default.
    stats_interval_s: float | None = 0.2
    log_dir: Path | None = None  # every child's output also goes to a file here

    @classmethod
    def create(
        cls, prefill: int, decode: int, node_args: list[str], *, protocol: str = "prefixgate", **kw: Any
    ) -> Cluster:
        """``protocol`` "smg": the gateway takes the nodes as ``grpc://`` workers (SGLang PD through
        each prefill node's bootstrap port) and tokenizes with the tokenizer the nodes ship, as
        ``prefixgate up --protocol smg`` does."""
        smg = protocol == "smg"
        scheme = "grpc://" if smg else ""
        p = [
            NodeProc(
                "prefill", f"prefill-{i}", free_port(), node_args, None, scheme, free_port() if smg else 0
            )
            for i in range(1, prefill + 1)
        ]
        d = [
            NodeProc("decode", f"decode-{i}", free_port(), node_args, None, scheme)
            for i in range(1, decode + 1)
        ]
        cluster = cls(p, d, protocol=protocol, **kw)
        for n in cluster.nodes:
            n.log_dir = cluster.log_dir
        return cluster

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def nodes(self) -> list[NodeProc]:
        return self.prefill + self.decode

    def start(self) -> None:
        """Every node at once, then the gateway; all stopped again if one does not come up."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        for n in self.nodes:
            n.launch()
        processes.wait_all(
            [n.proc for n in self.nodes if n.proc], processes.printed(processes.NODE_READY), 30
        )
        self.port = free_port()
        args = ["gateway", "--port", str(self.port)]
        for n in self.prefill:
            args += ["--prefill", *n.worker_entry]
        for n in self.decode:
            args += ["--decode", n.address]
        env = dict(self.gateway_env)
        if self.stats_interval_s is not None:
            env.setdefault("PREFIXGATE_STATS_INTERVAL_S", str(self.stats_interval_s))
        self.gateway = spawn(
            args + self.gateway_args,
            env=env,
            open_files=self.gateway_open_files,
            log=self.log_dir / "gateway.log" if self.log_dir else None,
        )
        all_prefill = processes.answers_http(
            self.url + "/readyz", lambda r: r.json()["prefill"] == len(self.prefill)
        )
        self.gateway.wait_until(all_prefill, 30)

    def stop(self) -> int:
        """The gateway first (its exit code), then every node at once."""
        rc = self.gateway.stop() if self.gateway else 0
        processes.stop_all([n.proc for n in self.nodes if n.proc is not None])
        return rc

    def gateway_rss_kb(self) -> int:
        assert self.gateway is not None
        with open(f"/proc/{self.gateway.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        return 0

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=5).text
        total = 0.0
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        return total

    def wait_routable(self, role: str, count: int, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = httpx.get(self.url + "/readyz", timeout=1)
            if r.json()[role] >= count:
                return
            time.sleep(0.1)
        raise TimeoutError(f"{role} nodes not routable: {r.json()}")


@dataclass
class Outcome:
    status: int
    route: str = ""
    prefill_node: str = ""
    decode_node: str = ""
    text: str = ""
    finish: str = ""
    error: str = ""
    retry_after: str | None = None
    done_marker: bool = False
    cached_tokens: int = 0
    started_at: float = 0.0  # time.monotonic() when the request was sent
    ended_at: float = 0.0  # and when its response (or stream) ended
    first_at: float = 0.0  # when the first token came (a stream's first content; else the response)
    finished: set[int] = field(default_factory=set)  # indexes of the choices that got a finish_reason
    request_id: str = ""  # x-prefixgate-request-id: the gateway's log line of the request


@dataclass
class Tally:
    scenario: str
    sent: int = 0
    succeeded: int = 0
    retried: int = 0
    fell_back: int = 0
    failed: int = 0
    rejected_429: int = 0
    stream_errors: int = 0
    silent_truncations: int = 0
    note: str = ""


async def one(http: httpx.AsyncClient, body: dict[str, Any], stream: bool) -> Outcome:
    started = time.monotonic()
    out = await _one(http, body, stream)
    out.started_at, out.ended_at = started, time.monotonic()
    return out


def _answered(r: httpx.Response) -> Outcome:
    """What the response's status and headers say (the body is read by the caller)."""
    return Outcome(
        r.status_code,
        r.headers.get("x-prefixgate-route", ""),
        r.headers.get("x-prefixgate-prefill-node", ""),
        r.headers.get("x-prefixgate-decode-node", ""),
        retry_after=r.headers.get("retry-after"),
        request_id=r.headers.get("x-prefixgate-request-id", ""),
    )


async def _one(http: httpx.AsyncClient, body: dict[str, Any], stream: bool) -> Outcome:
    try:
        if not stream:
            r = await http.post("/v1/chat/completions", json=body)
            out = _answered(r)
            data = r.json()
            out.first_at = time.monotonic()
            if r.status_code == 200:
                out.text = data["choices"][0]["message"]["content"]
                out.finish = data["choices"][0]["finish_reason"]
                out.finished = {c["index"] for c in data["choices"] if c.get("finish_reason")}
                out.cached_tokens = data["usage"]["prompt_tokens_details"]["cached_tokens"]
            else:
                out.error = data["error"]["message"]
            return out
        async with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            out = _answered(r)
            if r.status_code != 200:
                out.error = (await r.aread()).decode()[:300]
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    out.done_marker = True
                    continue
                obj = orjson.loads(payload)
                if "error" in obj:
                    out.error = obj["error"]["message"]
                    continue
                for ch in obj.get("choices", []):
                    content = ch["delta"].get("content") or ""
                    if content and not out.first_at:
                        out.first_at = time.monotonic()
                    out.text += content
                    out.finish = ch.get("finish_reason") or out.finish
                    if ch.get("finish_reason"):
                        out.finished.add(ch["index"])
            return out
    except httpx.HTTPError as e:
        return Outcome(0, error=f"transport: {e!r}")
    except (ValueError, KeyError, TypeError) as e:  # not the OpenAI shape (a proxy's error page)
        return Outcome(0, error=f"malformed response: {e!r}")


async def drive(
    url: str,
    bodies: list[dict[str, Any]],
    concurrency: int,
    *,
    stream: bool = False,
    during: Callable[[int], None] | None = None,
    timeout: float = 60.0,
) -> list[Outcome]:
    """Send every body with bounded concurrency; ``during(done)`` runs after each completion."""
    results: list[Outcome] = []
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as http:

        async def task(body: dict[str, Any]) -> None:
            async with sem:
                res = await one(http, body, stream)
            results.append(res)
            if during is not None:
                during(len(results))

        await asyncio.wait_for(asyncio.gather(*(task(b) for b in bodies)), timeout=timeout * 4)
    return results


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")
