"""Request features an engine may or may not serve, and which field of a request asks for each.

The gateway does ``n`` and ``stop`` for every engine (``n`` as the engine takes it: in the
request, or as independent choices, each its own sampling stream; ``stop`` on the node's output).
What depends on the engine behind a node is listed here: a node reports the features it serves
(``NodeStatus.features``), and the gateway refuses a request with a 400 naming the field before
routing when no node can serve it. ``seed`` is one: an engine whose protocol carries no seed
(SGLang over gRPC) would sample at random, so a sampled request with a ``seed`` is refused
rather than answered as if the seed had been used. Pure.
"""

from __future__ import annotations

from enum import StrEnum


class Feature(StrEnum):
    LOGPROBS = "logprobs"  # per-token log probabilities (and the top alternatives)
    LOGIT_BIAS = "logit_bias"  # additive bias on chosen tokens' logits
    RESPONSE_FORMAT = "response_format"  # constrained decoding to JSON (object or schema)
    TOOLS = "tools"  # tool calls rendered and parsed by the engine's chat template
    IMAGES = "images"  # image content parts (a vision model)
    SEED = "seed"  # reproducible sampling under the request's seed


WHAT = {
    Feature.LOGPROBS: "log probabilities",
    Feature.LOGIT_BIAS: "logit bias",
    Feature.RESPONSE_FORMAT: "constrained JSON output",
    Feature.TOOLS: "tool calls",
    Feature.IMAGES: "image inputs",
    Feature.SEED: "sampling seeds",
}


def parse_features(names: object) -> frozenset[Feature]:
    """The known features among ``names`` (an unknown name, from a newer node, is ignored)."""
    if not isinstance(names, list | tuple | set | frozenset):
        return frozenset()
    known = {f.value for f in Feature}
    return frozenset(Feature(n) for n in names if isinstance(n, str) and n in known)


def refusal(feature: Feature, engines: str) -> str:
    """The message of the 400 for a feature no node of the pool serves."""
    what = f"{WHAT[feature]} ('{feature.value}')"
    return f"{what} are not supported by the engines serving this model ({engines})"
