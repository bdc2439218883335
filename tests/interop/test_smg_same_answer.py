"""Same answer: smg 1.13.0 and prefixgate, each in front of the same tiny-engine nodes over
``grpc://`` (the SMG engine protocol), greedy, give the same text token for token, in a single
pool and in PD (prefixgate run with smg's own worker flags); a repeated long prompt reports
``cached_tokens`` > 0 through prefixgate.

Both tokenize the same prompt text with the node's shipped tokenizer: ``/v1/completions`` with
the prompt already in the chat format, so no chat template differs between the two gateways.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI

from prefixgate.backends.hftok import TOKENIZER_DIR
from prefixgate.openai.normalize import render_chat
from tests.helpers import Proc, free_port, spawn
from tests.interop.test_smg_interop import HF, LONG, MODEL, _direct, _smg, nodes, smg_exe

__all__ = ["nodes", "smg_exe"]  # module fixtures shared with the smg interop test

PROMPT = f"<|im_start|>user\n{LONG}<|im_end|>\n<|im_start|>assistant\n"


def _gateway(*workers: str) -> Iterator[tuple[Proc, str]]:
    port = free_port()
    argv = ["gateway", "--port", str(port), "--model", MODEL, "--block-size", "16", *workers]
    env = {"PREFIXGATE_TOKENIZER": f"hf:{TOKENIZER_DIR / 'tokenizer.json'}"}
    proc = spawn(argv, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.proc.poll() is not None:
                break
            time.sleep(0.2)
        else:
            raise TimeoutError("\n".join(list(proc.lines)[-30:]))
        yield proc, base
    finally:
        proc.stop(timeout=15)


def _completion(base: str, stream: bool) -> tuple[str, int]:
    client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
    if not stream:
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
        cached = (
            r.usage.prompt_tokens_details.cached_tokens if r.usage and r.usage.prompt_tokens_details else 0
        )
        return r.choices[0].text, cached or 0
    parts, cached = [], 0
    for chunk in client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices:
            parts.append(chunk.choices[0].text)
        if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
    return "".join(parts), cached


def _same_answer(smg_base: str, pg_base: str) -> None:
    theirs = _completion(smg_base, stream=False)[0]
    assert len(HF.encode(theirs, add_special_tokens=False).ids) >= 8  # greedy, 12 tokens asked
    print(f"smg and prefixgate: {theirs!r}")
    for stream in (False, True):
        ours, _ = _completion(pg_base, stream)
        assert ours == theirs, (stream, ours, theirs)
        assert (
            HF.encode(ours, add_special_tokens=False).ids == HF.encode(theirs, add_special_tokens=False).ids
        )
    _, cached = _completion(pg_base, stream=False)
    assert cached > 0  # the repeated long prompt hit the node's prefix cache


def _chat_through_prefixgate(pg_base: str, expected_node: str) -> None:
    """Chat too: the gateway's own rendering, answered as the node answers it directly."""
    messages = [{"role": "user", "content": "Say something about caches."}]
    rendered = render_chat(messages).text
    ids = HF.encode(rendered, add_special_tokens=False).ids
    client = OpenAI(base_url=f"{pg_base}/v1", api_key="unused", max_retries=0, timeout=60)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    assert r.choices[0].message.content == _direct_ids(expected_node, ids, 8)


def _direct_ids(address: str, ids: list[int], max_new: int) -> str:
    import grpc
    from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
    from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

    req = pb.GenerateRequest(
        request_id=f"direct-{time.monotonic_ns()}",
        tokenized=pb.TokenizedInput(input_ids=ids),
        sampling_params=pb.SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, max_new_tokens=max_new),
    )
    with grpc.insecure_channel(address) as ch:
        out = [m.complete for m in pb_grpc.SglangSchedulerStub(ch).Generate(req, timeout=30)]
    return str(HF.decode(list(out[-1].output_ids)))


@pytest.mark.slow
def test_single_pool_same_answer_as_smg(smg_exe: str, nodes: dict[str, dict[str, object]]) -> None:
    address = str(nodes["monolithic"]["address"])
    assert _direct(address, LONG, 12)  # the node serves
    smg_proc, smg_base = _smg(smg_exe, "--worker-urls", f"grpc://{address}", "--policy", "cache_aware")
    try:
        for _proc, pg_base in _gateway("--worker-urls", f"grpc://{address}"):
            _same_answer(smg_base, pg_base)
            _chat_through_prefixgate(pg_base, address)
    finally:
        smg_proc.stop(timeout=15)


@pytest.mark.slow
def test_pd_same_answer_as_smg(smg_exe: str, nodes: dict[str, dict[str, object]]) -> None:
    pre, dec = nodes["prefill"], nodes["decode"]
    flags = [
        "--prefill",
        f"grpc://{pre['address']}",
        str(pre["bootstrap_port"]),
        "--decode",
        f"grpc://{dec['address']}",
    ]
    smg_proc, smg_base = _smg(smg_exe, "--pd-disaggregation", *flags, "--policy", "cache_aware")
    try:
        for proc, pg_base in _gateway(*flags):
            _same_answer(smg_base, pg_base)
            r = httpx.post(
                f"{pg_base}/v1/completions",
                json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0},
                timeout=30,
            )
            assert r.headers["x-prefixgate-route"] == "disaggregated", r.headers
            assert int(r.headers["x-prefixgate-cached-tokens"]) > 0
            assert proc.proc.poll() is None
    finally:
        smg_proc.stop(timeout=15)
