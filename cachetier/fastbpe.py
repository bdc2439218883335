"""Byte-level BPE encoded by ``tiktoken``, for the tokenizers where it gives the same ids.

Encoding new text is the largest cost of a request the gateway tokenizes itself (``grpc://``
workers): a 2 KB chat took 4.6 M of the 9.2 M instructions a request cost, and almost all of
those in the ``tokenizers`` pipeline's bookkeeping (a ``NormalizedString`` with an alignment a
character, offsets, token strings) rather than in BPE. ``tiktoken`` runs the same algorithm over
bytes with none of that: 3.4 times faster on 2 KB chats, 5 times on 512 KB, the GIL released.

The two are not the same algorithm in every case. ``tokenizers`` merges the adjacent pair with
the lowest merge rank; ``tiktoken`` the adjacent pair whose concatenation has the lowest rank,
and first looks a whole piece up in the vocabulary. They agree on the byte-level vocabularies
trained the usual way (GPT-2's, Llama 3's, Qwen's), where ids follow the merges, but that is a
property of a vocabulary, not a guarantee. So ``build`` takes this path only when:

- the pipeline is one ``tiktoken`` can run: no normalizer, a byte-level pre-tokenizer (its GPT-2
  regex, or a ``Split`` regex then byte-level without one), a BPE model without dropout, byte
  fallback or affixes, every byte a token, and merge results' ids rising with the merges (the
  ids are then the ranks);
- the added tokens strip nothing and match whole words nowhere (they are split out here, as
  ``tokenizers`` splits them out, leftmost-longest, unnormalized ones first);
- and both give the same ids for every vocabulary token's text and for a corpus of mixed text
  (prose, code, JSON, numbers, whitespace runs, accents, CJK, emoji, right-to-left scripts).

Otherwise ``build`` says why and the ``tokenizers`` pipeline is used, as before. The ids are
those of ``tokenizer.encode(text, add_special_tokens=False)`` either way (docs/tokens.md).
"""

from __future__ import annotations

import array
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

_LITTLE = sys.byteorder == "little"

# the regex of ``tokenizers``' ByteLevel pre-tokenizer with ``use_regex`` (GPT-2's)
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# Mixed text both encoders must agree on before this path is taken (with every vocabulary token).
CHECK_CORPUS = (
    "The quick brown fox jumps over the lazy dog. It's, they're, we've, I'm, you'll, he'd; "
    "IT'S THEY'RE WE'VE I'M YOU'LL HE'D. Don't stop—it's 3.14159, 1,000,000 or 2024-12-06T10:25:00Z.\n"
    "    def f(x: int) -> list[int]:\n        return [i ** 2 for i in range(x) if i % 3 != 0]  # squares\n"
    '{"id": "chatcmpl-123", "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}]}\n'
    "\t\ttabs\t and  double  spaces   and trailing spaces   \n\n\n\r\nCRLF line\r\n  \n"
    "naïve café résumé Übergröße façade coöperate Æsir ØRESUND ß ﬁ ligature\n"
    "日本語のテキストと中文文本，还有한국어 텍스트。Ελληνικά κείμενα, русский текст, עברית, العربية.\n"
    "emoji 👋🏽 👨‍👩‍👧‍👦 🇫🇷 ✅ ❤️ and symbols © ® ™ € £ ¥ ∑ ∫ √ ≠ ≤ ≥ → ⇒ ∞\n"
    "URLs https://example.com/a/b?c=d&e=f#g and emails someone@example.org, paths C:\\Users\\x\\y.txt\n"
    "numbers 0 00 007 12345678901234567890 3.0e-10 0xDEADBEEF 1_000 ½ ² ³ ٣ ४ \n"
    "<html><body class='x'>Hello &amp; goodbye</body></html> `code` **bold** _it_ ~~s~~ | a | b |\n"
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa ............................ ----------------------\n"
    "!!!??? ... ,,, ;;; ::: ''' \"\"\" ((( ))) [[[ ]]] {{{ }}} <<< >>> /// \\\\\\ ||| ___ +++ === ***\n"
    " leading space, \u00a0no-break space, \u2003em space, \u200bzero width, \u3000ideographic space\n"
)


def _byte_chars() -> dict[str, int]:
    """The byte-level alphabet: the character standing for each byte, to the byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = dict.fromkeys(printable, 0)
    out: dict[str, int] = {chr(b): b for b in printable}
    n = 0
    for b in range(256):
        if b not in chars:
            out[chr(256 + n)] = b
            n += 1
    return out


@lru_cache(maxsize=1)
def byte_chars() -> dict[str, int]:
    return _byte_chars()


class NotEquivalent(ValueError):
    """A tokenizer this path would not encode as ``tokenizers`` does (the reason)."""


@dataclass(frozen=True, slots=True)
class Added:
    """Added tokens as the pipeline splits them out: ``first`` (unnormalized) matched before
    ``then`` (normalized; with no normalizer the same text), each leftmost-longest."""

    ids: dict[str, int]
    first: re.Pattern[str] | None
    then: re.Pattern[str] | None


def longest_first(contents: Iterable[str]) -> re.Pattern[str] | None:
    """A pattern matching any of ``contents``, the longest at a position: with a left-to-right
    scan, the leftmost-longest matching ``tokenizers`` does for added tokens (None: nothing)."""
    ordered = sorted(set(contents), key=lambda c: (-len(c), c))
    return re.compile("|".join(re.escape(c) for c in ordered)) if ordered else None


class FastBPE:
    """``encode(text, add_special_tokens=False)`` ids of a byte-level BPE tokenizer, by tiktoken."""

    def __init__(self, encoding: Any, added: Added) -> None:
        self._ordinary = encoding.encode_ordinary
        self._added = added

    def ids(self, text: str) -> list[int]:
        added = self._added
        if added.then is None and (added.first is None or not added.first.search(text)):
            ids: list[int] = self._ordinary(text)  # a new list already
            return ids
        out: list[int] = []
        self._split(text, added.first, added.then, out)
        return out

    def _split(
        self, text: str, pattern: re.Pattern[str] | None, then: re.Pattern[str] | None, out: list[int]
    ) -> None:
        if pattern is None:
            if then is not None:
                self._split(text, then, None, out)
            elif text:
                out += self._ordinary(text)
            return
        at = 0
        for m in pattern.finditer(text):
            if m.start() > at:
                self._split(text[at : m.start()], then, None, out)
            out.append(self._added.ids[m.group()])
            at = m.end()
        if at < len(text):
            self._split(text[at:], then, None, out)

    def packed(self, text: str) -> bytes:
        """The ids packed little-endian u32, as the gateway keeps them."""
        a = array.array("I", self.ids(text))
        if not _LITTLE:
            a.byteswap()
        return a.tobytes()


def _pattern(pre: Any) -> str:
    """The regex of a byte-level pre-tokenizer ``tiktoken`` can run, or ``NotEquivalent``."""

    def byte_level(p: Any, use_regex: bool) -> bool:
        return (
            isinstance(p, dict)
            and p.get("type") == "ByteLevel"
            and not p.get("add_prefix_space")
            and bool(p.get("use_regex", True)) == use_regex
        )

    if byte_level(pre, True):
        return GPT2_PATTERN
    if isinstance(pre, dict) and pre.get("type") == "Sequence":
        steps = pre.get("pretokenizers") or []
        if len(steps) == 2 and byte_level(steps[1], False):
            split = steps[0]
            regex = (split.get("pattern") or {}).get("Regex") if isinstance(split, dict) else None
            if (
                isinstance(regex, str)
                and split.get("type") == "Split"
                and split.get("behavior") == "Isolated"
                and not split.get("invert")
            ):
                return regex
    raise NotEquivalent("the pre-tokenizer is not byte-level BPE's (ByteLevel, or Split then ByteLevel)")


# What makes an alternative need fancy-regex's backtracking machine: back-references and
# ``\G``/``\K``/``\Z`` (seen in the raw text), and, once escapes are blanked out (``\p{L}+`` is not
# possessive), lookaround, atomic groups and conditionals (``(?=``, ``(?!``, ``(?<``, ``(?>``,
# ``(?(``) and possessive quantifiers. Named groups (``(?<name>``) and a ``+`` in a class after
# another quantifier's character are caught too: wrongly taken for hard, an alternative only stays
# ungrouped.
_HARD_ESCAPES = re.compile(r"\\[1-9kgGKZ]")
_ESCAPES = re.compile(r"\\[pP]\{[^}]*\}|\\.", re.DOTALL)
_HARD_SYNTAX = re.compile(r"\(\?[=!<>(]|[*+?}]\+")
# ``(?i)`` with no ``:`` sets flags up to the end of the enclosing group, past later alternatives:
# a group made around it would end them sooner
_BARE_FLAGS = re.compile(r"\(\?[a-zA-Z-]*\)")


def _hard(alternative: str) -> bool:
    return bool(_HARD_ESCAPES.search(alternative) or _HARD_SYNTAX.search(_ESCAPES.sub("e", alternative)))


def top_alternatives(pattern: str) -> list[str] | None:
    """``pattern`` split at its top-level ``|`` (not in a group, a class or after a backslash);
    None when its brackets do not balance, to leave it as it is."""
    out: list[str] = []
    depth = classes = start = 0
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":  # a class, or one nested in a class (a set operation)
            classes += 1
            # a ``]`` first in a class, or right after its ``^``, is a literal
            i += 2 if pattern.startswith("]", i + 1) else 3 if pattern.startswith("^]", i + 1) else 1
            continue
        if classes:
            if c == "]":
                classes -= 1
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth < 0:
                return None
        elif c == "|" and depth == 0:
            out.append(pattern[start:i])
            start = i + 1
        i += 1
    if depth or classes:
        return None
    out.append(pattern[start:])
    return out


def delegated(pattern: str) -> str:
    """``pattern`` with each run of consecutive top-level alternatives that need no backtracking
    (no lookaround, back-reference, atomic group or possessive quantifier) made one group.

    tiktoken's regex engine (fancy-regex) runs a pattern with lookaround (GPT-2's ``\\s+(?!\\S)``)
    on a backtracking machine that tries each top-level alternative as a search of its own; a
    group with none of those features is handed whole to the ``regex`` crate's automata, one
    search, whose leftmost-first alternation picks the alternative a backtracking engine would.
    The matches, and so the ids, are the same; a 2 KB chat encodes some 40 % faster."""
    parts = top_alternatives(pattern)
    if parts is None or len(parts) < 2 or _BARE_FLAGS.search(_ESCAPES.sub("e", pattern)):
        return pattern
    out: list[str] = []
    run: list[str] = []
    for part in [*parts, None]:
        if part is not None and not _hard(part):
            run.append(part)
            continue
        if len(run) > 1:
            out.append("(?:" + "|".join(run) + ")")
        else:
            out.extend(run)
        run = []
        if part is not None:
            out.append(part)
    return "|".join(out)


def _ranks(model: dict[str, Any], added: set[str]) -> dict[bytes, int]:
    if model.get("type") != "BPE":
        raise NotEquivalent(f"the model is {model.get('type')!r}, not BPE")
    if model.get("dropout") or model.get("byte_fallback"):
        raise NotEquivalent("BPE with dropout or byte fallback")
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise NotEquivalent("BPE with a subword prefix or word suffix")
    vocab: dict[str, int] = model.get("vocab") or {}
    chars = byte_chars()
    ranks: dict[bytes, int] = {}
    for token, i in vocab.items():
        if token in added:
            continue
        try:
            ranks[bytes(chars[c] for c in token)] = i
        except KeyError:
            raise NotEquivalent(f"vocabulary token {token!r} is not byte-level") from None
    if len(set(ranks.values())) != len(ranks) or any(bytes([b]) not in ranks for b in range(256)):
        raise NotEquivalent("not every byte is a token of its own, or ids repeat")
    previous, results = -1, set()
    for merge in model.get("merges") or ():
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        made = vocab.get(left + right)
        if made is None or made <= previous:
            raise NotEquivalent("merge results' ids do not rise with the merges")
        previous = made
        results.add(left + right)
    multi = [t for t in vocab if len(t) > 1 and t not in added]
    if any(t not in results for t in multi):
        raise NotEquivalent("a vocabulary token no merge makes")
    return ranks


def _added(tokens: Sequence[dict[str, Any]]) -> Added:
    ids: dict[str, int] = {}
    first: list[str] = []
    then: list[str] = []
    for t in tokens:
        content, i = t.get("content"), t.get("id")
        if not isinstance(content, str) or not content or not isinstance(i, int):
            continue
        if t.get("lstrip") or t.get("rstrip") or t.get("single_word"):
            raise NotEquivalent(f"added token {content!r} strips or matches whole words")
        ids[content] = i
        (then if t.get("normalized") else first).append(content)
    return Added(ids, longest_first(first), longest_first(then))


def vocabulary_texts(parsed: dict[str, Any]) -> list[str]:
    """The text of every vocabulary token that is whole UTF-8 (the others are parts of characters)."""
    chars = byte_chars()
    added = {t.get("content") for t in parsed.get("added_tokens") or () if isinstance(t, dict)}
    out = []
    for token in (parsed.get("model") or {}).get("vocab") or {}:
        if token in added or any(c not in chars for c in token):
            continue
        try:
            out.append(bytes(chars[c] for c in token).decode("utf-8"))
        except UnicodeDecodeError:
            continue
    return out


def check_texts(parsed: dict[str, Any]) -> list[str]:
    """What both encoders must agree on: every vocabulary token's text, the corpus whole and by line."""
    return [*vocabulary_texts(parsed), CHECK_CORPUS, *CHECK_CORPUS.splitlines(keepends=True)]


def compile_fast(parsed: dict[str, Any]) -> FastBPE:
    """The tiktoken encoder of a parsed ``tokenizer.json``, unchecked against it (``build``
    checks); ``NotEquivalent`` when its pipeline is not one tiktoken runs."""
    import tiktoken

    if parsed.get("normalizer") is not None:
        raise NotEquivalent("the tokenizer has a normalizer")
    pattern = _pattern(parsed.get("pre_tokenizer"))
    added = _added([t for t in parsed.get("added_tokens") or () if isinstance(t, dict)])
    ranks = _ranks(parsed.get("model") or {}, set(added.ids))
    try:
        encoding = tiktoken.Encoding(
            "prefixgate", pat_str=delegated(pattern), mergeable_ranks=ranks, special_tokens={}
        )
    except Exception as e:  # an invalid regex for tiktoken's engine, say
        raise NotEquivalent(f"tiktoken refused it: {e}") from None
    return FastBPE(encoding, added)


def build(parsed: dict[str, Any], hf: Any) -> tuple[FastBPE | None, str]:
    """The fast encoder when it gives ``hf`` 's ids on every check text, else None and why."""
    try:
        fast = compile_fast(parsed)
    except NotEquivalent as e:
        return None, str(e)
    texts = check_texts(parsed)
    want = [e.ids for e in hf.encode_batch_fast(texts, add_special_tokens=False)]
    for text, ids in zip(texts, want, strict=True):
        if fast.ids(text) != ids:
            return None, f"tiktoken and tokenizers differ on {text[:40]!r}"
    return fast, ""
