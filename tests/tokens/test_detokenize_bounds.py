"""The incremental decoder's cost and its out-of-vocabulary ids: every id costs about the same
whatever the engine sends (ids that add no text, a UTF-8 tail that never completes), and an id
the tokenizer does not know shows as U+FFFD where it stands, counted and logged once, never
raising."""

from __future__ import annotations

import itertools
import time
from typing import Any

import structlog
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from prefixgate.backends.hftok import TOKENIZER_DIR
from prefixgate.gateway.nodeclient.base import Prompt
from prefixgate.gateway.nodeclient.smg_common import GenerateStream, Output, SmgNodeClient, SmgOptions
from prefixgate.gateway.tokens.detokenize import PENDING_LIMIT, Detokenizer, IncrementalDecoder
from prefixgate.gateway.vocab import Stage
from prefixgate.openai.schema import Sampling

TOK = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
VOCAB = TOK.get_vocab_size()
R = "\ufffd"
N = 20_000
HAN = TOK.encode("日", add_special_tokens=False).ids  # three byte tokens: E6 97 A5
END = TOK.token_to_id("<|im_end|>") or 0
TEXT = TOK.encode("The quick brown fox, 日本語 and 🙂, jumps over the lazy dog.\n" * 800).ids[:N]
STREAMS: dict[str, list[int]] = {
    "text": TEXT,
    "skipped specials": [END] * N,
    "out of vocabulary": [VOCAB + 7] * N,
    "lead bytes": [HAN[0]] * N,  # each a character's start that the next one breaks
    "continuation bytes": [HAN[2]] * N,
    "two of three bytes": HAN[:2] * (N // 2),
    "specials inside characters": [HAN[0], END, HAN[1], END] * (N // 4),
}
# the byte tokens (each a non-ASCII byte), the specials and a few ASCII ones
BYTES = [i for i in range(VOCAB) if TOK.id_to_token(i) is not None and R in TOK.decode([i])]
MIXED = st.sampled_from([*BYTES, 0, 1, 2, *TOK.encode("a b.").ids])


class Counting:
    """The shipped tokenizer counting the ids it decodes, giving up past ``budget`` (a decoder
    that re-decodes a growing window fails here at once instead of running for seconds)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.work = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.work += len(ids)
        assert self.work <= self.budget, f"decoded {self.work} ids: the window grows"
        return TOK.decode(ids, skip_special_tokens=skip_special_tokens)


class CountingWithVocabulary(Counting):
    """The same, telling its vocabulary as ``tokenizers.Tokenizer`` does."""

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return TOK.get_vocab_size(with_added_tokens)

    def get_added_tokens_decoder(self) -> dict[int, Any]:
        return TOK.get_added_tokens_decoder()


def _one_by_one(dec: IncrementalDecoder, ids: list[int]) -> str:
    return "".join(dec.step([t]) for t in ids) + dec.flush()


def test_every_id_costs_a_bounded_decode_whatever_the_stream() -> None:
    for name, ids in STREAMS.items():
        _one_by_one(IncrementalDecoder(Counting(budget=40 * len(ids))), ids)  # bounded even blind
        text = _one_by_one(IncrementalDecoder(CountingWithVocabulary(budget=40 * len(ids))), ids)
        assert text == (R * len(ids) if name == "out of vocabulary" else TOK.decode(ids)), name


def test_twenty_thousand_ids_of_any_kind_decode_in_well_under_a_second_and_a_half() -> None:
    for name, ids in STREAMS.items():
        d = Detokenizer(TOK)
        start = time.thread_time()  # CPU time: other processes on the machine do not inflate it
        for i, t in enumerate(ids):
            d.push([t])
            if i % 500 == 0:
                assert time.thread_time() - start < 1.5, f"{name}: {i} ids took 1.5 s"
        d.finish()
        assert time.thread_time() - start < 1.5, name


def test_an_incomplete_tail_is_shown_once_ids_enough_follow() -> None:
    """Lead bytes broken by the next: each is a final U+FFFD, shown before the stream ends."""
    dec = IncrementalDecoder(TOK)
    shown = "".join(dec.step([HAN[0]]) for _ in range(40))
    assert shown == R * len(shown) and len(shown) >= 40 - PENDING_LIMIT
    assert shown + dec.flush() == TOK.decode([HAN[0]] * 40)


def test_a_character_completing_after_many_broken_bytes_still_shows() -> None:
    ids = [HAN[0]] * (PENDING_LIMIT + 3) + HAN
    assert _one_by_one(IncrementalDecoder(TOK), ids) == R * (PENDING_LIMIT + 3) + "日"


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(MIXED, max_size=200), cuts=st.lists(st.integers(0, 256), max_size=12))
def test_long_runs_of_bytes_and_specials_still_concatenate_to_the_full_decode(
    ids: list[int], cuts: list[int]
) -> None:
    points = sorted({c % (len(ids) + 1) for c in cuts} | {0, len(ids)})
    dec = IncrementalDecoder(TOK)
    out = [dec.step(ids[a:b]) for a, b in itertools.pairwise(points)] + [dec.flush()]
    assert "".join(out) == TOK.decode(ids)


@settings(max_examples=100, deadline=None)
@given(parts=st.lists(st.lists(MIXED, max_size=30), min_size=1, max_size=5))
def test_an_unknown_id_shows_as_one_replacement_between_what_decodes_around_it(
    parts: list[list[int]],
) -> None:
    bad = [VOCAB, VOCAB + 123, -1, 1 << 40]
    ids = [t for i, p in enumerate(parts) for t in ([bad[i % 4]] if i else []) + p]
    dec = IncrementalDecoder(TOK)
    assert _one_by_one(dec, ids) == R.join(TOK.decode(p) for p in parts)
    assert dec.out_of_vocabulary == len(parts) - 1


def test_out_of_vocabulary_ids_are_counted_and_shown_never_raising() -> None:
    a, b = TOK.encode("hi there", add_special_tokens=False).ids[:2]
    d = Detokenizer(TOK)
    piece = d.push([a, VOCAB + 5, b, -3, 1 << 40])
    assert piece.text == TOK.decode([a]) + R + TOK.decode([b]) + R + R
    assert d.out_of_vocabulary == 3 and d.first_out_of_vocabulary == VOCAB + 5
    assert d.finish().text == ""


def test_an_unknown_id_inside_a_character_breaks_it() -> None:
    d = Detokenizer(TOK)
    assert d.push([HAN[0], VOCAB]).text == R + R
    assert d.push(HAN[1:]).text + d.finish().text == R + R  # two stray continuation bytes


async def test_the_stream_logs_unknown_ids_once_and_log_probabilities_show_them() -> None:
    c = SmgNodeClient("grpc://127.0.0.1:9", "127.0.0.1:9", SmgOptions(codec=TOK))  # never dialled
    try:
        stream = GenerateStream(c, Prompt("req-7", b"", (), Sampling(max_tokens=8)), 5.0, Stage.GENERATE)
        stream.rid = "req-7-engine"
        stream._detok = stream.detokenizer(TOK)
        a = TOK.token_to_id("Ġthe") or 0
        assert TOK.decode([a]) == " the"
        with structlog.testing.capture_logs() as logs:
            first = stream.consume(Output(False, [a, VOCAB + 1], completion_tokens=2))
            second = stream.consume(Output(False, [VOCAB + 2, a], completion_tokens=4))
            last = stream.consume(Output(True, [], completion_tokens=4, finish_reason="stop"))
        assert first is not None and second is not None and last is not None
        assert first.text + second.text + last.text == " the" + R + R + " the"
        events = [e for e in logs if e["event"] == "smg_out_of_vocabulary_ids"]
        assert len(events) == 1 and events[0]["log_level"] == "warning"
        assert events[0]["first_id"] == VOCAB + 1 and events[0]["request_id"] == "req-7"
        lp = c.token_logprob((VOCAB + 3, -1.0, ((-1, -2.0), (a, -3.0))), 2)
        assert lp.text == R and lp.top == ((R, -2.0), (" the", -3.0))
    finally:
        await c.close()
