"""The Hugging Face tokenizer every node ships (``tokenizer.json`` + ``tokenizer_config.json``,
and a text-only model ``config.json`` that clients read to learn the model takes no media).

A byte-level BPE of 2048 ids trained by ``backends.hftok.build`` (deterministic; the files
beside this module are its output). The tiny engine's output vocabulary is this tokenizer's;
the simulated engine's 256 words are single tokens of it. Clients of the SMG engine protocol
load it from ``GetModelInfo.tokenizer_path`` or receive it as the ``GetTokenizer`` bundle.
"""

from __future__ import annotations

import hashlib
import io
import zipfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

TOKENIZER_DIR = Path(__file__).resolve().parent
BUNDLE_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json")
_ZIP_DATE = (2024, 1, 1, 0, 0, 0)  # fixed: the bundle's bytes (and sha256) depend on content only


@dataclass(frozen=True, slots=True)
class ShippedTokenizer:
    path: Path
    vocab_size: int
    eos_token_id: int  # <|im_end|>: ends a chat turn
    pad_token_id: int  # <|endoftext|>
    special_ids: frozenset[int]
    texts: tuple[str, ...]  # text of each id decoded alone ("" for special ids)

    def clean_ids(self) -> list[int]:
        """Ids whose text stands alone and shows (not empty, no partial UTF-8, no control
        characters but newline and tab, not special), in id order."""
        return [i for i, t in enumerate(self.texts) if i not in self.special_ids and _shows(t)]

    def id_of(self, text: str) -> int | None:
        """The id whose whole text is ``text`` (None when no single token is)."""
        return _text_index(self).get(text)


def _shows(text: str) -> bool:
    return bool(text) and "\ufffd" not in text and all(c.isprintable() or c in "\n\t" for c in text)


@lru_cache(maxsize=4)
def _text_index(tok: ShippedTokenizer) -> dict[str, int]:
    index: dict[str, int] = {}
    for i in tok.clean_ids():
        index.setdefault(tok.texts[i], i)
    return index


@lru_cache(maxsize=4)
def load(path: Path = TOKENIZER_DIR) -> ShippedTokenizer:
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(path / "tokenizer.json"))
    n = hf.get_vocab_size()
    found = (hf.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"))
    special = frozenset(i for i in found if i is not None)
    texts = tuple("" if i in special else str(hf.decode([i], skip_special_tokens=False)) for i in range(n))
    eos = hf.token_to_id("<|im_end|>")
    pad = hf.token_to_id("<|endoftext|>")
    if eos is None or pad is None:
        raise ValueError(f"{path}: tokenizer lacks <|im_end|> or <|endoftext|>")
    return ShippedTokenizer(path, n, eos, pad, special, texts)


@lru_cache(maxsize=4)
def bundle(path: Path = TOKENIZER_DIR) -> tuple[bytes, str]:
    """The ``GetTokenizer`` zip (flat names, deflated, fixed timestamps) and its sha256 hex."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name in BUNDLE_FILES:
            info = zipfile.ZipInfo(name, date_time=_ZIP_DATE)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, (path / name).read_bytes())
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()
