"""Turning an engine's tokens into what a client sees: text, stop strings, max_tokens. Pure.

Both paths use it the same way, so they agree to the character: prefill pushes the first
token (its safe text is ``PrefillResponse.first_text``); decode builds a fresh ``Generation``,
pushes the same first token (discarding its text, already sent) and continues.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from prefixgate.backends.engine import Sampling, TokenLogprob
from prefixgate.backends.stopping import StopChecker


@dataclass(slots=True)
class Chunk:
    """Mirror of ``prefixgate.v1.TokenChunk``. Every chunk carries the usage so far (prompt,
    cached and completion tokens); the last one has ``finish_reason`` set."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    queue_seconds: float = 0.0
    prefill_seconds: float = 0.0
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token_ids, when asked


class Generation:
    __slots__ = ("_checker", "_eos", "_text", "count", "finish_reason", "max_tokens")

    def __init__(self, sampling: Sampling, eos_token: int, token_text: Callable[[int], str]) -> None:
        self._checker = StopChecker(sampling.stop)
        self._eos = eos_token
        self._text = token_text
        self.max_tokens = sampling.max_tokens
        self.count = 0  # completion tokens (the end token is not one)
        self.finish_reason = ""

    @property
    def finished(self) -> bool:
        return bool(self.finish_reason)

    @property
    def remaining(self) -> int:
        return max(0, self.max_tokens - self.count)

    def push(self, tokens: Sequence[int]) -> tuple[list[int], str]:
        """Apply tokens until generation finishes; returns (token ids taken, text to show)."""
        ids: list[int] = []
        parts: list[str] = []
        checker = self._checker
        for t in tokens:
            if self.finish_reason:
                break
            if t == self._eos:
                self.finish_reason = "stop"
                parts.append(checker.flush())
                break
            ids.append(t)
            self.count += 1
            parts.append(checker.feed(self._text(t)))
            if checker.stopped:
                self.finish_reason = "stop"
            elif self.count >= self.max_tokens:
                self.finish_reason = "length"
                parts.append(checker.flush())
        return ids, "".join(parts)

    def end(self) -> str:
        """The engine stopped producing (its token budget ran out): finish as "length"."""
        if self.finish_reason:
            return ""
        self.finish_reason = "length"
        return self._checker.flush()
