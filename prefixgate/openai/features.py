"""Request features an engine may or may not serve, and which field of a request asks for each.

The gateway does ``n``, ``stop`` and ``seed`` for every engine (``n`` as independent choices,
``stop`` on the node's output, ``seed`` passed on). What depends on the engine behind a node is
listed here: a node reports the features it serves (``NodeStatus.features``), and the gateway
refuses a request with a 400 naming the field before routing when no node can serve it. Pure.
"""

from __future__ import annotations

from enum import StrEnum


class Feature(StrEnum):
    LOGPROBS = "logprobs"  # per-token log probabilities (and the top alternatives)
    LOGIT_BIAS = "logit_bias"  # additive bias on chosen tokens' logits
    RESPONSE_FORMAT = "response_format"  # constrained decoding to JSON (object or schema)
    TOOLS = "tools"  # tool calls rendered and parsed by the engine's chat template
    IMAGES = "images"  # image content parts (a vision model)


WHAT = {
    Feature.LOGPROBS: "log probabilities",
    Feature.LOGIT_BIAS: "logit bias",
    Feature.RESPONSE_FORMAT: "constrained JSON output",
    Feature.TOOLS: "tool calls",
    Feature.IMAGES: "image inputs",
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
