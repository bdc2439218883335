"""Workers found at run time: a discovery file (smg worker bodies) and DNS names answered by a
real DNS server on loopback (``dnslib``'s, UDP). The gateway starts with no worker on its command
line; workers written into the file or into the zone join the pool within a resync and serve,
those taken out leave it, and one that comes back under the same address finds its index entries
still there."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from dnslib import QTYPE, RR, SRV, A, DNSLabel, DNSRecord
from dnslib.server import BaseResolver, DNSServer

from prefixgate.gateway.cluster.discovery import Found, parse_dns_entry, parse_workers, plan
from prefixgate.gateway.cluster.workers import NO_OPTIONS
from prefixgate.gateway.ops import processes
from prefixgate.gateway.ops.processes import Child
from tests.helpers import document, free_port, spawn
from tests.httpworkers.conftest import Worker, start_node

MODEL = "m-disc"
#: A resync is discovery_interval_s (2 s by default); a worker joins within two and its probe.
JOIN_S = 15.0


def _gateway(env: dict[str, str]) -> tuple[Child, str]:
    port = free_port()
    proc = spawn(["gateway", "--port", str(port)], env=env)  # no worker on the command line
    base = f"http://127.0.0.1:{port}"
    proc.wait_until(processes.answers_http(base + "/healthz"), 60)
    return proc, base


def _nodes(base: str) -> dict[str, dict[str, Any]]:
    r = httpx.get(base + "/admin/nodes", timeout=10, trust_env=False)
    return {n["address"]: n for n in r.json()["data"]}


def _until(check: Any, what: str, timeout: float = JOIN_S) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout} s: {what}")


def _chat(base: str, text: str) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": text}]}
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=30, trust_env=False)


def test_a_discovery_file_adds_removes_and_brings_back_workers(tmp_path: Path) -> None:
    first, second = start_node(MODEL), start_node(MODEL)
    path = tmp_path / "workers.toml"

    def write(*workers: Worker) -> None:
        body = "".join(f'[[worker]]\nurl = "{w.url}"\nlabels = {{ zone = "z1" }}\n\n' for w in workers)
        tmp = path.with_suffix(".new")
        tmp.write_text(body)
        tmp.replace(path)  # swapped in whole, as a ConfigMap is

    write(first)
    proc, base = _gateway({"PREFIXGATE_DISCOVERY_FILE": str(path)})
    try:
        _until(lambda: first.url in _nodes(base) and _chat(base, "hi").status_code == 200, "the first worker")
        write(first, second)
        _until(lambda: second.url in _nodes(base), "the second worker added")
        # a prefix the second worker holds, so that its index entries can be seen to stay: cold
        # texts until one is routed there (the least loaded of two idle workers)
        second_id = _nodes(base)[second.url]["id"]
        for i in range(40):
            text = document(7 + i, 2000)
            r = _chat(base, text)
            assert r.status_code == 200, r.text
            if r.headers["x-prefixgate-decode-node"] == second_id:
                break
        else:
            raise AssertionError("40 cold texts, none routed to the second worker")
        held = _until(lambda: _nodes(base)[second.url]["kv"]["index_blocks"], "its blocks indexed")

        write(first)
        _until(lambda: second.url not in _nodes(base), "the second worker removed")
        for i in range(4):  # served by the first alone (other texts: it must not learn this one)
            r = _chat(base, f"while the second is away {i}")
            assert r.status_code == 200 and r.headers["x-prefixgate-decode-node"] != second_id

        write(first, second)  # back, same address: its index entries were kept for it
        _until(lambda: second.url in _nodes(base), "the second worker back")
        assert _nodes(base)[second.url]["kv"]["index_blocks"] >= held
        r = _chat(base, text)
        assert r.status_code == 200 and r.headers["x-prefixgate-decode-node"] == second_id
        assert int(r.headers["x-prefixgate-cached-tokens"]) > 0

        path.write_text("[[worker]]\nurl = 'ftp://nope'\n")  # refused: the pool stays as it was
        _until(lambda: any('"discovery_file_refused"' in x for x in list(proc.lines)), "the refusal said")
        assert set(_nodes(base)) == {first.url, second.url}
    finally:
        processes.stop_all([proc, *[w.proc for w in (first, second) if w.proc]])


class _Zone(BaseResolver):  # type: ignore[misc]
    """A zone the test edits: NAME -> A records, and one SRV name."""

    def __init__(self) -> None:
        self.a: dict[str, list[str]] = {}
        self.srv: dict[str, list[tuple[str, int]]] = {}
        self.lock = threading.Lock()

    def resolve(self, request: DNSRecord, handler: Any) -> DNSRecord:
        reply = request.reply()
        name = str(request.q.qname).rstrip(".")
        with self.lock:
            if request.q.qtype == QTYPE.A:
                for ip in self.a.get(name, []):
                    reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(ip), ttl=1))
            elif request.q.qtype == QTYPE.SRV:
                for target, port in self.srv.get(name, []):
                    rdata = SRV(priority=0, weight=0, port=port, target=DNSLabel(target))
                    reply.add_answer(RR(request.q.qname, QTYPE.SRV, rdata=rdata, ttl=1))
            known = name in self.a or name in self.srv
        if not known:
            reply.header.rcode = 3  # NXDOMAIN
        return reply


@pytest.fixture
def zone() -> Iterator[tuple[_Zone, int]]:
    resolver = _Zone()
    port = free_port()
    server = DNSServer(resolver, address="127.0.0.1", port=port)
    server.start_thread()
    try:
        yield resolver, port
    finally:
        server.stop()


def test_dns_names_are_followed(zone: tuple[_Zone, int]) -> None:
    resolver, dns_port = zone
    nodes = [start_node(MODEL), start_node(MODEL)]
    ports = [int(w.url.rsplit(":", 1)[1]) for w in nodes]
    # our nodes listen on 127.0.0.1 only: the two workers are 127.0.0.1 and, through the SRV name,
    # the same host under its other port
    resolver.a["workers.test"] = ["127.0.0.1"]
    resolver.a["node.test"] = ["127.0.0.1"]
    env = {
        "PREFIXGATE_DISCOVERY_DNS": f"monolithic=http://workers.test:{ports[0]},monolithic=http://_http._tcp.srv.test",
        # the test's DNS server on loopback, not the machine's resolver
        "PREFIXGATE_DISCOVERY_DNS_SERVER": f"127.0.0.1:{dns_port}",
    }
    proc, base = _gateway(env)
    try:
        one = f"http://127.0.0.1:{ports[0]}"
        two = f"http://127.0.0.1:{ports[1]}"
        _until(lambda: one in _nodes(base) and _chat(base, "hi").status_code == 200, "the A record's worker")
        assert two not in _nodes(base)  # the SRV name does not exist yet (NXDOMAIN)
        with resolver.lock:
            resolver.srv["_http._tcp.srv.test"] = [("node.test", ports[1])]
        _until(lambda: two in _nodes(base), "the SRV target added")
        with resolver.lock:
            resolver.a["workers.test"] = []  # the name stays, with no address: no worker
        _until(lambda: one not in _nodes(base), "the A record's worker removed")
        r = _chat(base, "still served")
        assert r.status_code == 200, r.text
        assert re.search(str(ports[1]), r.headers["x-prefixgate-decode-node"])
    finally:
        processes.stop_all([proc, *[w.proc for w in nodes if w.proc]])


def test_plan_adds_what_is_found_and_removes_only_what_it_added() -> None:
    found = {a: Found("monolithic", a, NO_OPTIONS) for a in ("h:1", "h:2")}
    add, remove = plan(found, managed={"h:3", "h:2"}, present={"h:2", "h:3", "h:4"})
    assert [f.address for f in add] == ["h:1"]
    assert remove == ["h:3"]  # h:4 came from elsewhere: never removed by discovery


def test_a_bad_entry_or_file_says_what_is_wrong() -> None:
    assert parse_dns_entry("prefill=grpc://_grpc._tcp.p.ns 8998").port is None
    assert parse_dns_entry("regular=http://w.ns:8000").role == "monolithic"
    for bad in ("nope=h:1", "prefill=h", "prefill=h:1 x"):
        with pytest.raises(ValueError, match="discovery_dns"):
            parse_dns_entry(bad)
    with pytest.raises(ValueError, match="worker 2"):
        parse_workers(json.dumps([{"url": "http://a:1"}, {"url": "http://a:1"}]), "w.json")
    with pytest.raises(ValueError, match="tokenizer_path"):
        parse_workers('[[worker]]\nurl = "http://a:1"\ntokenizer_path = "/m"\n', "w.toml")
