"""Segment-cached tokenization equals a plain ``encode`` of the whole rendered prompt.

With the shipped tokenizer over random chats (hypothesis), and with tokenizers built so that a
naive cut (at the template's marker text, or before every added token) gives other ids.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from prefixgate.backends.hftok import TOKENIZER_DIR
from prefixgate.cachetier.tokenizer import pack_ids, unpack_ids
from prefixgate.gateway.tokens import EngineTokenizer, open_tokenizer_dir
from prefixgate.gateway.tokens.segments import SegmentCache, SegmentEncoder, added_tokens
from prefixgate.openai.normalize import Document

SHIPPED = open_tokenizer_dir(TOKENIZER_DIR, segment_cache_bytes=1 << 20)  # small: evictions happen
HF = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))

# Text that stresses BPE and the pre-tokenizer at segment edges: spaces, newlines, digits,
# punctuation, non-ASCII, the template's markers and pieces of them.
ALPHABET = st.sampled_from(
    [" ", "  ", "\n", "\n\n", "\t", "a", "the", " the", "Hello", "9", "12", ".", ",", "!", "'s", "é",
     "日本", "🙂", "<", "|", ">", "<|", "|>", "<|im_start|>", "<|im_end|>", "im_start", "\r\n", "\\"]
)  # fmt: skip
TEXT = st.lists(ALPHABET, max_size=24).map("".join)
ROLE = st.sampled_from(["system", "developer", "user", "assistant", "tool"])
MESSAGE = st.fixed_dictionaries({"role": ROLE, "content": TEXT})
DOC = st.builds(Document, st.sampled_from(["a", "b", "doc-1", "kb:7"]), TEXT)


def plain(text: str) -> list[int]:
    return list(HF.encode(text, add_special_tokens=False).ids)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    messages=st.lists(MESSAGE, min_size=1, max_size=6),
    docs=st.lists(DOC, max_size=3),
    normalize=st.booleans(),
)
def test_chat_ids_equal_a_plain_encode_of_the_rendered_chat(
    messages: list[dict[str, Any]], docs: list[Document], normalize: bool
) -> None:
    layout, tokens = SHIPPED.encode_chat(messages, documents=docs, normalize=normalize)
    assert unpack_ids(tokens) == plain(layout.text)
    # again, from the (warm) segment cache
    assert SHIPPED.encode_chat(messages, documents=docs, normalize=normalize)[1] == tokens
    # the layout's segments tile the rendered text
    raw = layout.text.encode()
    assert layout.segments[0].start == 0 and layout.segments[-1].end == len(raw)
    assert all(a.end == b.start for a, b in zip(layout.segments, layout.segments[1:], strict=False))


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.one_of(TEXT, st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])), max_size=9)
)
def test_any_text_encodes_as_a_plain_encode(parts: list[str]) -> None:
    text = "".join(parts)
    assert unpack_ids(SHIPPED.encode(text)) == plain(text)
    assert unpack_ids(SHIPPED.encode(text)) == plain(text)


def test_a_repeated_document_and_system_prefix_are_not_tokenized_again() -> None:
    tok = open_tokenizer_dir(TOKENIZER_DIR)
    doc = Document("manual", "Pages hold the tokens of a prefix. " * 400)
    system = {"role": "system", "content": "You answer from the manual only. " * 50}
    first = [system, {"role": "user", "content": "What is a page?"}]
    second = [system, {"role": "user", "content": "And what is a prefix?"}]
    tok.encode_chat(first, documents=[doc])
    before = tok.segment_stats.hit_bytes
    layout, tokens = tok.encode_chat(second, documents=[doc])
    reused = tok.segment_stats.hit_bytes - before
    assert reused >= len(doc.text) + len(system["content"])  # both came from the cache
    assert unpack_ids(tokens) == plain(layout.text)


def test_the_cache_is_bounded_by_bytes_and_skips_huge_segments() -> None:
    cache = SegmentCache(max_bytes=20_000)
    for i in range(200):
        cache.put(f"segment {i} " * 10, pack_ids(list(range(20))))
        assert cache.stats.bytes <= 20_000
    assert 0 < cache.stats.entries < 200
    assert cache.get("segment 199 " * 10) is not None and cache.get("segment 0 " * 10) is None
    cache.put("x" * 10_000, b"\0" * 4)  # over a quarter of the budget: not kept
    assert cache.get("x" * 10_000) is None


# -- tokenizers where a naive cut goes wrong ------------------------------------------------


def _bpe(merges: list[tuple[str, str]], alphabet: str) -> Tokenizer:
    vocab: dict[str, int] = {}
    for ch in alphabet:
        vocab.setdefault(ch, len(vocab))
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    return Tokenizer(models.BPE(vocab=vocab, merges=merges))


def _naive(tok: Tokenizer, text: str, markers: list[str]) -> list[int]:
    """Cut before every occurrence of any marker, encode the pieces alone."""
    cuts = sorted({i for m in markers for i in range(1, len(text)) if text.startswith(m, i)})
    bounds = [0, *cuts, len(text)]
    return [i for a, b in itertools.pairwise(bounds) for i in tok.encode(text[a:b]).ids]


def _encoder(tok: Tokenizer) -> SegmentEncoder:
    parsed = json.loads(tok.to_str())
    return SegmentEncoder(tok, added_tokens(parsed), 1 << 20)


def test_merges_across_the_template_markers_are_kept_when_the_markers_are_plain_text() -> None:
    # No pre-tokenizer and "\n<" merges: the markers are ordinary text here, so cutting at them
    # would split a merged token.
    alphabet = "<|>_\nabcdeimnorstuy"
    tok = _bpe([("\n", "<"), ("<", "|"), ("\n<", "|"), ("y", "\n")], alphabet)
    text = "<|im_start|>user\nhey\n<|im_end|>\n<|im_start|>assistant\n"
    markers = ["<|im_start|>", "<|im_end|>"]
    full = tok.encode(text).ids
    assert _naive(tok, text, markers) != full  # a naive cut really breaks it
    enc = _encoder(tok)
    assert not enc.finder.active  # no added tokens: nowhere safe to cut
    assert unpack_ids(enc.encode(text)) == full


def test_no_cut_before_a_token_that_takes_the_whitespace_before_it() -> None:
    tok = _bpe([(" ", " "), ("h", "i")], " hi<|>_adenmst")
    tok.add_special_tokens([AddedToken("<|im_end|>", lstrip=True), AddedToken("<|im_start|>")])
    text = "<|im_start|>hi   <|im_end|> hi  <|im_start|>hi"
    full = tok.encode(text, add_special_tokens=False).ids
    assert _naive(tok, text, ["<|im_end|>", "<|im_start|>"]) != full
    enc = _encoder(tok)
    assert enc.finder.cuts(text) == [text.index("<|im_start|>", 1)]
    assert unpack_ids(enc.encode(text)) == full
    assert unpack_ids(enc.encode(text)) == full  # from the cache


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", " ", "  ", "ab", "<s>", "</s>", "\n", "é"]), max_size=16))
def test_a_prepend_first_metaspace_tokenizer_splits_at_its_special_tokens(parts: list[str]) -> None:
    # SentencePiece style: a leading "▁" only at the very start of the text, so a piece encoded
    # alone differs from the same piece after a special token; segments keep their special token.
    tok = _bpe([("▁", "a"), ("a", "b"), ("▁", "▁")], "▁abé\n")
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.add_special_tokens(["<s>", "</s>"])
    assert tok.encode("ab").ids != tok.encode("<s>ab").ids[1:]  # a piece alone is not the same
    enc = _encoder(tok)
    text = "".join(parts)
    assert unpack_ids(enc.encode(text)) == tok.encode(text, add_special_tokens=False).ids


def test_the_engine_tokenizer_reads_a_bundle_directory(tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((TOKENIZER_DIR / name).read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = EngineTokenizer(tmp_path)
    assert tok.name == SHIPPED.name  # named by content, not path
    assert tok.eos_token_ids == (2, 0) and tok.special_ids == {0, 1, 2}
    assert tok.special_tokens["eos_token"] == "<|im_end|>" and tok.bos_token_id is None


def test_a_tokenizer_that_would_truncate_or_pad_does_neither(tmp_path: Path) -> None:
    raw = json.loads((TOKENIZER_DIR / "tokenizer.json").read_text())
    raw["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
    raw["padding"] = {
        "strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None,
        "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>",
    }  # fmt: skip
    (tmp_path / "tokenizer.json").write_text(json.dumps(raw))
    tok = EngineTokenizer(tmp_path)
    text = "<|im_start|>user\n" + "the cache holds the prefix " * 10 + "<|im_end|>\n"
    assert unpack_ids(tok.encode(text)) == plain(text) and len(plain(text)) > 8
