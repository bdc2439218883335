"""The shipped Hugging Face tokenizer: reproducible from its build, usable by any HF client."""

from __future__ import annotations

import json
import zipfile
from io import BytesIO
from pathlib import Path

from tokenizers import Tokenizer

from prefixgate.backends.hftok import BUNDLE_FILES, TOKENIZER_DIR, bundle, load
from prefixgate.backends.hftok.build import build
from prefixgate.backends.sim import textgen


def _model(path: Path) -> dict[str, object]:
    data = json.loads((path / "tokenizer.json").read_text())
    return {"model": data["model"], "added": data["added_tokens"], "pre": data["pre_tokenizer"]}


def test_build_is_deterministic_and_matches_the_committed_files(tmp_path: Path) -> None:
    build(tmp_path / "a")
    build(tmp_path / "b")
    first, again = (tmp_path / d / "tokenizer.json" for d in "ab")
    assert first.read_bytes() == again.read_bytes()
    assert _model(tmp_path / "a") == _model(TOKENIZER_DIR)
    for name in ("tokenizer_config.json", "config.json"):
        assert (tmp_path / "a" / name).read_text() == (TOKENIZER_DIR / name).read_text()


def test_tokenizer_round_trips_text_and_has_a_chat_template() -> None:
    hf = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    text = "Hello there! Prefix caching makes long prompts cheap: 128K tokens, ünïcödé ✓."
    assert hf.decode(hf.encode(text, add_special_tokens=False).ids) == text
    config = json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in config["chat_template"] and config["eos_token"] == "<|im_end|>"
    tok = load()
    assert tok.vocab_size == 2048 and tok.texts[tok.eos_token_id] == ""
    assert hf.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False).ids[0] == 1


def test_every_simulated_word_is_one_token() -> None:
    tok = load()
    ids = [tok.id_of(w) for w in textgen.VOCAB]
    assert None not in ids and len(set(ids)) == len(ids)


def test_bundle_is_a_flat_zip_with_stable_bytes() -> None:
    data, sha = bundle()
    with zipfile.ZipFile(BytesIO(data)) as zf:
        assert sorted(zf.namelist()) == sorted(BUNDLE_FILES)
        assert zf.read("tokenizer.json") == (TOKENIZER_DIR / "tokenizer.json").read_bytes()
    assert len(sha) == 64
    bundle.cache_clear()
    assert bundle() == (data, sha)
