"""Concurrent split requests spread over the decode pool: a decode node counts the gateway's
requests from their dispatch (``Node.dispatched``), not from their first token, so requests
still in their prefill are not all sent to the one decode node that looks idle. Real node
processes (one prefill, two decode) behind a real gateway; every count is back to 0 after."""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai

from tests.faults.cluster import Cluster

N = 6
MODEL = "prefixgate-sim"


def test_concurrent_split_requests_spread_over_the_decode_nodes() -> None:
    # A prefill node computing one prompt at a time, a first token ~0.45 s away: the requests
    # wait their turn there, all dispatched before the first has a token.
    cluster = Cluster.create(1, 2, ["--profile", "cpu", "--time-scale", "0.2", "--max-concurrency", "1"])
    cluster.start()
    try:
        client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=60)

        def one(i: int) -> tuple[str, str]:
            prompt = f"request {i}: " + "tokens of a long prompt " * 320  # ~2000 tokens, its own prefix
            r = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=4)
            assert r.parse().choices[0].text
            return r.headers["x-prefixgate-route"], r.headers["x-prefixgate-decode-node"]

        with ThreadPoolExecutor(N) as pool:
            served = list(pool.map(one, range(N)))
        assert {route for route, _ in served} == {"disaggregated"}
        per_node = Counter(node for _, node in served)
        assert sorted(per_node.values()) == [N // 2, N // 2], per_node
        deadline = time.monotonic() + 5  # a stream is given back once its last bytes are relayed
        while True:
            loads = [n["load"] for n in httpx.get(cluster.url + "/admin/nodes", timeout=10).json()["data"]]
            counts = [(x["local_requests"], x["active_streams"], x["pending_streams"]) for x in loads]
            if all(c == (0, 0, 0) for c in counts) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert all(c == (0, 0, 0) for c in counts), counts
    finally:
        assert cluster.stop() == 0
