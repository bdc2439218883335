"""What registered documents really cost: the gateway's resident memory against the count.

``python -m prefixgate.bench.document_memory`` starts a gateway process per scenario (no nodes needed for
documents), uploads documents over HTTP with a quota high enough for all of them, and prints the
growth of the gateway's resident memory (VmRSS), after the uploads and after reading each document
back once, next to the bytes the registry counts for them
(``gateway.state.documents.stored_cost``, the figure the quotas use) and their UTF-8 bytes (what an
earlier registry counted). Takes about a minute.
"""

from __future__ import annotations

import argparse
import sys
import time

import httpx
import orjson

from prefixgate.gateway.ops import processes
from prefixgate.gateway.ops.stack import free_port as _free_port
from prefixgate.gateway.state.documents import TENANT_OVERHEAD, stored_cost
from prefixgate.openai.normalize import Document

# name: (documents, characters each, character)
SCENARIOS: dict[str, tuple[int, int, str]] = {
    "5k one-byte": (5_000, 1, "x"),
    "1k 4 KB ascii": (1_000, 4_096, "x"),
    "64 1 MB ascii": (64, 1_048_576, "x"),
    "64 1 MB cjk (3 B utf-8)": (64, 349_525, "\u6587"),
}


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def measure(count: int, size: int, char: str) -> dict[str, int]:
    """Upload ``count`` documents to a fresh gateway; its RSS growth, the counted and UTF-8 bytes."""
    port = _free_port()
    env = {
        "PREFIXGATE_DOCUMENT_QUOTA_COUNT": str(count + 1),
        "PREFIXGATE_DOCUMENT_QUOTA_BYTES": str(1 << 40),
        "PREFIXGATE_DOCUMENT_STORE_BYTES": str(1 << 40),
        "PREFIXGATE_LOG_LEVEL": "warning",
    }
    url = f"http://127.0.0.1:{port}"
    cmd = processes.prefixgate("gateway", "--port", str(port), "--decode", "127.0.0.1:1")
    proc = processes.start(
        "gateway", cmd, env=env, ready=processes.answers_http(url + "/healthz"), timeout=30
    )
    try:
        with httpx.Client(base_url=url, timeout=30) as client:
            client.post("/v1/documents", json={"id": "warm-up", "text": "w" * size})
            client.delete("/v1/documents/warm-up")
            time.sleep(0.2)
            before = _rss(proc.pid)
            counted, utf8 = TENANT_OVERHEAD, 0
            for i in range(count):
                doc = Document(f"doc-{i:08d}", char * (size - 1) + chr(65 + i % 26))
                counted += stored_cost(doc)  # before serializing: that attaches a UTF-8 copy here
                utf8 += len(doc.text.encode())
                body = orjson.dumps({"id": doc.id, "text": doc.text})
                r = client.post("/v1/documents", content=body, headers={"content-type": "application/json"})
                r.raise_for_status()
            time.sleep(0.2)
            stored = _rss(proc.pid) - before
            for i in range(count):  # each GET serializes the text once
                client.get(f"/v1/documents/doc-{i:08d}").raise_for_status()
            time.sleep(0.2)
            fetched = _rss(proc.pid) - before
            return {"rss_growth": stored, "rss_after_get": fetched, "counted": counted, "utf8": utf8}
    finally:
        proc.stop(timeout=20)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.parse_args(argv)
    mib = 1024 * 1024
    print(
        f"{'scenario':<26}{'utf-8 MiB':>11}{'counted MiB':>13}{'RSS growth MiB':>16}"
        f"{'after GETs MiB':>16}{'RSS/counted':>13}"
    )
    for name, (count, size, char) in SCENARIOS.items():
        m = measure(count, size, char)
        worst = max(m["rss_growth"], m["rss_after_get"])
        ratio = worst / m["counted"] if m["counted"] else 0.0
        print(
            f"{name:<26}{m['utf8'] / mib:>11.2f}{m['counted'] / mib:>13.2f}"
            f"{m['rss_growth'] / mib:>16.2f}{m['rss_after_get'] / mib:>16.2f}{ratio:>13.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
