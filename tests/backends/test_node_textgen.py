"""Deterministic sim text, stop strings and max_tokens (pure parts)."""

from __future__ import annotations

from prefixgate.backends.engine import Sampling
from prefixgate.backends.generation import Generation
from prefixgate.backends.sim import textgen
from prefixgate.backends.stopping import StopChecker
from prefixgate.cachetier.tokenizer import Bytes4Tokenizer


def run(tokens: bytes, sampling: Sampling, n: int = 30) -> list[int]:
    s0 = textgen.prompt_state(tokens)
    sampler = textgen.Sampler(sampling, s0)
    out, state = [], s0
    for step in range(n):
        t = sampler.pick(state, step)
        out.append(t)
        if t == textgen.EOS_TOKEN:
            break
        state = textgen.advance(state, t)
    return out


PROMPT = Bytes4Tokenizer().encode("Tell me a story about a fox and an owl.")


def test_same_inputs_same_tokens() -> None:
    s = Sampling(temperature=1.0, top_p=0.9)
    assert run(PROMPT, s) == run(PROMPT, s)
    assert run(PROMPT, s) != run(Bytes4Tokenizer().encode("Another prompt."), s)


def test_seed_temperature_top_p_change_the_sequence() -> None:
    base = run(PROMPT, Sampling(temperature=1.0, seed=1))
    assert base == run(PROMPT, Sampling(temperature=1.0, seed=1))
    assert base != run(PROMPT, Sampling(temperature=1.0, seed=2))
    greedy = run(PROMPT, Sampling(temperature=0.0, seed=1))
    assert greedy == run(PROMPT, Sampling(temperature=0.0, seed=2))  # greedy ignores the seed
    assert greedy != base
    assert run(PROMPT, Sampling(temperature=1.0, top_p=1e-6, seed=3)) == greedy  # top_p -> only rank 0


def test_output_tokens_are_bytes4_tokens_of_their_text() -> None:
    ids = run(PROMPT, Sampling(), 12)
    text = "".join(textgen.token_text(t) for t in ids)
    assert text.startswith(" ") and len(text.split()) == len(ids)
    assert Bytes4Tokenizer().encode(text) == b"".join(t.to_bytes(4, "little") for t in ids)


def test_natural_end_token() -> None:
    s = Sampling(temperature=0.7, seed=5)
    ids = run(PROMPT, s, 1000)
    assert ids[-1] == textgen.EOS_TOKEN
    assert textgen.MIN_LENGTH <= len(ids) - 1 < textgen.MIN_LENGTH + textgen.LENGTH_SPAN


def test_stop_string_across_tokens_is_held_back_and_dropped() -> None:
    c = StopChecker(["fox owl"])
    assert c.feed(" the") == " the"
    assert c.feed(" fox") == " "  # "fox" could start the stop string
    assert c.feed(" owl") == ""
    assert c.stopped and c.flush() == ""
    c = StopChecker(["fox owl"])
    assert c.feed(" fox") + c.feed(" cat") == " fox cat"
    assert c.flush() == ""


def test_generation_finish_reasons() -> None:
    text = textgen.token_text
    eos = textgen.EOS_TOKEN
    cat, dog = textgen.TOKEN_IDS[textgen.VOCAB.index(" cat")], textgen.TOKEN_IDS[textgen.VOCAB.index(" dog")]
    g = Generation(Sampling(max_tokens=2), eos, text)
    assert g.push([cat, dog, cat]) == ([cat, dog], " cat dog")
    assert g.finish_reason == "length" and g.count == 2
    g = Generation(Sampling(max_tokens=9, stop=("t d",)), eos, text)
    assert g.push([cat, dog, cat]) == ([cat, dog], " ca")
    assert g.finish_reason == "stop" and g.count == 2
    g = Generation(Sampling(max_tokens=9, stop=("do",)), eos, text)
    _, shown = g.push([cat])
    _, shown2 = g.push([eos])
    assert (shown, shown2, g.finish_reason, g.count) == (" cat", "", "stop", 1)


def test_sampling_wire_defaults() -> None:
    s = Sampling.normalized(0, 0.0, 0.0, None, ["", "x"])
    assert (s.max_tokens > 0, s.top_p, s.temperature, s.stop) == (True, 1.0, 0.0, ("x",))
