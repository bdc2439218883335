"""The shipped tokenizer's child processes, started and warm, for tests that use them."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

from prefixgate.backends.hftok import TOKENIZER_DIR
from prefixgate.gateway.tokenpool.pool import TokenizerPool

#: The sha256 of the shipped tokenizer.json: what the children must say they loaded.
DIGEST = hashlib.sha256((TOKENIZER_DIR / "tokenizer.json").read_bytes()).hexdigest()


@contextlib.contextmanager
def started_pool(processes: int, *, fast: bool = False) -> Iterator[TokenizerPool]:
    """A pool of ``processes`` children, every one ready, closed afterwards (``fast``: encoding
    by tiktoken, as a gateway's children do when it does)."""
    pool = TokenizerPool(TOKENIZER_DIR, DIGEST, processes, fast=fast)
    try:
        assert pool.start(wait_s=30)
        yield pool
    finally:
        pool.close()
