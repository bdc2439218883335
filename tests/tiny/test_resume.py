"""A resumed generation (``resumed``: the prompt followed by output a broken generation already
sent) continues token for token, and character for character, as the unbroken one.

What migration relies on (docs/faults.md, After the first token): broken after any chunk, the
text sent before plus the resumed run's text is the unbroken text, whole or split, greedy or
sampled, with a stop string held back across the break.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from prefixgate.backends.server import NodeServer
from prefixgate.cachetier.hashing import Namespace, block_hashes
from prefixgate.cachetier.tokenizer import pack_ids
from prefixgate.v1 import node_pb2
from tests.tiny.support import BS, make_prompt

SAMPLINGS: dict[str, dict[str, Any]] = {
    "greedy": {"max_tokens": 20, "temperature": 0.0},
    "seeded": {"max_tokens": 20, "temperature": 0.9, "top_p": 0.9, "seed": 99, "has_seed": True},
    "unseeded": {"max_tokens": 20, "temperature": 1.1},
}
BREAKS = 5  # the first chunk boundaries broken at


def _hashes(tokens: bytes) -> list[int]:
    return block_hashes(tokens, BS, Namespace("tiny-test", "t", BS).root())


async def _chunks(
    stub: Callable[[str], Any],
    m: NodeServer,
    p: NodeServer,
    d: NodeServer,
    whole: bool,
    tokens: bytes,
    sp: node_pb2.SamplingParams,
    resumed: int = 0,
) -> list[tuple[list[int], str, str]]:
    """(ids, text, finish) per streamed step, the prefill's first token a step of its own."""
    hashes = _hashes(tokens)
    if whole:
        req = node_pb2.GenerateRequest(
            request_id="r", tokens=tokens, block_hashes=hashes, sampling=sp, resumed=resumed
        )
        return [(list(c.token_ids), c.text, c.finish_reason) async for c in stub(m.address).Generate(req)]
    r = await stub(p.address).Prefill(
        node_pb2.PrefillRequest(
            request_id="r",
            tokens=tokens,
            block_hashes=hashes,
            sampling=sp,
            decode_address=d.address,
            resumed=resumed,
        )
    )
    call = stub(d.address).Decode(
        node_pb2.DecodeRequest(request_id="r", kv_handle=r.kv_handle, sampling=sp, resumed=resumed)
    )
    rest = [(list(c.token_ids), c.text, c.finish_reason) async for c in call]
    return [([r.first_token], r.first_text, r.finish_reason), *rest]


@pytest.mark.parametrize("whole", [True, False], ids=["whole", "split"])
@pytest.mark.parametrize("kind", list(SAMPLINGS))
async def test_resumed_generation_is_the_unbroken_one(
    nodes: Callable[..., Any], stub: Callable[[str], Any], kind: str, whole: bool
) -> None:
    m, p, d = await nodes("monolithic"), await nodes("prefill"), await nodes("decode")
    tokens, _ = make_prompt(2 * BS + 3, salt=7)
    plain = await _chunks(stub, m, p, d, whole, tokens, node_pb2.SamplingParams(**SAMPLINGS[kind]))
    text = "".join(t for _, t, _ in plain)
    assert len(text) > 8
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # ends the generation mid-way, spans tokens
    for stops in ([], [stop]):
        sp = node_pb2.SamplingParams(**SAMPLINGS[kind], stop=stops)
        unbroken = await _chunks(stub, m, p, d, whole, tokens, sp)
        ids = [t for c, _, _ in unbroken for t in c]
        want = "".join(t for _, t, _ in unbroken)
        for k in range(1, min(BREAKS, len(unbroken) - 1) + 1):
            sent_ids = [t for c, _, _ in unbroken[:k] for t in c]
            sent_text = "".join(t for _, t, _ in unbroken[:k])
            cont = tokens + pack_ids(sent_ids)
            left = node_pb2.SamplingParams()
            left.CopyFrom(sp)
            left.max_tokens = sp.max_tokens - len(sent_ids)  # what is left to generate
            rest = await _chunks(stub, m, p, d, whole, cont, left, resumed=len(sent_ids))
            assert sent_ids + [t for c, _, _ in rest for t in c] == ids, (kind, stops, k)
            assert sent_text + "".join(t for _, t, _ in rest) == want, (kind, stops, k)
            assert rest[-1][2] == unbroken[-1][2]
