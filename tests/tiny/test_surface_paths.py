"""Log probabilities, logit bias and choices on the tiny engine: the same on every path.

The first token's log probability comes from the prefill node (``PrefillResponse.first_logprob``),
the rest from the decode node's stream; a monolithic node computes both. Same tokens, same
numbers, whichever way the request went.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefixgate.backends.tiny.vocab import OUTPUT_IDS
from prefixgate.v1 import node_pb2
from tests.tiny.support import StartNode, make_prompt

Entry = tuple[int, float, tuple[tuple[str, float], ...]]


def entries(lps: Any) -> list[Entry]:
    return [(m.token_id, m.logprob, tuple((t.text, t.logprob) for t in m.top)) for m in lps]


async def mono(
    stub: Any, address: str, tokens: bytes, hashes: list[int], sp: Any
) -> tuple[list[int], list[Entry]]:
    req = node_pb2.GenerateRequest(request_id="m", tokens=tokens, block_hashes=hashes, sampling=sp)
    ids: list[int] = []
    lps: list[Entry] = []
    async for c in stub(address).Generate(req):
        ids += c.token_ids
        lps += entries(c.logprobs)
    return ids, lps


async def disagg(
    stub: Any, p: str, d: str, tokens: bytes, hashes: list[int], sp: Any
) -> tuple[list[int], list[Entry]]:
    r = await stub(p).Prefill(
        node_pb2.PrefillRequest(
            request_id="s", tokens=tokens, block_hashes=hashes, sampling=sp, decode_address=d
        )
    )
    ids, lps = [r.first_token], entries([r.first_logprob])
    async for c in stub(d).Decode(node_pb2.DecodeRequest(request_id="s", kv_handle=r.kv_handle, sampling=sp)):
        ids += c.token_ids
        lps += entries(c.logprobs)
    return ids, lps


async def test_logprobs_agree_across_paths(nodes: StartNode, stub: Callable[[str], Any]) -> None:
    m, p, d = await nodes("monolithic"), await nodes("prefill"), await nodes("decode")
    tokens, hashes = make_prompt(40, salt=77)
    sp = node_pb2.SamplingParams(
        max_tokens=10, temperature=0.8, seed=5, has_seed=True, logprobs=True, top_logprobs=2
    )
    ids, lps = await mono(stub, m.address, tokens, hashes, sp)
    assert len(lps) == len(ids) == 10 and [e[0] for e in lps] == ids
    assert all(v <= 0 and len(top) == 2 for _, v, top in lps)
    split_ids, split_lps = await disagg(stub, p.address, d.address, tokens, hashes, sp)
    assert split_ids == ids and split_lps == lps  # float32 on the wire both ways: equal
    plain = node_pb2.SamplingParams(max_tokens=10, temperature=0.8, seed=5, has_seed=True)
    plain_ids, plain_lps = await mono(stub, m.address, tokens, hashes, plain)
    assert plain_ids == ids and plain_lps == []  # asking for logprobs changes no token


async def test_bias_and_choices_on_both_paths(nodes: StartNode, stub: Callable[[str], Any]) -> None:
    m, p, d = await nodes("monolithic"), await nodes("prefill"), await nodes("decode")
    tokens, hashes = make_prompt(30, salt=78)
    forced = int(OUTPUT_IDS[11])
    sp = node_pb2.SamplingParams(max_tokens=6, temperature=0.0, logit_bias={forced: 100.0})
    assert (await mono(stub, m.address, tokens, hashes, sp))[0] == [forced] * 6
    assert (await disagg(stub, p.address, d.address, tokens, hashes, sp))[0] == [forced] * 6
    outs = []
    for choice in range(3):
        sp = node_pb2.SamplingParams(max_tokens=8, temperature=1.0, seed=9, has_seed=True, choice=choice)
        a = (await mono(stub, m.address, tokens, hashes, sp))[0]
        assert (await disagg(stub, p.address, d.address, tokens, hashes, sp))[0] == a
        outs.append(a)
    assert len({tuple(o) for o in outs}) == 3
