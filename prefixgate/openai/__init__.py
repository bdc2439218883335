"""The OpenAI protocol layer, shared by the gateway and the nodes' own HTTP endpoint.

Request schema and validation (``schema``), prompt normalization and the chat template
(``normalize``), and the OpenAI-format HTTP shape (``errors``) of the domain errors a request
can meet (``prefixgate.gateway.core.errors``, a module that imports nothing). Of
``prefixgate.gateway`` it imports those errors alone, and nothing of ``prefixgate.backends``:
both build on it.
"""
