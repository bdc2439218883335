"""Incremental detokenization: what streams out equals the whole decode, chunk boundaries never
split a character, stop strings and stop token ids end the text where they should."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from prefixgate.backends.hftok import TOKENIZER_DIR
from prefixgate.gateway.tokens.detokenize import Detokenizer, IncrementalDecoder, StopMatcher

TOK = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
VOCAB = TOK.get_vocab_size()
TEXTS = st.text(alphabet=st.sampled_from(list("ab é日本語🙂\n,.-<|>")), max_size=60)


def _chunks(ids: list[int], cuts: list[int]) -> list[list[int]]:
    points = sorted({c % (len(ids) + 1) for c in cuts} | {0, len(ids)})
    return [ids[a:b] for a, b in itertools.pairwise(points)]


@settings(max_examples=150, deadline=None)
@given(ids=st.lists(st.integers(0, VOCAB - 1), max_size=40), cuts=st.lists(st.integers(0, 64), max_size=8))
def test_deltas_concatenate_to_the_full_decode(ids: list[int], cuts: list[int]) -> None:
    dec = IncrementalDecoder(TOK)
    out = [dec.step(c) for c in _chunks(ids, cuts)]
    out.append(dec.flush())
    assert "".join(out) == TOK.decode(ids, skip_special_tokens=True)


@settings(max_examples=150, deadline=None)
@given(text=TEXTS, cuts=st.lists(st.integers(0, 64), max_size=8))
def test_no_chunk_ends_in_half_a_character(text: str, cuts: list[int]) -> None:
    ids = TOK.encode(text, add_special_tokens=False).ids
    dec = IncrementalDecoder(TOK)
    pieces = [dec.step(c) for c in _chunks(ids, cuts)] + [dec.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == TOK.decode(ids)


def test_a_multibyte_character_split_over_tokens_is_held_until_complete() -> None:
    ids = TOK.encode("日", add_special_tokens=False).ids
    assert len(ids) > 1  # byte-level: one character, several tokens
    dec = IncrementalDecoder(TOK)
    assert [dec.step([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert dec.step(ids[-1:]) == "日"


@settings(max_examples=150, deadline=None)
@given(
    text=TEXTS,
    stop=st.text(alphabet=st.sampled_from(list("ab é日")), min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 64), max_size=8),
)
def test_stop_strings_are_trimmed_across_chunks(text: str, stop: str, cuts: list[int]) -> None:
    ids = TOK.encode(text, add_special_tokens=False).ids
    full = TOK.decode(ids)
    d = Detokenizer(TOK, stop=[stop])
    shown = ""
    for c in _chunks(ids, cuts):
        p = d.push(c)
        shown += p.text
        if p.stopped:
            break
    else:
        shown += d.finish().text
    if stop in full:
        assert shown == full[: full.index(stop)] and d.matched_stop == stop
    else:
        assert shown == full and d.matched_stop is None


def test_stop_matcher_holds_back_a_possible_start_and_releases_it() -> None:
    m = StopMatcher(["STOP"])
    assert m.feed("abc ST") == "abc "
    assert m.feed("AR") == "STAR"
    assert m.feed("x S") == "x "
    assert m.feed("TOP and more") == "" and m.matched == "STOP"
    assert m.feed("later") == "" and m.flush() == ""


def test_stop_token_id_hides_it_and_what_follows() -> None:
    ids = TOK.encode("hello world again", add_special_tokens=False).ids
    d = Detokenizer(TOK, stop_token_ids=[ids[2]])
    p = d.push(ids)
    assert p.stopped and p.matched_stop == ids[2]
    assert p.text == TOK.decode(ids[:2])
    assert d.push([1, 2]).text == ""
