"""The tiny transformer in numpy: seeded weights and a chunked forward pass. Pure (no I/O).

Architecture (Llama-style, float32): token embedding -> ``layers`` x [RMSNorm -> grouped-query
attention with rotary positions -> residual -> RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm ->
output head. Weights are drawn from ``numpy.random.PCG64(seed)``; the model fingerprint is a
digest of the config, the output vocabulary and the weight bytes, so two nodes agree on it
only when they would compute the same numbers.

Determinism across paths: the prompt is always computed in chunks aligned to KV blocks (one
chunk per block, the trailing partial block last). A fresh prefill, a prefill reusing cached
blocks and a full-hit prefill (which recomputes its last block) therefore run the very same
array operations, on the same shapes, over the same KV values, and give bit-identical logits
and KV, whatever the BLAS kernels do with different matrix shapes. Attention is computed per
chunk over all keys so far (query rows split so the score matrix stays under
``SCORE_BUDGET_BYTES``); softmax normalization is applied after the value product.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import xxhash
from numpy.typing import NDArray

from prefixgate.backends.tiny.config import TinyConfig
from prefixgate.backends.tiny.kvcache import KVCache
from prefixgate.backends.tiny.vocab import OUTPUT_CLASSES, VOCAB_DIGEST

F32 = np.float32
Array = NDArray[np.float32]
SCORE_BUDGET_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class LayerWeights:
    attn_norm: Array  # (d,)
    wqkv: Array  # (d, (heads + 2 kv_heads) * head_dim)
    wo: Array  # (heads * head_dim, d)
    mlp_norm: Array  # (d,)
    w_gate_up: Array  # (d, 2 ffn)
    w_down: Array  # (ffn, d)


@dataclass(frozen=True, slots=True)
class Weights:
    embed: Array  # (vocab, d)
    layers: tuple[LayerWeights, ...]
    final_norm: Array  # (d,)
    head: Array  # (d, OUTPUT_CLASSES)

    def arrays(self) -> list[Array]:
        out = [self.embed]
        for lw in self.layers:
            out += [lw.attn_norm, lw.wqkv, lw.wo, lw.mlp_norm, lw.w_gate_up, lw.w_down]
        return [*out, self.final_norm, self.head]


def init_weights(cfg: TinyConfig) -> Weights:
    """Deterministic weights: normal(0, 1/sqrt(fan_in)) matrices, norms near 1."""
    rng = np.random.Generator(np.random.PCG64(cfg.seed))
    d, hd = cfg.d_model, cfg.head_dim

    def mat(rows: int, cols: int) -> Array:
        return (rng.standard_normal((rows, cols), dtype=F32) * F32(1.0 / math.sqrt(rows))).astype(F32)

    def norm() -> Array:
        return (F32(1.0) + F32(0.1) * rng.standard_normal(d, dtype=F32)).astype(F32)

    embed = rng.standard_normal((cfg.vocab, d), dtype=F32)
    layers = tuple(
        LayerWeights(
            attn_norm=norm(),
            wqkv=mat(d, (cfg.heads + 2 * cfg.kv_heads) * hd),
            wo=mat(cfg.heads * hd, d),
            mlp_norm=norm(),
            w_gate_up=mat(d, 2 * cfg.ffn),
            w_down=mat(cfg.ffn, d),
        )
        for _ in range(cfg.layers)
    )
    final_norm = norm()
    head = mat(d, OUTPUT_CLASSES) * F32(4.0)  # peakier logits: sampled text is less uniform
    return Weights(embed, layers, final_norm, head.astype(F32))


EMBED_SLICE = 512  # positions an embedding computes at a time (the attention's scores bounded)


class TinyModel:
    """Weights plus the forward pass; shared by every engine in a process with the same config."""

    def __init__(self, cfg: TinyConfig) -> None:
        self.cfg = cfg
        self.weights = init_weights(cfg)
        hd = cfg.head_dim
        self.inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
        digest = xxhash.xxh3_64()
        digest.update(f"{cfg.describe()};vocab={VOCAB_DIGEST}".encode())
        for a in self.weights.arrays():
            digest.update(a.tobytes())
        self.digest = digest.hexdigest()

    @property
    def fingerprint(self) -> str:
        c = self.cfg
        return f"tiny:d{c.d_model}-l{c.layers}-h{c.heads}-kv{c.kv_heads}-v{c.vocab}:{self.digest}"

    # -- pieces --------------------------------------------------------------------------------

    def _rmsnorm(self, x: Array, w: Array) -> Array:
        ms = np.mean(np.square(x), axis=-1, keepdims=True)
        out: Array = (x * (F32(1.0) / np.sqrt(ms + F32(self.cfg.norm_eps))) * w).astype(F32, copy=False)
        return out

    def _rope(self, x: Array, start: int) -> Array:
        """Rotate (heads, T, head_dim) by absolute positions start..start+T-1 (halves layout)."""
        t = x.shape[1]
        angles = np.arange(start, start + t, dtype=np.float64)[:, None] * self.inv_freq[None, :]
        cos, sin = np.cos(angles).astype(F32), np.sin(angles).astype(F32)
        half = x.shape[2] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate((x1 * cos - x2 * sin, x2 * cos + x1 * sin), axis=-1)

    def _attention(self, q: Array, cache: KVCache, layer: int, start: int) -> Array:
        """Causal GQA of q (heads, T, hd) at positions start.. over the cache's keys [0, start+T)."""
        cfg = self.cfg
        t, hd = q.shape[1], cfg.head_dim
        end = start + t
        keys = cache.data[layer, 0, :, :end, :]  # (kv_heads, end, hd)
        values = cache.data[layer, 1, :, :end, :]
        qg = q.reshape(cfg.kv_heads, cfg.group, t, hd) * F32(1.0 / math.sqrt(hd))
        out = np.empty((cfg.kv_heads, cfg.group, t, hd), dtype=F32)
        rows = max(1, SCORE_BUDGET_BYTES // (cfg.heads * end * 4))
        for r0 in range(0, t, rows):
            r1 = min(t, r0 + rows)
            n = r1 - r0
            sub = qg[:, :, r0:r1, :].reshape(cfg.kv_heads, cfg.group * n, hd)
            scores = cache.scratch(cfg.heads * n * end).reshape(cfg.kv_heads, cfg.group * n, end)
            np.matmul(sub, keys.transpose(0, 2, 1), out=scores)
            # Query row i (position start+r0+i) sees keys up to start+r0+i.
            base = start + r0
            if base + 1 < end:
                mask = np.triu(np.full((n, end - base), -np.inf, dtype=F32), k=1)
                view = scores.reshape(cfg.kv_heads, cfg.group, n, end)
                view[..., base:] += mask
            np.subtract(scores, scores.max(axis=-1, keepdims=True), out=scores)
            np.exp(scores, out=scores)
            denom = scores.sum(axis=-1, keepdims=True)
            o = np.matmul(scores, values)  # (kv_heads, group*n, hd)
            o /= denom
            out[:, :, r0:r1, :] = o.reshape(cfg.kv_heads, cfg.group, n, hd)
        return out.reshape(cfg.heads, t, hd)

    # -- forward -------------------------------------------------------------------------------

    def embed(self, rows: NDArray[np.int64]) -> Array:
        """A sequence's embedding: its last layer's hidden states, normalized (the final norm)
        and mean-pooled, of unit length; ``d_model`` floats. Computed on a cache of its own,
        in slices of at most ``EMBED_SLICE`` positions."""
        cache = KVCache(self.cfg, len(rows))
        total = np.zeros(self.cfg.d_model, dtype=np.float64)
        for s in range(0, len(rows), EMBED_SLICE):
            hidden = self.forward(rows[s : s + EMBED_SLICE], cache, s, logits=False, hidden=True)
            assert hidden is not None
            total += hidden.sum(axis=0, dtype=np.float64)
        mean = total / max(1, len(rows))
        norm = float(np.linalg.norm(mean))
        out: Array = (mean / norm if norm > 0 else mean).astype(F32)
        return out

    def forward(
        self, rows: NDArray[np.int64], cache: KVCache, start: int, *, logits: bool, hidden: bool = False
    ) -> Array | None:
        """Run tokens (embedding rows) at positions start.. through the model, writing their KV
        into ``cache``; returns the last position's output logits when asked (``hidden``: every
        position's final-normed hidden state instead)."""
        cfg, w = self.cfg, self.weights
        t = len(rows)
        hd, h, kvh = cfg.head_dim, cfg.heads, cfg.kv_heads
        cache.ensure(start + t)
        x = w.embed[rows]  # (T, d)
        for li, lw in enumerate(w.layers):
            a = self._rmsnorm(x, lw.attn_norm)
            qkv = a @ lw.wqkv
            q = qkv[:, : h * hd].reshape(t, h, hd).transpose(1, 0, 2)
            k = qkv[:, h * hd : (h + kvh) * hd].reshape(t, kvh, hd).transpose(1, 0, 2)
            v = qkv[:, (h + kvh) * hd :].reshape(t, kvh, hd).transpose(1, 0, 2)
            q = self._rope(q, start)
            cache.write(li, start, self._rope(k, start), v)
            attn = self._attention(q, cache, li, start)
            x = x + attn.transpose(1, 0, 2).reshape(t, h * hd) @ lw.wo
            m = self._rmsnorm(x, lw.mlp_norm)
            gu = m @ lw.w_gate_up
            gate, up = gu[:, : cfg.ffn], gu[:, cfg.ffn :]
            act = gate / (F32(1.0) + np.exp(-gate)) * up  # SiLU(gate) * up
            x = x + act @ lw.w_down
        cache.length = max(cache.length, start + t)
        if hidden:
            normed: Array = self._rmsnorm(x, w.final_norm)
            return normed
        if not logits:
            return None
        last = self._rmsnorm(x[-1:], w.final_norm)
        scores: Array = (last @ w.head)[0]
        return scores


@lru_cache(maxsize=8)
def load_model(cfg: TinyConfig) -> TinyModel:
    """One model per config per process (nodes started in one process share the weights)."""
    return TinyModel(cfg)
