"""Log probabilities and logit bias over ``grpc://``: ``prefixgate gateway`` (the worker flags and
nothing else) in front of our tiny-engine nodes (processes) over the SMG engine protocol, single
pool and PD. Greedy per-token log probabilities, streamed and not, whose tokens spell the content,
whose chosen token is the most likely alternative, and which are what the node itself answers over
gRPC for the same prompt ids; completions' ``logprobs: N``; a ``logit_bias`` of -100 on the greedy
first token changes it, one outside the vocabulary is a 400 naming ``logit_bias``. Then the same
requests through ``smg`` with the same flags, compared with ours: chat log probabilities are the
same, entry for entry, streamed and not, single pool and PD; smg 1.13 renders none on
``/v1/completions`` and does not pass ``logit_bias`` on (the test says so and compares the rest)."""

from __future__ import annotations

import time
from typing import Any

import grpc
import httpx
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc
from transformers import PreTrainedTokenizerFast

from prefixgate.backends.hftok import TOKENIZER_DIR
from tests.interop.test_smg_interop import HF, MODEL, _smg, nodes, smg_exe
from tests.interop.test_smg_same_answer import _gateway

__all__ = ["nodes", "smg_exe"]  # module fixtures shared with the smg interop test

CHAT = [{"role": "user", "content": "Tell me about prefix caches and the KV pages they keep."}]
PROMPT = "<|im_start|>user\nTell me about prefix caches.<|im_end|>\n<|im_start|>assistant\n"
MAX = 8
TOP = 2


def _chat_ids() -> list[int]:
    """The prompt ids of ``CHAT`` as the model's template renders it (what both gateways send)."""
    hf = PreTrainedTokenizerFast.from_pretrained(str(TOKENIZER_DIR))
    text = hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    return list(hf(text, add_special_tokens=False)["input_ids"])


def _direct(address: str, ids: list[int]) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """The node's own greedy log probabilities for ``ids`` over gRPC: (id, logprob, top)."""
    req = pb.GenerateRequest(
        request_id=f"direct-{time.monotonic_ns()}",
        tokenized=pb.TokenizedInput(input_ids=ids),
        sampling_params=pb.SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, max_new_tokens=MAX),
        return_logprob=True,
        top_logprobs_num=TOP,
        logprob_start_len=-1,
    )
    with grpc.insecure_channel(address) as ch:
        done = [m.complete for m in pb_grpc.SglangSchedulerStub(ch).Generate(req, timeout=30)][-1]
    lp = done.output_logprobs
    return [
        (t, v, list(zip(top.token_ids, top.values, strict=True)))
        for t, v, top in zip(lp.token_ids, lp.token_logprobs, lp.top_logprobs, strict=True)
    ]


def _chat(base: str, stream: bool, **extra: Any) -> tuple[str, list[dict[str, Any]]]:
    """(content, logprobs.content entries) of a greedy chat."""
    body: dict[str, Any] = {"model": MODEL, "messages": CHAT, "max_tokens": MAX, "temperature": 0}
    body |= {"logprobs": True, "top_logprobs": TOP, "stream": stream, **extra}
    with httpx.Client(base_url=base, timeout=60) as http:
        if not stream:
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            return choice["message"]["content"], (choice["logprobs"] or {}).get("content") or []
        text, entries = "", list[dict[str, Any]]()
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                for c in httpx.Response(200, content=line[6:]).json()["choices"]:
                    text += c["delta"].get("content") or ""
                    entries += (c.get("logprobs") or {}).get("content") or []
        return text, entries


def _completion(base: str, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX, "temperature": 0, "logprobs": TOP, **extra}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json()["choices"][0])


def _check_chat(base: str, node: str) -> list[dict[str, Any]]:
    """The chat's log probabilities, checked against themselves and the node's own; returned."""
    direct = _direct(node, _chat_ids())
    whole: list[dict[str, Any]] = []
    for stream in (False, True):
        content, entries = _chat(base, stream)
        assert len(entries) == len(direct) == MAX, (stream, entries)
        assert "".join(e["token"] for e in entries) == content and content
        for e, (tid, value, top) in zip(entries, direct, strict=True):
            assert e["token"] == HF.decode([tid], skip_special_tokens=False)
            assert e["bytes"] == list(e["token"].encode())
            assert e["logprob"] == pytest.approx(value, abs=1e-6) and e["logprob"] <= 0
            assert len(e["top_logprobs"]) == TOP
            best = e["top_logprobs"][0]
            assert (best["token"], best["logprob"]) == (e["token"], e["logprob"])  # greedy: the top one
            assert [a["token"] for a in e["top_logprobs"]] == [
                HF.decode([t], skip_special_tokens=False) for t, _ in top
            ]
            assert [a["logprob"] for a in e["top_logprobs"]] == pytest.approx([v for _, v in top], abs=1e-6)
        whole = whole or entries
        assert entries == whole  # streamed: the same entries
    return whole


def _check_completion_and_bias(base: str) -> None:
    choice = _completion(base)
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == choice["text"] and len(lp["tokens"]) == MAX
    assert all(len(t) == TOP for t in lp["top_logprobs"])
    assert [max(t, key=t.get) for t in lp["top_logprobs"]] == lp["tokens"]
    assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(lp["tokens"][0])
    first = HF.encode(lp["tokens"][0], add_special_tokens=False).ids
    assert len(first) == 1
    biased = _completion(base, logit_bias={str(first[0]): -100})
    assert biased["logprobs"]["tokens"][0] != lp["tokens"][0]
    second_best = sorted(lp["top_logprobs"][0].items(), key=lambda kv: -kv[1])[1][0]
    assert biased["logprobs"]["tokens"][0] == second_best  # the runner-up takes its place
    r = httpx.post(
        f"{base}/v1/completions",
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "logit_bias": {str(HF.get_vocab_size()): 5}},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "logit_bias" and err["type"] == "invalid_request_error"
    assert "vocabulary" in err["message"]


def test_logprobs_and_logit_bias_over_grpc(nodes: dict[str, dict[str, object]]) -> None:
    mono = str(nodes["monolithic"]["address"])
    with _gateway("--worker-urls", f"grpc://{mono}") as (_proc, base):
        _check_chat(base, mono)
        _check_completion_and_bias(base)


def test_logprobs_and_logit_bias_over_grpc_pd(nodes: dict[str, dict[str, object]]) -> None:
    pre, dec = nodes["prefill"], nodes["decode"]
    flags = ["--pd-disaggregation", "--prefill", f"grpc://{pre['address']}", str(pre["bootstrap_port"])]
    flags += ["--decode", f"grpc://{dec['address']}"]
    with _gateway(*flags) as (_proc, base):
        r = httpx.post(
            f"{base}/v1/completions",
            json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "logprobs": 1},
            timeout=30,
        )
        assert r.headers["x-prefixgate-route"] == "disaggregated", r.text
        _check_chat(base, str(nodes["monolithic"]["address"]))  # same model: the same numbers
        _check_completion_and_bias(base)


def _flags(nodes: dict[str, dict[str, object]], pd: bool) -> list[str]:
    if not pd:
        return ["--worker-urls", f"grpc://{nodes['monolithic']['address']}"]
    pre, dec = nodes["prefill"], nodes["decode"]
    flags = ["--pd-disaggregation", "--prefill", f"grpc://{pre['address']}", str(pre["bootstrap_port"])]
    return [*flags, "--decode", f"grpc://{dec['address']}"]


def _same(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> None:
    """Entry by entry: the same tokens, bytes and alternatives, values equal to float32 rounding."""
    assert [e["token"] for e in ours] == [e["token"] for e in theirs]
    assert [e["bytes"] for e in ours] == [e["bytes"] for e in theirs]
    assert [e["logprob"] for e in ours] == pytest.approx([e["logprob"] for e in theirs], abs=1e-6)
    for a, b in zip(ours, theirs, strict=True):
        assert [t["token"] for t in a["top_logprobs"]] == [t["token"] for t in b["top_logprobs"]]
        assert [t["logprob"] for t in a["top_logprobs"]] == pytest.approx(
            [t["logprob"] for t in b["top_logprobs"]], abs=1e-6
        )


@pytest.mark.slow
@pytest.mark.parametrize("pd", [False, True], ids=["single", "pd"])
def test_logprobs_same_as_smg(
    smg_exe: tuple[str, ...], nodes: dict[str, dict[str, object]], pd: bool
) -> None:
    flags = _flags(nodes, pd)
    smg_proc, smg_base = _smg(smg_exe, *flags)
    try:
        with _gateway(*flags) as (_proc, base):
            for stream in (False, True):
                their_text, theirs = _chat(smg_base, stream)
                if not theirs:
                    pytest.skip(f"smg does not serve chat log probabilities over grpc (stream={stream})")
                ours_text, ours = _chat(base, stream)
                assert ours_text == their_text
                _same(ours, theirs)
            theirs_c, ours_c = _completion(smg_base), _completion(base)
            assert ours_c["text"] == theirs_c["text"]
            if theirs_c.get("logprobs"):
                assert ours_c["logprobs"]["tokens"] == theirs_c["logprobs"]["tokens"]
            else:  # smg 1.13 asks the engine for them but renders none on /v1/completions
                print("smg renders no completions log probabilities; ours:", ours_c["logprobs"]["tokens"])
            first = HF.encode(ours_c["logprobs"]["tokens"][0], add_special_tokens=False).ids[0]
            bias = {"logit_bias": {str(first): -100}, "logprobs": None}
            theirs_b, ours_b = _completion(smg_base, **bias), _completion(base, **bias)
            assert ours_b["text"] != ours_c["text"]
            if theirs_b["text"] == theirs_c["text"]:  # smg 1.13 sends the engine an empty logit_bias
                print(
                    "smg ignores logit_bias over grpc:", repr(theirs_b["text"]), "ours:", repr(ours_b["text"])
                )
            else:
                assert ours_b["text"] == theirs_b["text"]
    finally:
        smg_proc.stop(timeout=15)
