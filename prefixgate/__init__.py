"""prefixgate: an OpenAI-compatible gateway for disaggregated (prefill/decode) LLM serving.

Installed, the distribution is this one namespace: ``prefixgate.gateway``, ``prefixgate.cachetier``,
``prefixgate.backends``, ``prefixgate.bench``, ``prefixgate.v1`` (generated protobuf code) and
``prefixgate.cli`` (the command line, the one place that wires them together). In the source tree
each subpackage keeps its own top-level folder; the entries here are links to those folders, so a
checkout imports exactly the names an install does.
"""
