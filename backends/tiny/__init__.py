"""The tiny engine: a small decoder-only transformer computed in numpy on the CPU.

``--engine tiny[:key=value,...]`` on a node (or ``prefixgate up --engine tiny``) serves the
same gRPC services as the simulated engine with real arithmetic: KV pages are the model's K and
V, so cache reuse and prefill -> decode transfer are checked by the tokens themselves.

- ``backends.tiny.engine.make_engine(spec, block_size=64, profile=None) -> TinyEngine``
- ``backends.tiny.config``: ``TinyConfig``, presets (``default``, ``small``), spec parsing
- ``backends.tiny.model``: weights and the forward pass; ``backends.tiny.kvcache``: pages
- ``backends.tiny.sampling``: greedy / seeded temperature + top-p; ``backends.tiny.vocab``: ids
"""

from prefixgate.backends.tiny.config import PRESETS, TinyConfig, parse_engine_spec
from prefixgate.backends.tiny.engine import TinyEngine, make_engine

__all__ = ["PRESETS", "TinyConfig", "TinyEngine", "make_engine", "parse_engine_spec"]
