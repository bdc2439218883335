"""The admin API against a real stack: auth, nodes, explain, evict, switches, drain, add/remove."""

from __future__ import annotations

import itertools
from typing import Any

import httpx
from starlette.testclient import TestClient

from prefixgate.gateway.config import Settings
from prefixgate.gateway.core.service import GatewayService
from prefixgate.gateway.httpfront.app import create_app
from tests.admin.conftest import MODEL, AdminStack, chat, wait_until
from tests.helpers import document, spawn

SYSTEM = {"role": "system", "content": "Answer from the documents."}


def _messages(question: str) -> list[dict[str, str]]:
    return [SYSTEM, {"role": "user", "content": question}]


def test_admin_needs_the_token_when_one_is_configured(stack: AdminStack) -> None:
    with stack.admin(token=None) as c:
        r = c.get("/admin/nodes")
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_admin_token"
    with stack.admin(token="wrong") as c:
        assert c.get("/admin/cache").status_code == 401
        assert c.put("/admin/switches", json={"disaggregation": False}).status_code == 401
    with stack.admin() as c:
        assert c.get("/admin/switches").json()["disaggregation"] is True  # the refused PUT changed nothing


def test_admin_without_a_token_answers_loopback_clients_only() -> None:
    # Starlette's test client connects as host "testclient": not loopback.
    with TestClient(create_app(GatewayService(Settings()))) as c:
        r = c.get("/admin/nodes")
    assert r.status_code == 403
    assert r.json()["error"]["code"] == "admin_loopback_only"


def test_nodes_lists_every_node_with_health_circuit_load_and_kv(stack: AdminStack) -> None:
    with stack.admin() as c:
        nodes = c.get("/admin/nodes").json()["data"]
    assert [(n["id"], n["role"]) for n in nodes] == [
        ("prefill-1", "prefill"),
        ("prefill-2", "prefill"),
        ("decode-1", "decode"),
        ("decode-2", "decode"),
    ]
    for n in nodes:
        assert n["reachable"] and n["healthy"] and n["routable"] and not n["draining"]
        assert n["circuit"] == "closed"
        assert n["address"].startswith("127.0.0.1:")
        assert n["kv"]["capacity_blocks"] == 4096
        assert set(n["load"]) >= {"queued_requests", "running_requests", "active_streams", "queued_tokens"}
        assert n["kv"]["index_blocks"] >= 0


def test_lookup_explains_the_route_the_next_request_takes(stack: AdminStack) -> None:
    doc = {"id": "handbook", "text": document(11, 3000)}
    messages = _messages("Who signs the forms?")
    body = {"model": MODEL, "messages": messages, "documents": [doc], "max_tokens": 4}
    with stack.admin() as c:
        # A prompt nobody has seen: the policy breaks the tie, and explain must predict how.
        loads_before = [n["load"] for n in c.get("/admin/nodes").json()["data"]]
        fresh = c.post("/admin/cache/lookup", json=body).json()
        again = c.post("/admin/cache/lookup", json=body).json()
        assert [n["load"] for n in c.get("/admin/nodes").json()["data"]] == loads_before
    assert fresh["decision"]["mode"] == "disaggregated"
    assert fresh["decision"]["prefill_node"] == again["decision"]["prefill_node"]  # explain changed nothing
    first = chat(stack, messages, [doc])
    assert first.headers["x-prefixgate-prefill-node"] == fresh["decision"]["prefill_node"]
    assert first.headers["x-prefixgate-decode-node"] == fresh["decision"]["decode_node"]

    with stack.admin() as c:
        explained = c.post("/admin/cache/lookup", json=body).json()
    d = explained["decision"]
    assert d["prefill_node"] == first.headers["x-prefixgate-prefill-node"]  # cache affinity now
    n_tokens = first.json()["usage"]["prompt_tokens"]
    assert explained["prompt_tokens"] == n_tokens
    assert explained["full_blocks"] == n_tokens // 64 == len(explained["block_hashes"])
    assert all(len(h) == 16 and int(h, 16) >= 0 for h in explained["block_hashes"])
    assert d["cached_blocks"] == explained["full_blocks"]
    assert d["predicted_cached_tokens"] == explained["full_blocks"] * 64
    assert "cached blocks" in d["node_reason"] and d["reason"]

    segs = explained["layout"]["segments"]
    kinds = [s["kind"] for s in segs]
    assert kinds[0] == "system" and "document" in kinds and "conversation" in kinds
    assert segs[0]["tokens"][0] == 0 and segs[-1]["tokens"][1] == n_tokens
    for a, b in itertools.pairwise(segs):
        assert a["tokens"][1] == b["tokens"][0]  # contiguous token spans
    handbook = next(s for s in segs if s["kind"] == "document")
    assert handbook["label"] == "handbook" and handbook["token_count"] > 2900
    assert handbook["cached_tokens"] > 2800

    by_id = {n["id"]: n for n in explained["nodes"]}
    assert set(by_id) == {"prefill-1", "prefill-2", "decode-1", "decode-2"}
    chosen = by_id[d["prefill_node"]]
    assert chosen["hit_blocks"] == explained["full_blocks"] and "prefill" in chosen["chosen_for"]
    assert chosen["estimated_ttft_ms"] >= 0 and "load" in chosen
    other = next(n for n in explained["nodes"] if n["role"] == "prefill" and n["id"] != d["prefill_node"])
    assert other["hit_blocks"] == 0
    assert other["estimated_ttft_ms"] > chosen["estimated_ttft_ms"]

    second = chat(stack, messages, [doc])
    assert second.headers["x-prefixgate-prefill-node"] == d["prefill_node"]
    assert int(second.headers["x-prefixgate-cached-tokens"]) == d["predicted_cached_tokens"]


def test_lookup_takes_the_prompt_form_and_validates_like_the_client_api(stack: AdminStack) -> None:
    with stack.admin() as c:
        r = c.post("/admin/cache/lookup", json={"prompt": "Once upon a time " * 40})
        assert r.status_code == 200
        assert [s["kind"] for s in r.json()["layout"]["segments"]] == ["prompt"]
        bad = c.post("/admin/cache/lookup", json={"model": MODEL, "prompt": "x", "max_tokens": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
        with stack.http() as client_api:
            same = client_api.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1})
        assert bad.json()["error"]["message"] == same.json()["error"]["message"]
        unknown = c.post("/admin/cache/lookup", json={"model": "nope", "prompt": "x"})
        assert unknown.status_code == 404
        assert c.post("/admin/cache/lookup", json={"stream": True}).status_code == 400


def test_evict_by_prompt_makes_the_next_request_compute_everything(stack: AdminStack) -> None:
    doc = {"id": "evict-me", "text": document(21, 2000)}
    messages = _messages("Summarise.")
    chat(stack, messages, [doc])
    warm = chat(stack, messages, [doc])
    assert warm.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 1900
    prefill = warm.headers["x-prefixgate-prefill-node"]
    with stack.admin() as c:
        r = c.post("/admin/cache/evict", json={"messages": messages, "documents": [doc]})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["requested_blocks"] == warm.json()["usage"]["prompt_tokens"] // 64
        assert out["nodes"][prefill]["evicted_blocks"] >= out["requested_blocks"]
        assert out["nodes"][prefill]["error"] is None
        assert len(out["nodes"]) == 4
        explained = c.post("/admin/cache/lookup", json={"messages": messages, "documents": [doc]}).json()
    assert all(n["hit_blocks"] == 0 for n in explained["nodes"])
    cold = chat(stack, messages, [doc])
    assert cold.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert cold.headers["x-prefixgate-cached-tokens"] == "0"


def test_evict_by_block_hashes_by_node_and_all(stack: AdminStack) -> None:
    doc = {"id": "hashes", "text": document(22, 1500)}
    messages = _messages("List the names.")
    first = chat(stack, messages, [doc])
    prefill = first.headers["x-prefixgate-prefill-node"]
    with stack.admin() as c:
        hashes = c.post("/admin/cache/lookup", json={"messages": messages, "documents": [doc]}).json()[
            "block_hashes"
        ]
        r = c.post("/admin/cache/evict", json={"node": prefill, "block_hashes": hashes[10:]})
        assert r.status_code == 200, r.text
        assert list(r.json()["nodes"]) == [prefill]
        assert r.json()["nodes"][prefill]["evicted_blocks"] == len(hashes) - 10
        left = c.post("/admin/cache/lookup", json={"messages": messages, "documents": [doc]}).json()
        assert next(n for n in left["nodes"] if n["id"] == prefill)["hit_blocks"] == 10
        assert c.post("/admin/cache/evict", json={"block_hashes": ["not-hex"]}).status_code == 400
        assert c.post("/admin/cache/evict", json={}).status_code == 400
        assert c.post("/admin/cache/evict", json={"node": "nope", "all": True}).status_code == 404
        everything = c.post("/admin/cache/evict", json={"all": True}).json()
        assert everything["all"] is True and everything["evicted_blocks"] >= 10
        cache = wait_until(lambda: (v := c.get("/admin/cache").json())["index"]["total_blocks"] == 0 and v)
    assert cache, "the index still holds blocks after evicting everything"
    again = chat(stack, messages, [doc])
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_cache_view_shows_occupancy_and_hit_ratios(stack: AdminStack) -> None:
    doc = {"id": "ratios", "text": document(23, 2500)}
    for q in ("One?", "Two?"):
        chat(stack, _messages(q), [doc])
    with stack.admin() as c:
        view = wait_until(
            lambda: (
                (v := c.get("/admin/cache").json())
                and any(n.get("used_blocks", 0) > 0 for n in v["nodes"])
                and v
            )
        )
    assert view["object"] == "cache" and view["index"]["backend"] == "memory"
    assert view["index"]["total_blocks"] > 0 and view["block_size"] == 64
    t = view["totals"]
    assert t["prompt_tokens"] > 0 and t["cached_tokens"] > 0 and t["requests"] >= 2
    assert 0 < t["hit_ratio_reported"] <= 1 and 0 < t["hit_ratio_predicted"] <= 1
    rows = {n["id"]: n for n in view["nodes"]}
    assert set(rows) == {"prefill-1", "prefill-2", "decode-1", "decode-2"}
    busy = [n for n in rows.values() if n["role"] == "prefill" and n["prompt_tokens"]]
    assert busy and all(n["capacity_blocks"] == 4096 for n in rows.values())
    assert any(n["hit_ratio_reported"] > 0 and n["index_blocks"] > 0 for n in busy)


def test_switches_all_off_serve_plain_monolithic(stack: AdminStack) -> None:
    off = {"disaggregation": False, "prefix_routing": False, "normalization": False}
    with stack.admin() as c:
        try:
            assert c.put("/admin/switches", json=off).json() == off
            assert c.get("/admin/switches").json() == off
            r = chat(stack, _messages("Plain please."))
            assert r.headers["x-prefixgate-route"] == "monolithic"
            assert r.headers["x-prefixgate-prefill-node"] == ""
            assert r.headers["x-prefixgate-decode-node"].startswith("decode-")
            bad = c.put("/admin/switches", json={"turbo": True})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "turbo"
            assert c.put("/admin/switches", json={"disaggregation": "yes"}).status_code == 400
        finally:
            restored = c.put("/admin/switches", json={k: True for k in off}).json()
    assert all(restored.values())
    assert chat(stack, _messages("Split again.")).headers["x-prefixgate-route"] == "disaggregated"


def test_a_drained_node_gets_no_new_work(stack: AdminStack) -> None:
    with stack.admin() as c:
        try:
            r = c.post("/admin/nodes/prefill-1/drain")
            assert r.status_code == 200 and r.json()["draining"] is True and r.json()["routable"] is False
            for i in range(4):  # fresh prompts would otherwise alternate between the two
                used = chat(stack, _messages(f"Fresh question {i} {document(40 + i, 30)}"))
                assert used.headers["x-prefixgate-prefill-node"] == "prefill-2"
            assert c.post("/admin/nodes/nope/drain").status_code == 404
        finally:
            undone = c.post("/admin/nodes/prefill-1/drain", json={"drain": False}).json()
    assert undone["draining"] is False and undone["routable"] is True


def test_nodes_are_added_and_removed_at_runtime(stack: AdminStack) -> None:
    node = spawn(["node", "--role", "prefill", "--node-id", "prefill-x", "--time-scale", "0.05"])
    try:
        ready = node.wait_for(r'"event": "node_ready".*"address": "([^"]+)"', timeout=30)
        address = ready.group(1)
        with stack.admin() as c:
            added = c.post("/admin/nodes", json={"role": "prefill", "address": address})
            assert added.status_code == 201, added.text
            assert added.json()["id"] == "prefill-x" and added.json()["reachable"] is True
            assert c.post("/admin/nodes", json={"role": "prefill", "address": address}).status_code == 409
            assert c.post("/admin/nodes", json={"role": "cook", "address": address}).status_code == 400
            assert c.post("/admin/nodes", json={"role": "decode", "address": "no port"}).status_code == 400
            ids = [n["id"] for n in c.get("/admin/nodes").json()["data"]]
            assert "prefill-x" in ids
            # Warm a prompt onto it: its KV events and the warm both reach the index.
            pin = c.post(
                "/admin/cache/pin",
                json={"prompt": document(50, 1000), "nodes": ["prefill-x"], "pin_seconds": 30},
            )
            assert pin.status_code == 200, pin.text
            assert pin.json()["nodes"][0]["node"] == "prefill-x"
            held = wait_until(
                lambda: next(n for n in c.get("/admin/nodes").json()["data"] if n["id"] == "prefill-x")["kv"][
                    "index_blocks"
                ]
            )
            assert held == pin.json()["blocks"] > 0
            gone = c.delete("/admin/nodes/prefill-x")
            assert gone.status_code == 200 and gone.json()["index_blocks_forgotten"] == held
            assert "prefill-x" not in [n["id"] for n in c.get("/admin/nodes").json()["data"]]
            assert "prefill-x" not in [n["id"] for n in c.get("/admin/cache").json()["nodes"]]
            assert c.delete("/admin/nodes/prefill-x").status_code == 404
    finally:
        node.stop()
    # The stack still serves on its own nodes.
    assert chat(stack, _messages("Still there?")).headers["x-prefixgate-route"] == "disaggregated"


def test_documents_registry(stack: AdminStack) -> None:
    text = document(60, 1500)
    with stack.http() as c:
        created = c.post("/v1/documents", json={"id": "policy-7", "text": text, "user": "alice"})
        assert created.status_code == 201 and created.json()["id"] == "policy-7"
        auto = c.post("/v1/documents", json={"text": "short note", "user": "alice"}).json()["id"]
        assert auto.startswith("doc-")
        assert c.get("/v1/documents/policy-7", params={"user": "alice"}).json()["text"] == text
        # Without API keys nobody is authenticated: one shared registry, 'user' selects nothing.
        assert c.get("/v1/documents/policy-7", params={"user": "bob"}).json()["text"] == text
        assert c.get("/v1/documents/policy-7").json()["text"] == text
        assert c.post("/v1/documents", json={"text": ""}).status_code == 400

        def ask(docs: dict[str, Any]) -> httpx.Response:
            body = {
                "model": MODEL,
                "messages": _messages("What is covered?"),
                "max_tokens": 4,
                "user": "alice",
            }
            return c.post("/v1/chat/completions", json={**body, **docs})

        by_id = ask({"document_ids": ["policy-7"]})
        assert by_id.status_code == 200, by_id.text
        inline = ask({"documents": [{"id": "policy-7", "text": text}]})
        # A registered document renders exactly like the same document sent inline.
        assert inline.json()["usage"]["prompt_tokens"] == by_id.json()["usage"]["prompt_tokens"]
        assert inline.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 1500 - 64

        assert c.delete("/v1/documents/policy-7", params={"user": "alice"}).json()["deleted"] is True
        assert c.get("/v1/documents/policy-7", params={"user": "alice"}).status_code == 404
        assert c.delete("/v1/documents/policy-7", params={"user": "alice"}).status_code == 404
        missing = ask({"document_ids": ["policy-7"]})
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "document_not_found"


def test_prefill_service_warms_the_node_the_request_then_uses(stack: AdminStack) -> None:
    doc = {"id": "warm", "text": document(70, 3000)}
    messages = _messages("Warm start?")
    with stack.http() as c:
        r = c.post("/v1/prefill", json={"model": MODEL, "messages": messages, "documents": [doc]})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["object"] == "prefill" and len(out["nodes"]) == 1
        warmed = out["nodes"][0]
        assert warmed["method"] == "prefill" and warmed["computed_tokens"] == out["prompt_tokens"]
        assert warmed["pinned_blocks"] == 0 and warmed["error"] is None
        bad = c.post("/v1/prefill", json={"model": MODEL, "prompt": "x", "pin_seconds": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "pin_seconds"
        chosen = c.post("/v1/prefill", json={"model": MODEL, "prompt": "x", "nodes": ["prefill-1"]})
        assert chosen.status_code == 403 and chosen.json()["error"]["code"] == "admin_only"  # admin API only
    used = chat(stack, messages, [doc])
    assert used.headers["x-prefixgate-prefill-node"] == warmed["node"]
    assert used.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == out["blocks"] * 64


def test_pin_on_several_nodes_shows_in_the_cache_view(stack: AdminStack) -> None:
    prompt = document(80, 1280)
    with stack.admin() as c:
        r = c.post("/admin/cache/pin", json={"prompt": prompt, "nodes": 2, "pin_seconds": 60})
        assert r.status_code == 200, r.text
        nodes = r.json()["nodes"]
        assert sorted(n["node"] for n in nodes) == ["prefill-1", "prefill-2"]
        blocks = r.json()["blocks"]
        assert blocks == r.json()["prompt_tokens"] // 64 == 20
        assert all(n["pinned_blocks"] == blocks and n["pinned_until"] for n in nodes)
        rows = {n["id"]: n for n in c.get("/admin/cache").json()["nodes"]}
        assert rows["prefill-1"]["pinned_blocks"] >= blocks and rows["prefill-2"]["pinned_blocks"] >= blocks
        # Pinning what is already there only pins (no prefill).
        again = c.post("/admin/cache/pin", json={"prompt": prompt, "nodes": 2, "pin_seconds": 1})
        assert {n["method"] for n in again.json()["nodes"]} == {"pin"}
        assert c.post("/admin/cache/pin", json={"prompt": prompt}).status_code == 400  # pin_seconds required


def _families(text: str) -> dict[str, Any]:
    from prometheus_client.parser import text_string_to_metric_families

    return {f.name: f for f in text_string_to_metric_families(text)}


def test_metrics_show_ttft_prefill_transfer_and_hit_ratio(stack: AdminStack) -> None:
    doc = {"id": "metrics", "text": document(90, 2000)}
    for q in ("a?", "b?", "c?"):
        chat(stack, _messages(q), [doc])
    with stack.http() as c:
        fams = _families(c.get("/metrics").text)

    def value(family: str, sample: str, **labels: str) -> float:
        return float(
            sum(
                s.value
                for s in fams[family].samples
                if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
            )
        )

    assert value("prefixgate_ttft_seconds", "prefixgate_ttft_seconds_count", route="disaggregated") >= 3
    assert value("prefixgate_ttft_seconds", "prefixgate_ttft_seconds_sum") > 0
    for seg in ("queue", "prefill", "transfer", "first_token"):
        assert (
            value("prefixgate_ttft_segment_seconds", "prefixgate_ttft_segment_seconds_count", segment=seg)
            >= 3
        )
    assert value("prefixgate_prefill_seconds", "prefixgate_prefill_seconds_count") >= 3
    assert value("prefixgate_prefill_seconds", "prefixgate_prefill_seconds_sum") > 0
    assert value("prefixgate_kv_transfer_seconds", "prefixgate_kv_transfer_seconds_count") >= 3
    assert value("prefixgate_kv_transfer_seconds", "prefixgate_kv_transfer_seconds_sum") > 0
    assert value("prefixgate_kv_transfer_bytes", "prefixgate_kv_transfer_bytes_total") > 0
    assert value("prefixgate_cache_hit_ratio", "prefixgate_cache_hit_ratio", source="reported") > 0
    assert value("prefixgate_cache_hit_ratio", "prefixgate_cache_hit_ratio", source="predicted") > 0
    assert value("prefixgate_cached_tokens", "prefixgate_cached_tokens_total") > 0
    assert value("prefixgate_computed_tokens", "prefixgate_computed_tokens_total") > 0
    assert value("prefixgate_requests", "prefixgate_requests_total", route="disaggregated", outcome="ok") >= 3
    assert "prefixgate_retries" in fams and "prefixgate_fallbacks" in fams
    assert (
        value("prefixgate_index_lookup_seconds", "prefixgate_index_lookup_seconds_count", backend="memory")
        >= 3
    )
    breaker = {s.labels["node"]: s.value for s in fams["prefixgate_node_breaker_state"].samples}
    assert breaker == {"prefill-1": 0, "prefill-2": 0, "decode-1": 0, "decode-2": 0}
    assert {s.labels["node"] for s in fams["prefixgate_node_queued_requests"].samples} == set(breaker)
    assert value("prefixgate_node_kv_capacity_blocks", "prefixgate_node_kv_capacity_blocks") == 4 * 4096
    assert value("prefixgate_index_blocks", "prefixgate_index_blocks") > 0
    assert value("prefixgate_index_total_blocks", "prefixgate_index_total_blocks") > 0


def test_keyless_mode_says_so_and_shares_one_tenant(stack: AdminStack) -> None:
    started = [line for line in stack.log_lines() if line.get("event") == "gateway_started"]
    assert started and started[0]["auth"].startswith("none: no API keys, so no tenant isolation")
    doc = {"id": "shared-note", "text": document(61, 600)}
    messages = _messages("Who can see this?")
    with stack.http() as c:
        assert c.post("/v1/documents", json={**doc, "user": "alice"}).status_code == 201
        first = c.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": messages, "document_ids": ["shared-note"], "user": "alice"},
        )
        assert first.status_code == 200, first.text
        # Another 'user' is the same tenant: the same document, the same cache.
        second = c.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": messages, "document_ids": ["shared-note"], "user": "bob"},
        )
        assert second.status_code == 200, second.text
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 600 - 64
