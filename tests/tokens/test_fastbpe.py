"""tiktoken encodes byte-level BPE only where it gives the tokenizer's own ids
(``cachetier.fastbpe``): the shipped tokenizer and byte-level vocabularies trained here (GPT-2's
pre-tokenizer, and Llama 3's Split regex, with and without ``ignore_merges``) give
``encode(text, add_special_tokens=False)`` 's ids on any text, added tokens included, in the
gateway and in its tokenizer processes; pipelines tiktoken cannot run, and a vocabulary on which
the two would differ, are refused with the reason and keep the ``tokenizers`` path."""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import cache
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

from prefixgate.backends.hftok import TOKENIZER_DIR
from prefixgate.cachetier import fastbpe
from prefixgate.cachetier.tokenizer import pack_ids
from prefixgate.gateway.tokenpool.pool import TokenizerPool
from prefixgate.gateway.tokens import open_tokenizer_dir
from tests.tokenpools import started_pool

SHIPPED = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
SHIPPED_JSON: dict[str, Any] = json.loads((TOKENIZER_DIR / "tokenizer.json").read_text())
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIALS = ["<|s|>", "<|e|>", "<|e|>x"]  # one a prefix of another: leftmost-longest decides
PIECES = st.sampled_from(
    [" ", "  ", "\n", "\r\n", "\t", "the", " cat", "It's", " 'LL", "9", "12.5", "1234567", "é", "ß",
     "日本", "🙂", "👨‍👩‍👧", "\u00a0", "\u200b", "!!", "...", "<|im_start|>", "<|im_end|>", "<|s|>",
     "<|e|>x", "<|e", "|>", "abcabcabc", "tokenization"]
)  # fmt: skip
TEXTS = st.one_of(st.lists(PIECES, max_size=80).map("".join), st.text(max_size=200))


def trained(split: str, ignore_merges: bool) -> Tokenizer:
    """A byte-level BPE trained here on the check corpus and ASCII noise, with added tokens."""
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    if split == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    trainer = trainers.BpeTrainer(
        vocab_size=900,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    noise = "".join(chr(33 + (i * 7919) % 94) + (" " if i % 5 == 0 else "") for i in range(20_000))
    tok.train_from_iterator([fastbpe.CHECK_CORPUS * 4, noise], trainer)
    return tok


@cache
def vocabularies() -> dict[str, tuple[Tokenizer, fastbpe.FastBPE]]:
    out = {}
    for split in ("gpt2", "llama3"):
        for ignore in (False, True):
            tok = trained(split, ignore)
            fast, why = fastbpe.build(json.loads(tok.to_str()), tok)
            assert fast is not None, f"{split}, ignore_merges={ignore}: refused: {why}"
            out[f"{split}-ignore_merges={ignore}"] = (tok, fast)
    fast, why = fastbpe.build(SHIPPED_JSON, SHIPPED)
    assert fast is not None, f"the shipped tokenizer was refused: {why}"
    out["shipped"] = (SHIPPED, fast)
    return out


@settings(max_examples=150, deadline=None)
@given(TEXTS)
def test_the_same_ids_as_the_tokenizer_on_any_text(text: str) -> None:
    for name, (tok, fast) in vocabularies().items():
        assert fast.ids(text) == tok.encode(text, add_special_tokens=False).ids, name
        assert fast.packed(text) == pack_ids(tok.encode(text, add_special_tokens=False).ids), name


def test_the_gateways_engine_tokenizer_takes_it_and_encodes_chats_as_the_tokenizer() -> None:
    tok = open_tokenizer_dir(TOKENIZER_DIR)
    assert tok.fast is not None and tok.segments.fast is tok.fast and tok.fast_refusal == ""
    assert tok.encoder_facts == {"encoder": "tiktoken"}  # what tokenizer_loaded logs
    chat = [
        {"role": "system", "content": "You are terse. It's fine.\n\n  Indented\tline"},
        {"role": "user", "content": "日本語 🙂 <|im_end|> 12345 done"},
    ]
    layout, ids = tok.encode_chat(chat)
    assert ids == pack_ids(SHIPPED.encode(layout.text, add_special_tokens=False).ids)


def with_(parsed: dict[str, Any], **changes: Any) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(json.dumps(parsed))
    for path, value in changes.items():
        *head, last = path.split("__")
        d = out
        for k in head:
            d = d[k]
        d[last] = value
    return out


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"normalizer": {"type": "NFC"}}, "normalizer"),
        (
            {"pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always"}},
            "pre-tokenizer",
        ),
        (
            {"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": True, "use_regex": True}},
            "pre-tokenizer",
        ),
        ({"model__dropout": 0.1}, "dropout"),
        ({"model__byte_fallback": True}, "byte fallback"),
        ({"model__continuing_subword_prefix": "##"}, "prefix"),
    ],
)
def test_pipelines_tiktoken_cannot_run_are_refused_with_the_reason(
    changes: dict[str, Any], reason: str
) -> None:
    fast, why = fastbpe.build(with_(SHIPPED_JSON, **changes), SHIPPED)
    assert fast is None and reason in why


def test_an_added_token_that_strips_is_refused() -> None:
    added = [dict(t) for t in SHIPPED_JSON["added_tokens"]]
    added[1]["lstrip"] = True
    fast, why = fastbpe.build(with_(SHIPPED_JSON, added_tokens=added), SHIPPED)
    assert fast is None and "<|im_start|>" in why


def test_ids_that_do_not_follow_the_merges_are_refused() -> None:
    merges = SHIPPED_JSON["model"]["merges"]
    swapped = [merges[1], merges[0], *merges[2:]]
    fast, why = fastbpe.build(with_(SHIPPED_JSON, model__merges=swapped), SHIPPED)
    assert fast is None and "rise" in why


def unreachable_vocabulary() -> dict[str, Any]:
    """'abc' is a token, but BPE on 'abc' merges 'b c' first and stops at ['a', 'bc']:
    tiktoken, which looks the whole piece up first, would say ['abc']."""
    chars = "".join(fastbpe.byte_chars())
    vocab = {c: i for i, c in enumerate(chars)}
    for t in ("bc", "ab", "abc"):
        vocab[t] = len(vocab)
    return {
        "version": "1.0",
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": True,
            "use_regex": True,
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": ["b c", "a b", "ab c"],
        },
    }


def test_a_vocabulary_where_the_two_would_differ_is_found_out_and_refused() -> None:
    parsed = unreachable_vocabulary()
    tok = Tokenizer.from_str(json.dumps(parsed))
    assert tok.encode("abc", add_special_tokens=False).tokens == ["a", "bc"]
    fast = fastbpe.compile_fast(parsed)  # what the checks of the pipeline alone would let through
    assert fast.ids("abc") != tok.encode("abc", add_special_tokens=False).ids
    refused, why = fastbpe.build(parsed, tok)
    assert refused is None and "differ" in why and "abc" in why


def test_a_refused_tokenizer_keeps_the_tokenizers_path(tmp_path: Any) -> None:
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer.json").write_text(json.dumps(unreachable_vocabulary()))
    tok = open_tokenizer_dir(d)
    assert tok.fast is None and tok.segments.fast is None and "differ" in tok.fast_refusal
    assert tok.encoder_facts == {"encoder": "tokenizers", "tiktoken_refused": tok.fast_refusal}
    assert (
        tok.encode_ids("abc abc")
        == Tokenizer.from_str(json.dumps(unreachable_vocabulary()))
        .encode("abc abc", add_special_tokens=False)
        .ids
    )


@pytest.fixture(scope="module")
def fast_pool() -> Iterator[TokenizerPool]:
    with started_pool(1, fast=True) as pool:
        yield pool


@settings(max_examples=40, deadline=None)
@given(st.lists(TEXTS, min_size=1, max_size=4))
def test_tokenizer_processes_started_fast_give_the_same_ids(
    fast_pool: TokenizerPool, texts: list[str]
) -> None:
    want = [pack_ids(SHIPPED.encode(t, add_special_tokens=False).ids) for t in texts]
    assert fast_pool.encode_many(texts) == want


def test_alternatives_that_need_no_backtracking_are_handed_to_the_automata_as_one_group() -> None:
    assert fastbpe.delegated(fastbpe.GPT2_PATTERN) == (
        r"(?:'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+)|\s+(?!\S)|\s+"
    )
    assert fastbpe.delegated(LLAMA3_SPLIT) == (
        r"(?:(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+)|\s+(?!\S)|\s+"
    )
    # a ``|`` in a class, a group or after a backslash does not split; a hard alternative
    # (lookahead, back-reference, possessive quantifier, atomic group) ends a run
    assert fastbpe.delegated(r"[|]|(a|b)|\||x(?=y)|c|d|\1|e|f++|g|(?>h)|i|j") == (
        r"(?:[|]|(a|b)|\|)|x(?=y)|(?:c|d)|\1|e|f++|g|(?>h)|(?:i|j)"
    )
    assert fastbpe.top_alternatives(r"[]|]|[^]|]|[a[b|c]]") == [r"[]|]", r"[^]|]", r"[a[b|c]]"]
    # unbalanced, or flags set without a group (they would end at a group made around them)
    for kept in (r"(a|b", r"a)|b", r"[a|b", r"(?i)a|b|c(?=d)|e", r"a|b(?x)|c(?=d)"):
        assert fastbpe.delegated(kept) == kept
    assert fastbpe.delegated(r"(?i:a|b)|\(?i\)|c|d(?=e)") == r"(?:(?i:a|b)|\(?i\)|c)|d(?=e)"
    assert fastbpe.delegated(r"\s+(?!\S)") == r"\s+(?!\S)"


@cache
def as_given_and_grouped() -> list[tuple[Any, ...]]:
    """tiktoken encoders of the shipped vocabulary over each pattern as written and as grouped."""
    import tiktoken

    added = {t["content"] for t in SHIPPED_JSON["added_tokens"]}
    ranks = fastbpe._ranks(SHIPPED_JSON["model"], added)
    return [
        tuple(
            tiktoken.Encoding(name, pat_str=p, mergeable_ranks=ranks, special_tokens={})
            for name, p in (("as-given", pattern), ("grouped", fastbpe.delegated(pattern)))
        )
        for pattern in (fastbpe.GPT2_PATTERN, LLAMA3_SPLIT)
    ]


@settings(max_examples=200, deadline=None)
@given(TEXTS)
def test_a_pattern_grouped_for_the_automata_encodes_any_text_as_before(text: str) -> None:
    # the shipped vocabulary's merges join bytes across a piece's edge, so pieces split
    # differently give other ids
    for as_given, grouped in as_given_and_grouped():
        assert grouped.encode_ordinary(text) == as_given.encode_ordinary(text)
