"""The tiny model itself: spec parsing, fingerprints, pages, the math, sampling, prefix reuse."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from prefixgate.backends.engine import DecodeJob, PrefillJob, Sampling
from prefixgate.backends.tiny import PRESETS, TinyEngine, make_engine, parse_engine_spec
from prefixgate.backends.tiny import sampling as smp
from prefixgate.backends.tiny.kvcache import KVCache
from prefixgate.backends.tiny.model import TinyModel, load_model
from prefixgate.backends.tiny.runs import chunk_bounds
from prefixgate.backends.tiny.vocab import OUTPUT_CLASSES, OUTPUT_IDS, embedding_rows, token_ids, token_text
from tests.tiny.support import BS, SMALL, make_prompt

CFG = PRESETS["small"]


def test_spec_parsing() -> None:
    assert parse_engine_spec("tiny") == PRESETS["default"]
    assert parse_engine_spec("tiny:preset=small") == CFG
    c = parse_engine_spec("tiny:preset=small, seed=7 ,kv_dtype=f16,rope_theta=500")
    assert (c.seed, c.kv_dtype, c.rope_theta, c.d_model) == (7, "f16", 500.0, CFG.d_model)
    for bad, msg in [
        ("tiny:preset=huge", "unknown preset"),
        ("tiny:colour=red", "unknown key"),
        ("tiny:layers=two", "not a valid value"),
        ("tiny:seed", "key=value"),
        ("tiny:kv_dtype=bf16", "kv_dtype"),
        ("tiny:heads=3", "divisible"),
        ("sim", "not a tiny"),
    ]:
        with pytest.raises(ValueError, match=msg):
            parse_engine_spec(bad)


def test_kv_format_and_fingerprint() -> None:
    e = make_engine(SMALL, block_size=BS)
    f = e.kv_format
    assert (f.block_size, f.dtype, f.layout) == (BS, "f32", "tiny:layer,kv,kv_head,token,head_dim")
    assert f.bytes_per_token == CFG.layers * 2 * CFG.kv_heads * CFG.head_dim * 4
    assert f.model_fingerprint == make_engine(SMALL, block_size=BS).kv_format.model_fingerprint
    others = {
        make_engine(spec, block_size=BS).kv_format.model_fingerprint
        for spec in (f"{SMALL},seed=1", f"{SMALL},rope_theta=500", "tiny", f"{SMALL},layers=3")
    }
    assert len(others) == 4 and f.model_fingerprint not in others
    half = make_engine(f"{SMALL},kv_dtype=f16", block_size=BS).kv_format
    assert half.dtype == "f16" and half.bytes_per_token * 2 == f.bytes_per_token
    assert half.model_fingerprint == f.model_fingerprint  # same weights; the dtype field differs
    assert e.transfer_floor_seconds(1 << 30) == 0 and e.time_scale == 1.0
    assert e.prefill_seconds(1024, 0) > 0  # the calibrated cpu profile


def test_output_vocabulary_is_the_shipped_tokenizer() -> None:
    """Output ids are the shipped tokenizer's, and their texts are its decode of them."""
    from tokenizers import Tokenizer

    from prefixgate.backends.hftok import TOKENIZER_DIR, load

    hf = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    tok = load()
    assert OUTPUT_IDS[0] == tok.eos_token_id and token_text(int(OUTPUT_IDS[0])) == ""
    assert OUTPUT_CLASSES == 1 + len(tok.clean_ids()) and len(set(OUTPUT_IDS.tolist())) == OUTPUT_CLASSES
    ids = [int(t) for t in OUTPUT_IDS[1:]]
    assert "".join(token_text(t) for t in ids[::7]) == hf.decode(ids[::7])
    rows = embedding_rows(np.array([0, 1, 2, 0xFFFFFFFF], dtype=np.uint32), 512)
    assert rows.min() >= 0 and rows.max() < 512 and len(set(rows.tolist())) == 4


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_page_round_trip(dtype: str) -> None:
    cfg = replace(CFG, kv_dtype=dtype)
    a = KVCache(cfg, 40)
    rng = np.random.default_rng(0)
    for layer in range(cfg.layers):
        k = rng.standard_normal((cfg.kv_heads, 40, cfg.head_dim), dtype=np.float32)
        a.write(layer, 0, k, -k)
    a.length = 40
    pages = [a.page(0, 16), a.page(16, 32), a.page(32, 40)]
    assert [len(p) for p in pages] == [16 * cfg.kv_bytes_per_token] * 2 + [8 * cfg.kv_bytes_per_token]
    b = KVCache(cfg, 1)
    assert b.load_pages(pages) == 40
    assert np.array_equal(a.data[:, :, :, :40], b.data[:, :, :, :40])
    # Layout: layer, kv, kv_head, token, head_dim.
    arr = np.frombuffer(pages[1], dtype="<f4" if dtype == "f32" else "<f2")
    arr = arr.reshape(cfg.layers, 2, cfg.kv_heads, 16, cfg.head_dim).astype(np.float32)
    assert np.array_equal(arr, a.data[:, :, :, 16:32])
    with pytest.raises(ValueError, match="whole number"):
        b.load(pages[0][:-1], 0)


def reference_logits(model: TinyModel, tokens: bytes) -> np.ndarray:
    """Textbook forward over the whole prompt at once (float64, full causal mask, repeated KV
    heads): checks the blocked, grouped, chunked implementation's arithmetic."""
    cfg, w = model.cfg, model.weights
    n, hd, h = len(tokens) // 4, cfg.head_dim, cfg.heads
    x = w.embed[embedding_rows(token_ids(tokens), cfg.vocab)].astype(np.float64)
    pos = np.arange(n, dtype=np.float64)[:, None] * model.inv_freq[None, :]
    cos, sin = np.cos(pos), np.sin(pos)

    def rope(t: np.ndarray) -> np.ndarray:  # (heads, n, hd)
        a, b = t[..., : hd // 2], t[..., hd // 2 :]
        return np.concatenate((a * cos - b * sin, b * cos + a * sin), axis=-1)

    def norm(v: np.ndarray, g: np.ndarray) -> np.ndarray:
        out: np.ndarray = v / np.sqrt((v * v).mean(-1, keepdims=True) + cfg.norm_eps) * g
        return out

    for lw in w.layers:
        qkv = norm(x, lw.attn_norm) @ lw.wqkv.astype(np.float64)
        q = rope(qkv[:, : h * hd].reshape(n, h, hd).transpose(1, 0, 2))
        k = rope(qkv[:, h * hd : (h + cfg.kv_heads) * hd].reshape(n, cfg.kv_heads, hd).transpose(1, 0, 2))
        v = qkv[:, (h + cfg.kv_heads) * hd :].reshape(n, cfg.kv_heads, hd).transpose(1, 0, 2)
        k, v = np.repeat(k, cfg.group, axis=0), np.repeat(v, cfg.group, axis=0)
        s = q @ k.transpose(0, 2, 1) / math.sqrt(hd)
        s[:, np.triu_indices(n, 1)[0], np.triu_indices(n, 1)[1]] = -np.inf
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        x = x + (p @ v).transpose(1, 0, 2).reshape(n, h * hd) @ lw.wo
        gu = norm(x, lw.mlp_norm) @ lw.w_gate_up
        gate, up = gu[:, : cfg.ffn], gu[:, cfg.ffn :]
        x = x + (gate / (1 + np.exp(-gate)) * up) @ lw.w_down
    out: np.ndarray = np.asarray(norm(x[-1], w.final_norm) @ w.head, dtype=np.float64)
    return out


@pytest.mark.parametrize("n", [1, 15, 53])
def test_chunked_forward_matches_textbook_attention(n: int) -> None:
    model = load_model(CFG)
    tokens, _ = make_prompt(n, salt=n)
    rows = embedding_rows(token_ids(tokens), CFG.vocab)
    cache = KVCache(CFG, n)
    logits = None
    for s, e in chunk_bounds(n, BS, 0):
        logits = model.forward(rows[s:e], cache, s, logits=e == n)
    assert logits is not None and logits.dtype == np.float32
    ref = reference_logits(model, tokens)
    assert np.allclose(logits, ref, rtol=1e-4, atol=1e-4), float(np.abs(logits - ref).max())
    assert float(np.std(ref)) > 0.5  # not a degenerate (constant) output distribution


def test_sampling() -> None:
    logits = np.array([0.0, 3.0, 1.0, 3.0, -2.0], dtype=np.float32)
    greedy = Sampling(temperature=0.0)
    assert smp.choose(logits, greedy, smp.rng(1)) == 1  # ties: lowest class
    narrow = Sampling(temperature=1.0, top_p=0.01)
    assert {smp.choose(logits, narrow, smp.rng(s)) for s in range(20)} == {1}
    warm = Sampling(temperature=1.0)
    g1, g2 = smp.rng(42), smp.rng(42)
    a = [smp.choose(logits, warm, g1) for _ in range(200)]
    assert a == [smp.choose(logits, warm, g2) for _ in range(200)]
    counts = np.bincount(a, minlength=5)
    assert counts[1] > counts[2] > counts[4] and counts[1] + counts[3] > 120
    assert smp.base_seed(b"abcd", Sampling(seed=-1)) == (1 << 64) - 1
    assert smp.base_seed(b"abcd", Sampling()) != smp.base_seed(b"abce", Sampling())


Prefilled = tuple[list[bytes], bytes, int, int]


async def run_prefill(
    e: TinyEngine, tokens: bytes, hashes: list[int], cached: list[bytes], s: Sampling
) -> Prefilled:
    out = await e.prefill(PrefillJob(tokens, hashes, len(cached), cached, s))
    return out.new_pages, out.tail_page, out.first_token, out.state


@pytest.mark.parametrize("n", [BS - 1, BS, BS + 1, 3 * BS + 5])
async def test_prefix_reuse_is_bit_identical(n: int) -> None:
    """Reusing any number of cached blocks gives the same pages, tail, first token and state."""
    e = make_engine(SMALL, block_size=BS)
    tokens, hashes = make_prompt(n, salt=n)
    s = Sampling(max_tokens=8, temperature=0.7, top_p=0.95)
    pages, tail, first, state = await run_prefill(e, tokens, hashes, [], s)
    assert len(pages) == n // BS and len(tail) == (n % BS) * e.kv_format.bytes_per_token
    for k in range(1, len(hashes) + 1):
        got = await run_prefill(e, tokens, hashes, pages[:k], s)
        assert got == (pages[k:], tail, first, state)
    # Warm only: no first token, same pages.
    warm = await e.prefill(PrefillJob(tokens, hashes, 0, [], s, first_token=False))
    assert warm.new_pages == pages and warm.first_token == 0


async def test_decode_depends_on_the_pages() -> None:
    e = make_engine(SMALL, block_size=BS)
    tokens, hashes = make_prompt(2 * BS + 3, salt=5)
    s = Sampling(max_tokens=20, temperature=0.0)
    pages, tail, first, state = await run_prefill(e, tokens, hashes, [], s)

    async def decode(pp: list[bytes]) -> list[int]:
        out: list[int] = []
        async for g in e.decode(DecodeJob(tokens, pp, first, state, s, 19)):
            out += g
        return out

    base = await decode([*pages, tail])
    assert len(base) == 19 and base == await decode([*pages, tail])
    # One layer's V of one block scaled: the continuation changes (the pages are really used).
    arr = np.frombuffer(pages[1], dtype="<f4").copy().reshape(CFG.layers, 2, CFG.kv_heads, BS, CFG.head_dim)
    arr[0, 1] *= 3.0
    assert await decode([pages[0], arr.tobytes(), tail]) != base
