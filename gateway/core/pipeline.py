"""The request path: prepare (normalize, tokenize, hash) -> look up -> route -> prefill -> decode.

``Pipeline`` composes the stages, one module each: ``prepare`` (documents, template, tokens,
tools, hashes), ``admission`` (the in-flight bound), ``plan`` (index lookup and the planner's
choice), ``execute`` (attempts, retries, the fallback to serving whole), ``accounting`` (what a
closed execution leaves: index records, metrics, the request's log line). ``decide`` routes
through ``gateway.routing.planner`` over the nodes' views, and ``preview`` shows the same plan
without changing anything (the admin explain endpoint uses it). The result of ``execute`` is an
``Execution`` whose chunks the HTTP and gRPC front ends stream to the client.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prefixgate.cachetier.hashing import Namespace
from prefixgate.cachetier.index import BlockIndex
from prefixgate.cachetier.tokenizer import Tokenizer
from prefixgate.gateway.cluster.nodes import Node, NodePool
from prefixgate.gateway.config import Settings
from prefixgate.gateway.core.accounting import Accounting
from prefixgate.gateway.core.admission import Admission
from prefixgate.gateway.core.errors import StreamBroken
from prefixgate.gateway.core.execute import Executor
from prefixgate.gateway.core.execution import Execution
from prefixgate.gateway.core.plan import Planner
from prefixgate.gateway.core.prepare import Preparer
from prefixgate.gateway.core.queueing import Gate
from prefixgate.gateway.core.request import Delta, Prepared, Switches
from prefixgate.gateway.metrics import Metrics
from prefixgate.gateway.routing import Policy
from prefixgate.gateway.routing.inflight import InflightPrefixes
from prefixgate.gateway.routing.planner import Plan
from prefixgate.gateway.state.documents import DocumentStore

__all__ = ["Delta", "Execution", "Pipeline", "Prepared", "StreamBroken"]


class Pipeline:
    def __init__(
        self,
        settings: Settings,
        pool: NodePool,
        index: BlockIndex,
        tokenizer: Tokenizer,
        metrics: Metrics,
        documents: DocumentStore,
        model_tokenizers: Mapping[str, Tokenizer] | None = None,
    ) -> None:
        self.settings = settings
        self.tenancy = settings.tenancy()
        self.pool = pool
        self.index = index
        self.switches = Switches(settings.disaggregation, settings.prefix_routing, settings.normalization)
        self.preparer = Preparer(settings, pool, tokenizer, model_tokenizers or {}, documents, self.switches)
        self.admission = Admission(settings, metrics)
        self.planner = Planner(settings, pool, index, metrics, self.switches)
        self.accounting = Accounting(settings, index, metrics)
        self.gate = Gate(settings, metrics, self.planner.serving, lambda: self.switches.disaggregation)
        self.executor = Executor(
            settings, pool, self.planner, self.accounting, metrics, self.tenancy, self.gate
        )
        self.prepare = self.preparer.prepare  # documents, template, tokens, tools, hashes

    # -- what the stages keep, as the rest of the gateway reads and sets it ----------------------

    @property
    def tokenizer(self) -> Tokenizer:
        """Every model's tokenizer, but those in ``model_tokenizers`` (replaced once the engine's
        own is known)."""
        return self.preparer.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: Tokenizer) -> None:
        self.preparer.tokenizer = tokenizer

    @property
    def policy(self) -> Policy:
        return self.planner.policy

    @property
    def turns(self) -> dict[str, int]:
        return self.planner.turns

    @property
    def inflight_prefixes(self) -> InflightPrefixes:
        return self.planner.inflight_prefixes

    @property
    def inflight(self) -> int:
        return self.admission.inflight

    @property
    def on_mispredict(self) -> Callable[[Node], None] | None:
        return self.accounting.on_mispredict

    @on_mispredict.setter
    def on_mispredict(self, callback: Callable[[Node], None] | None) -> None:
        self.accounting.on_mispredict = callback

    @property
    def on_finished(self) -> Callable[[Execution], None] | None:
        """Called with every closed execution (tenant accounting)."""
        return self.accounting.on_finished

    @on_finished.setter
    def on_finished(self, callback: Callable[[Execution], None] | None) -> None:
        self.accounting.on_finished = callback

    # -- the stages ----------------------------------------------------------------------------

    def admit(self) -> Callable[[], None]:
        """``Admission.admit``: take an in-flight slot or refuse; returns the release."""
        return self.admission.admit()

    @property
    def renders_templates(self) -> bool:
        return self.preparer.renders_templates

    def tokenizer_for(self, model: str) -> Tokenizer:
        return self.preparer.tokenizer_for(model)

    def namespace(self, model: str, tenant: str, cache_salt: str = "") -> Namespace:
        return self.preparer.namespace(model, tenant, cache_salt)

    async def lookup(self, prep: Prepared) -> dict[str, int]:
        """The hits routing follows for ``prep``'s blocks, node -> leading blocks."""
        return (await self.planner.lookup(prep)).hits

    def decide(self, prep: Prepared, hits: dict[str, int], exclude: set[str] | None = None) -> Plan:
        return self.planner.decide(prep, hits, exclude)

    def preview(self, prep: Prepared, hits: dict[str, int]) -> Plan:
        return self.planner.preview(prep, hits)

    async def execute(self, prep: Prepared) -> Execution:
        """Route and start the request (``gateway.core.execute``)."""
        return await self.executor.execute(prep)

    async def close(self) -> None:
        await self.gate.close()
        await self.accounting.close()
