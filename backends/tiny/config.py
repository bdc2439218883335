"""The tiny model's shape and the ``--engine tiny[:key=value,...]`` spec that selects it. Pure.

The spec string travels unchanged from ``prefixgate up --engine`` to every node, so one flag
configures a whole stack: ``tiny`` is the default preset, ``tiny:preset=small`` the fast one
tests use, and any field can be overridden, e.g. ``tiny:seed=7,kv_dtype=f16``. Two nodes
exchange KV pages only when their configs (hence weights) and block sizes agree; the
fingerprint in ``backends.tiny.model`` enforces that.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

KV_DTYPES = {"f32": 4, "f16": 2}


@dataclass(frozen=True, slots=True)
class TinyConfig:
    """A decoder-only transformer: RoPE, grouped-query attention, RMSNorm, SwiGLU."""

    vocab: int = 4096  # input embedding rows; a token id is hashed onto one
    d_model: int = 128
    layers: int = 2
    heads: int = 8  # query heads
    kv_heads: int = 2  # key/value heads (grouped-query attention)
    ffn: int = 352  # SwiGLU hidden width
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    seed: int = 0  # weights are drawn from this seed
    kv_dtype: str = "f32"  # KV page dtype ("f32" or "f16"); compute is always float32

    def __post_init__(self) -> None:
        if min(self.vocab, self.d_model, self.layers, self.heads, self.kv_heads, self.ffn) < 1:
            raise ValueError(f"tiny config: every size must be >= 1: {self}")
        if self.d_model % self.heads:
            raise ValueError(f"tiny config: d_model {self.d_model} not divisible by heads {self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"tiny config: heads {self.heads} not divisible by kv_heads {self.kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"tiny config: head_dim {self.head_dim} must be even for rotary positions")
        if self.kv_dtype not in KV_DTYPES:
            choices = ", ".join(KV_DTYPES)
            raise ValueError(f"tiny config: kv_dtype must be one of {choices}, got {self.kv_dtype!r}")
        if self.seed < 0:
            raise ValueError(f"tiny config: seed must be >= 0, got {self.seed}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.heads // self.kv_heads

    @property
    def dtype_bytes(self) -> int:
        return KV_DTYPES[self.kv_dtype]

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    def describe(self) -> str:
        """Canonical text of the model's fields (part of its fingerprint). The KV dtype is left
        out: it is a field of the KV format of its own, so a mismatch names it plainly."""
        return ",".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.name != "kv_dtype")


PRESETS: dict[str, TinyConfig] = {
    "default": TinyConfig(),
    # Tests: the same architecture at a quarter of the width; a 64-token prefill is ~1 ms.
    "small": TinyConfig(vocab=512, d_model=64, layers=2, heads=8, kv_heads=2, ffn=128),
}

_INT_FIELDS = {"vocab", "d_model", "layers", "heads", "kv_heads", "ffn", "seed"}
_FLOAT_FIELDS = {"rope_theta", "norm_eps"}


def parse_engine_spec(spec: str) -> TinyConfig:
    """``tiny`` / ``tiny:preset=small,seed=3,kv_dtype=f16`` -> config; ValueError when malformed."""
    name, _, rest = spec.partition(":")
    if name.strip() != "tiny":
        raise ValueError(f"not a tiny engine spec: {spec!r}")
    items: dict[str, str] = {}
    for part in rest.split(","):
        if not part.strip():
            continue
        key, eq, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise ValueError(f"tiny engine spec: expected key=value, got {part!r} in {spec!r}")
        items[key] = value
    preset = items.pop("preset", "default")
    if preset not in PRESETS:
        raise ValueError(f"tiny engine spec: unknown preset {preset!r}: choose one of {', '.join(PRESETS)}")
    known = {"kv_dtype", *_INT_FIELDS, *_FLOAT_FIELDS}
    overrides: dict[str, Any] = {}
    for key, value in items.items():
        if key not in known:
            names = ", ".join(sorted({"preset", *known}))
            raise ValueError(f"tiny engine spec: unknown key {key!r}: known keys are {names}")
        try:
            if key in _INT_FIELDS:
                overrides[key] = int(value)
            elif key in _FLOAT_FIELDS:
                overrides[key] = float(value)
            else:
                overrides[key] = value
        except ValueError:
            raise ValueError(f"tiny engine spec: {key}={value!r} is not a valid value") from None
    return replace(PRESETS[preset], **overrides)
