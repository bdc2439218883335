"""Preparing a request: documents, chat template or rendering, tokens, tool plan, checks, hashes.

The parsed request is the caller's and stays as it is: the sampling the engines get (the tool
plan's constraint, ``max_tokens`` clamped to the context window) is a new value.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import replace
from functools import partial
from typing import Any

from prefixgate.cachetier.hashing import Namespace, block_hashes
from prefixgate.cachetier.tokenizer import Tokenizer, pack_ids
from prefixgate.gateway.cluster.nodes import Node, NodePool
from prefixgate.gateway.config import Settings
from prefixgate.gateway.core.context import exceeded
from prefixgate.gateway.core.errors import GatewayError, InvalidRequest
from prefixgate.gateway.core.request import Prepared, RequestContext, Switches
from prefixgate.gateway.core.tenancy import engine_salt, namespace_salt
from prefixgate.gateway.nodeclient import OpenAIBody
from prefixgate.gateway.nodeclient.openai_body import engine_body
from prefixgate.gateway.state.documents import DocumentStore
from prefixgate.gateway.tokens import TemplateLimitError, chat_encoder
from prefixgate.gateway.toolcalls.support import ToolPlan, plan_tools
from prefixgate.openai.normalize import (
    Document,
    Layout,
    NormalizationError,
    Segment,
    render_chat,
    render_completion,
)
from prefixgate.openai.schema import ParsedRequest, Sampling


class Preparer:
    def __init__(
        self,
        settings: Settings,
        pool: NodePool,
        tokenizer: Tokenizer,
        model_tokenizers: Mapping[str, Tokenizer],
        documents: DocumentStore,
        switches: Switches,
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.tokenizer = tokenizer  # every model's, but those in ``model_tokenizers``
        self.model_tokenizers = model_tokenizers
        self.documents = documents
        self.switches = switches

    def _serving(self, model: str) -> list[Node]:
        return self.pool.serving(model, self.settings.model)

    def _passing_through(self, model: str) -> bool:
        """Every node serving ``model`` takes the OpenAI request whole (an HTTP worker): their
        engines render the tools and parse the calls, which are relayed as they send them."""
        nodes = self._serving(model)
        return bool(nodes) and all(n.client.capabilities.openai_body for n in nodes)

    @property
    def renders_templates(self) -> bool:
        """Whether preparing a request may run a model's chat template (CPU work of the
        template's making: it runs off the event loop, ``RequestRunner.compute``)."""
        tokenizers = (self.tokenizer, *self.model_tokenizers.values())
        return any(hasattr(t, "encode_chat") for t in tokenizers)

    def tokenizer_for(self, model: str) -> Tokenizer:
        """The tokenizer of ``model``'s workers (the name the nodes know it by)."""
        return self.model_tokenizers.get(model, self.tokenizer)

    def namespace(self, model: str, tenant: str, cache_salt: str = "") -> Namespace:
        """The tenant's namespace (``gateway.core.tenancy.namespace_salt``); ``cache_salt``: the
        client's own division of it."""
        salt = namespace_salt(tenant, self.settings.shared_namespaces, cache_salt)
        return Namespace(model, salt, self.settings.block_size, self.tokenizer_for(model).name)

    def _check_cache_salt(self, req: ParsedRequest, model: str) -> None:
        """A client's ``cache_salt`` is honoured only where every worker of the model can carry
        it into its engine's cache key; elsewhere it would be ignored, so it is refused."""
        if req.cache_salt and not all(n.client.capabilities.tenant_salt for n in self._serving(model)):
            raise InvalidRequest(
                "'cache_salt' is not supported by the engines serving this model (their protocol "
                "carries no cache salt)",
                param="cache_salt",
            )

    def prepare(
        self,
        req: ParsedRequest,
        context: RequestContext,
        *,
        body: Mapping[str, Any] | None = None,
    ) -> Prepared:
        """``body``: the client's JSON body, passed on (normalized) to OpenAI-compatible workers."""
        tenant = context.tenant
        docs = list(req.documents)
        for doc_id in req.document_ids:
            docs.append(self.documents.get(tenant, doc_id))
        normalize = self.switches.normalization
        model = self.pool.canonical(req.model, self.settings.model)  # ``model`` may be an alias
        tokenizer = self.tokenizer_for(model)
        chat_tools = req.tools if req.kind == "chat" else None
        if chat_tools and self._passing_through(model):  # the workers parse their own calls
            tools = ToolPlan("", chat_tools, req.needs)
        else:
            tools = plan_tools(
                chat_tools, req.tool_choice, req.needs, tokenizer, self.settings.tool_call_parser
            )
        try:
            encoder = chat_encoder(tokenizer) if req.kind == "chat" else None
            if encoder is not None:
                # the model's own chat template over the canonical messages (gateway.tokens)
                layout, tokens = encoder.encode_chat(
                    req.messages, documents=docs, tools=tools.tools, normalize=normalize
                )
            elif req.kind == "chat":
                layout = render_chat(req.messages, documents=docs, tools=req.tools, normalize=normalize)
                tokens = tokenizer.encode(layout.text)
            elif req.prompt_token_ids is not None:
                tokens = pack_ids(req.prompt_token_ids)
                layout = Layout("", [Segment("prompt", "token ids", 0, len(tokens))])
            else:
                layout = render_completion(req.prompt or "", documents=docs, normalize=normalize)
                tokens = tokenizer.encode(layout.text)
        except NormalizationError as e:
            raise InvalidRequest(str(e), param=e.param) from None
        except TemplateLimitError as e:  # no chat renders like that: the template is at fault (a 500)
            detail = f"{e}; the chat template of model {model!r} is at fault, not the request"
            raise GatewayError(detail, code="chat_template_limit") from None
        n = len(tokens) // 4
        prompt_param = "messages" if req.kind == "chat" else "prompt"
        if n == 0:
            raise InvalidRequest("the prompt is empty", param=prompt_param)
        s = self.settings
        if n > s.max_prompt_tokens:
            raise exceeded(n, 0, s.max_prompt_tokens, prompt_param=prompt_param)
        _check_logit_bias(req.sampling, tokenizer)
        sampling = _engine_sampling(req.sampling, tools, self._max_tokens(req, n))
        self._check_cache_salt(req, model)
        ns = self.namespace(model, tenant, req.cache_salt)
        hashes = block_hashes(tokens, s.block_size, ns.root())
        salt = engine_salt(ns.tenant)
        return Prepared(
            context,
            context.request_id or uuid.uuid4().hex,
            ns,
            layout,
            tokens,
            hashes,
            sampling,
            model,
            tools.needs,
            partial(_engine_body, req, sampling, docs, normalize, body, salt),
            tool_parser=tools.parser,
            engine_salt=salt,
            prompt_param=prompt_param,
            max_tokens_param=req.max_tokens_param if req.max_tokens_given else "",
            priority=req.priority,
            priority_given=req.priority_given,
        )

    def _max_tokens(self, req: ParsedRequest, prompt_tokens: int) -> int:
        """The request's ``max_tokens``, clamped to the room the prompt leaves in the context
        window when the client did not ask for it; refused when it asked for more."""
        window, asked = self.settings.context_window, req.sampling.max_tokens
        room = window - prompt_tokens
        if asked <= room:
            return asked
        if req.max_tokens_given or room < 1:
            raise exceeded(
                prompt_tokens,
                asked,
                window,
                prompt_param="messages" if req.kind == "chat" else "prompt",
                max_tokens_param=req.max_tokens_param if req.max_tokens_given else "",
            )
        return room


def _check_logit_bias(sampling: Sampling, tokenizer: Tokenizer) -> None:
    """``logit_bias`` names tokens of the model's vocabulary (known when the gateway holds
    the engine's tokenizer)."""
    vocab = int(getattr(tokenizer, "vocab_size", 0) or 0)
    if vocab <= 0 or not sampling.logit_bias:
        return
    outside = sorted(t for t in sampling.logit_bias if t >= vocab)
    if outside:
        raise InvalidRequest(
            f"'logit_bias' token ids must be below the vocabulary size of {vocab}, got {outside[0]}",
            param="logit_bias",
        )


def _engine_sampling(asked: Sampling, tools: ToolPlan, max_tokens: int) -> Sampling:
    """The sampling the engines get: the client's, with the tool plan's (special tokens shown
    for a parser whose markers may be special tokens; a constraint when ``tool_choice`` forces
    calls) and ``max_tokens`` clamped; the client's own value when none of that changes it."""
    special = bool(tools.parser)
    constraint = asked.constraint if tools.constraint is None else tools.constraint
    if (special, constraint, max_tokens) == (asked.keep_special_tokens, asked.constraint, asked.max_tokens):
        return asked
    return replace(asked, keep_special_tokens=special, constraint=constraint, max_tokens=max_tokens)


def _engine_body(
    req: ParsedRequest,
    sampling: Sampling,
    documents: list[Document],
    normalize: bool,
    raw: Mapping[str, Any] | None,
    cache_salt: str,
) -> OpenAIBody:
    """``engine_body`` of ``req`` as the engines sample it (built only for a node that takes it)."""
    if sampling is not req.sampling:
        req = replace(req, sampling=sampling)
    return engine_body(req, documents, normalize=normalize, raw=raw, cache_salt=cache_salt)
