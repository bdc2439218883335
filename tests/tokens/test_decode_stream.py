"""The incremental decoder on the ``tokenizers`` library's own ``DecodeStream``: for a
``tokenizers.Tokenizer`` the library does the steps, and the deltas are exactly those of the
window method (any other decoder's), chunk by chunk, whatever the ids: bytes that never complete,
skipped specials, unknown ids, a decoder that drops a leading space (Llama's and Mistral's, with
byte fallback), and a decoder whose text does not grow by appending (the library then raises;
the window goes on). The ids held back stay bounded on the library's path too."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models
from tokenizers.decoders import DecodeStream

from prefixgate.backends.hftok import TOKENIZER_DIR
from prefixgate.gateway.tokens.detokenize import PENDING_LIMIT, IncrementalDecoder, native_stream

TOK = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
VOCAB = TOK.get_vocab_size()
R = "\ufffd"
HAN = TOK.encode("日", add_special_tokens=False).ids
END = TOK.token_to_id("<|im_end|>") or 0
BYTES = [i for i in range(VOCAB) if TOK.id_to_token(i) is not None and R in TOK.decode([i])]
MIXED = st.sampled_from([*BYTES, END, VOCAB + 3, *TOK.encode("a b. Hello, 日本語 🙂").ids])


class Windowed:
    """A tokenizer as a plain decoder (not a ``tokenizers.Tokenizer``): decoded by windows."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return int(self.tok.get_vocab_size(with_added_tokens))

    def get_added_tokens_decoder(self) -> dict[int, Any]:
        return dict(self.tok.get_added_tokens_decoder())


def chunks(ids: list[int], cuts: list[int]) -> list[list[int]]:
    points = sorted({c % (len(ids) + 1) for c in cuts} | {0, len(ids)})
    return [ids[a:b] for a, b in itertools.pairwise(points)]


def deltas(dec: IncrementalDecoder, parts: list[list[int]]) -> list[str]:
    return [dec.step(p) for p in parts] + [dec.flush()]


def llama_like() -> tuple[Tokenizer, list[list[int]], list[int]]:
    """A SentencePiece-style vocabulary with byte fallback and Llama's decoder (``▁`` for a
    space, bytes fused into characters, the text's first space stripped): its tokenizer, units
    of whole text (words, a character's bytes) and byte ids alone."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    words = ("▁Hello", "▁world", "▁", "!", "▁a", "b", "▁日本")
    for w in words:
        vocab[w] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    chars = [[vocab[f"<0x{b:02X}>"] for b in c.encode()] for c in ("日", "é", "🙂")]
    return tok, [[vocab[w]] for w in words] + chars, sorted({t for c in chars for t in c})


LLAMA, LLAMA_UNITS, LLAMA_BYTES = llama_like()


def test_a_tokenizers_tokenizer_is_decoded_by_the_librarys_stream() -> None:
    assert native_stream() is not None  # the installed tokenizers has it
    assert IncrementalDecoder(TOK)._stream is not None
    assert IncrementalDecoder(Windowed(TOK))._stream is None


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(MIXED, max_size=120), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_the_librarys_steps_give_the_windows_deltas(ids: list[int], cuts: list[int]) -> None:
    parts = chunks(ids, cuts)
    native = IncrementalDecoder(TOK)
    assert deltas(native, parts) == deltas(IncrementalDecoder(Windowed(TOK)), parts)


@settings(max_examples=300, deadline=None)
@given(
    units=st.lists(st.sampled_from(LLAMA_UNITS), max_size=30),
    cuts=st.lists(st.integers(0, 100), max_size=10),
)
def test_a_decoder_dropping_the_first_space_streams_its_full_decode(
    units: list[list[int]], cuts: list[int]
) -> None:
    """One id a step (a streaming engine's chunks): the full decode, whole characters only. In
    larger chunks the library's path still gives the window method's deltas."""
    ids = [t for u in units for t in u]
    out = deltas(IncrementalDecoder(LLAMA), [[t] for t in ids])
    assert "".join(out) == LLAMA.decode(ids)
    assert all(R not in d for d in out)
    parts = chunks(ids, cuts)
    assert deltas(IncrementalDecoder(LLAMA), parts) == deltas(IncrementalDecoder(Windowed(LLAMA)), parts)


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.sampled_from([*LLAMA_BYTES, *(u[0] for u in LLAMA_UNITS[:7])]), max_size=60),
    cuts=st.lists(st.integers(0, 100), max_size=10),
)
def test_broken_bytes_under_byte_fallback_give_the_windows_deltas(ids: list[int], cuts: list[int]) -> None:
    """Byte fallback decodes a run of bytes whole (one broken byte turns the run's characters to
    U+FFFD), so no incremental decoder gives its full decode; the library's path gives the
    window method's text."""
    parts = chunks(ids, cuts)
    assert deltas(IncrementalDecoder(LLAMA), parts) == deltas(IncrementalDecoder(Windowed(LLAMA)), parts)


def test_held_ids_stay_bounded_on_the_librarys_path() -> None:
    streams = {
        "lead bytes": [HAN[0]] * 400,
        "continuation bytes": [HAN[2]] * 400,
        "two of three bytes": HAN[:2] * 200,
        "specials inside characters": [HAN[0], END, HAN[1], END] * 100,
    }
    for name, ids in streams.items():
        dec = IncrementalDecoder(TOK)
        shown = ""
        for t in ids:
            shown += dec.step([t])
            assert dec.held <= PENDING_LIMIT, name
        assert shown + dec.flush() == TOK.decode(ids), name


class Reversed:
    """A decoder whose text of more tokens does not begin with that of fewer (the tokens in
    reverse): the library's stream raises on it."""

    def decode_chain(self, tokens: list[str]) -> list[str]:
        return ["".join(reversed(tokens))]


def test_a_decoder_whose_text_does_not_grow_by_appending_still_decodes() -> None:
    tok = Tokenizer(models.WordLevel(vocab={"a": 0, "b": 1, "c": 2, "[UNK]": 3}, unk_token="[UNK]"))
    tok.decoder = decoders.Decoder.custom(Reversed())
    ids = [0, 1, 2, 0, 1]
    stream = DecodeStream(skip_special_tokens=True)
    with pytest.raises(Exception, match="prefix"):
        for t in ids:
            stream.step(tok, t)
    out = deltas(IncrementalDecoder(tok), [[t] for t in ids])
    assert out == deltas(IncrementalDecoder(Windowed(tok)), [[t] for t in ids])
