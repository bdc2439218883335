"""``prefixgate up --protocol smg``: our nodes and the gateway with grpc:// workers, PD through
the nodes' bootstrap ports, the index fed by SubscribeKvEvents."""

from __future__ import annotations

import httpx
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam

from tests.helpers import free_port, spawn

LONG = "Tell me about prefix caches, KV pages and the tokens they hold, in some detail. " * 8


def test_up_over_the_smg_protocol() -> None:
    port = free_port()
    proc = spawn(["up", "--protocol", "smg", "--port", str(port), "--prefill", "1", "--decode", "1",
                  "--time-scale", "0.05", "--block-size", "16"])  # fmt: skip
    try:
        m = proc.wait_for(r"prefixgate ready in [0-9.]+s: (http://\S+/v1)", timeout=60)
        base = m.group(1)
        client = OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=30)
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": LONG}]
        for _ in range(2):
            raw = client.chat.completions.with_raw_response.create(
                model="prefixgate-sim",
                messages=messages,
                max_tokens=6,
                temperature=0,  # type: ignore[arg-type]
            )
            r = raw.parse()
        assert raw.headers["x-prefixgate-route"] == "disaggregated"
        assert r.choices[0].message.content and r.usage is not None
        assert (
            r.usage.prompt_tokens_details is not None
            and (r.usage.prompt_tokens_details.cached_tokens or 0) > 0
        )
        nodes = httpx.get(base.removesuffix("/v1") + "/admin/nodes", timeout=10).json()["data"]
        assert {n["engine"] for n in nodes} == {"sglang"}
        assert all(n["address"].startswith("grpc://") for n in nodes)
        prefill = next(n for n in nodes if n["role"] == "prefill")
        assert prefill["kv"]["index_blocks"] > 0  # from the node's KV events (and routing)
    finally:
        assert proc.stop() == 0, "\n".join(list(proc.lines)[-30:])
