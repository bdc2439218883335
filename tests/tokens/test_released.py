"""Tokenizing a long text lets every other thread run meanwhile (the event loop's included), and
gives the ids ``encode`` gives."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from prefixgate.backends.hftok import TOKENIZER_DIR
from prefixgate.cachetier.tokenizer import RELEASED_FROM, hf_ids, hf_ids_many

HF = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
PIECES = st.sampled_from(
    [" ", "\n", "the", " cat", "9", "12.5", "é", "日本", "🙂", "<|im_start|>", "\t", "!!"]
)


@settings(max_examples=60, deadline=None)
@given(st.lists(PIECES, min_size=1, max_size=400).map("".join))
def test_the_same_ids_as_encode_on_both_sides_of_the_threshold(text: str) -> None:
    assert hf_ids(HF, text) == list(HF.encode(text, add_special_tokens=False).ids)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(PIECES, min_size=0, max_size=300).map("".join), min_size=0, max_size=6))
def test_a_batch_gives_each_texts_own_ids(texts: list[str]) -> None:
    assert hf_ids_many(HF, texts) == [hf_ids(HF, t) for t in texts]


def _wakeups_while(work: Callable[[], object]) -> tuple[int, float, float]:
    """While ``work`` ran on another thread: how often this thread woke from 1 ms sleeps, how long
    the work took, and the longest stretch this thread could not run."""
    done = threading.Event()

    def run() -> None:
        work()
        done.set()

    thread = threading.Thread(target=run)
    t0 = last = time.perf_counter()
    thread.start()
    wakeups = 0
    longest = 0.0
    while not done.is_set():
        time.sleep(0.001)
        now = time.perf_counter()
        longest = max(longest, now - last)
        last = now
        wakeups += 1
    thread.join()
    return wakeups, time.perf_counter() - t0, longest


def test_a_long_text_is_tokenized_with_the_gil_released() -> None:
    rng = random.Random(7)
    text = " ".join(f"word{rng.randrange(100_000)}" for _ in range(80_000))  # ~200K tokens
    assert len(text) >= RELEASED_FROM
    _, held_s, held_gap = _wakeups_while(lambda: HF.encode(text, add_special_tokens=False))
    released, released_s, released_gap = _wakeups_while(lambda: hf_ids(HF, text))
    # ``encode`` keeps the GIL for its whole run: this thread cannot run for most of it; with the
    # GIL released it wakes every millisecond or so (a busy machine may still preempt it a while)
    assert held_s > 0.05 and released_s > 0.05, (held_s, released_s)
    assert held_gap > 0.5 * held_s, (held_gap, held_s)
    assert released >= 10 and released_gap < 0.5 * released_s, (released, released_gap, released_s)


def test_a_batch_of_long_texts_is_tokenized_with_the_gil_released() -> None:
    rng = random.Random(8)
    texts = [" ".join(f"word{rng.randrange(100_000)}" for _ in range(20_000)) for _ in range(4)]
    released, released_s, released_gap = _wakeups_while(lambda: hf_ids_many(HF, texts))
    assert released_s > 0.02 and released >= 5, (released, released_s)
    assert released_gap < 0.5 * released_s, (released_gap, released_s)
