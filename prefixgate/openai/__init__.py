"""The OpenAI protocol layer, shared by the gateway and the nodes' own HTTP endpoint.

Request schema and validation (``schema``), prompt normalization and the chat template
(``normalize``), the errors a request can meet without any transport's status code
(``exceptions``) and their OpenAI-format HTTP shape (``errors``). It imports nothing from
``prefixgate.gateway`` or ``prefixgate.backends``: both build on it.
"""
