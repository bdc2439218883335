"""Build the nodes' Hugging Face tokenizer, deterministically, from a generated corpus.

``python -m prefixgate.backends.hftok.build [DIR]`` writes ``tokenizer.json``,
``tokenizer_config.json`` (a ChatML chat template) and ``config.json`` (a text-only model of this
vocabulary) into ``DIR`` (default: this package, where the committed copy lives).
The corpus is made here from fixed word lists and a seeded generator, so the same ``tokenizers``
release always trains the same byte-level BPE; ``tests/backends/test_hftok.py`` checks the
committed files against a fresh build.

Every word of the simulated engine (a space and three letters) is frequent enough in the corpus
to become one token, so the simulated engine's output maps one token to one token.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from prefixgate.backends.sim import textgen

VOCAB_SIZE = 2048
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS = "<|im_end|>"
CORPUS_SEED = 20240611
CORPUS_LINES = 4000

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_EXTRA_WORDS = """
    a an of to in is it on at by as be or we if so do no up my me us he am go
    that with this from they have what when will your which their there about would these other
    into more some could them than then only over also after most made many time very where just
    those first well before must through back years much should people between under never same
    another while last might great three since against right here take every place around however
    small large number world house cache prefix block token model request prompt decode prefill node
    gateway system user assistant document answer question stream latency memory page transfer
    Hello hello Hi there Thanks please What How Why Who When Where Yes No OK
""".split()
_PUNCT = (".", ",", "?", "!", ":", ";")


def corpus(lines: int = CORPUS_LINES, seed: int = CORPUS_SEED) -> list[str]:
    """Sentences of English-like words, digits and punctuation, and a few ChatML turns."""
    rng = random.Random(seed)
    sim_words = [w.strip() for w in textgen.VOCAB]
    words = sim_words + _EXTRA_WORDS
    out: list[str] = []
    for i in range(lines):
        n = rng.randint(6, 18)
        ws = [rng.choice(words) for _ in range(n)]
        if i % 5 == 0:
            ws.insert(rng.randrange(n), str(rng.randint(0, 9999)))
        sentence = " ".join(ws)
        sentence = sentence[0].upper() + sentence[1:] + rng.choice(_PUNCT)
        if i % 7 == 0:
            role = rng.choice(("system", "user", "assistant"))
            sentence = f"<|im_start|>{role}\n{sentence}<|im_end|>\n"
        out.append(sentence)
    # each simulated-engine word often after a space, so " the" etc. become single tokens
    for w in sim_words:
        out.append(" ".join([w] * 40))
    return out


def train() -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok


def tokenizer_config() -> dict[str, object]:
    return {
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, t in enumerate(SPECIAL_TOKENS)
        },
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS,
        "model_max_length": 1 << 20,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def model_config() -> dict[str, object]:
    """A model ``config.json`` for the tokenizer's directory: a text-only model of this vocabulary.
    Clients that read the model's config from the tokenizer source (smg does, for every chat
    request, to learn whether the model takes media) find it here; without it they take the
    directory for a Hugging Face repo id and try the Hub, which stalls requests offline."""
    ids = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    return {
        "architectures": ["PrefixgateForCausalLM"],
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids[EOS],
        "max_position_embeddings": 1 << 20,
        "model_type": "prefixgate",
        "pad_token_id": ids["<|endoftext|>"],
        "tie_word_embeddings": False,
        "vocab_size": VOCAB_SIZE,
    }


def build(directory: Path) -> None:
    tok = train()
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))  # type: ignore[attr-defined]
    text = json.dumps(tokenizer_config(), indent=2, sort_keys=True) + "\n"
    (directory / "tokenizer_config.json").write_text(text, encoding="utf-8")
    text = json.dumps(model_config(), indent=2, sort_keys=True) + "\n"
    (directory / "config.json").write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    build(Path(args[0]) if args else Path(__file__).resolve().parent)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
