"""The gateway as one object: settings, nodes, index, pipeline, metrics. Front ends share it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Set
from functools import partial

import structlog

from prefixgate import cachetier
from prefixgate.cachetier.hashing import Namespace
from prefixgate.cachetier.index import BlockIndex
from prefixgate.cachetier.memory import MemoryIndex
from prefixgate.cachetier.replicated import ReplicatedIndex, WorkerSlot
from prefixgate.cachetier.resilient import ResyncHook, mirror_writes
from prefixgate.cachetier.tokenizer import Tokenizer
from prefixgate.gateway import shutdown
from prefixgate.gateway.cluster import workers
from prefixgate.gateway.cluster.breaker import CircuitBreaker
from prefixgate.gateway.cluster.discovery import Discovery
from prefixgate.gateway.cluster.events import EventSync
from prefixgate.gateway.cluster.k8s_discovery import kubernetes_source
from prefixgate.gateway.cluster.membership import AdminNudges, Membership
from prefixgate.gateway.cluster.nodes import Node, NodePool
from prefixgate.gateway.cluster.switches import SharedSwitches
from prefixgate.gateway.cluster.workers import WorkerOptions
from prefixgate.gateway.config import KEYLESS_TENANT, Settings
from prefixgate.gateway.core.pipeline import Execution, Pipeline
from prefixgate.gateway.core.rate_limits import LimitUse, RateLimiter, policy_of
from prefixgate.gateway.core.runner import RequestRunner, RunnerLimits
from prefixgate.gateway.core.usage import Prices, UsageLedger
from prefixgate.gateway.metrics import Metrics, NodeSample
from prefixgate.gateway.nodeclient import NodeClient
from prefixgate.gateway.state.documents import DocumentLimits, DocumentStore
from prefixgate.gateway.state.memory import MemoryState
from prefixgate.gateway.state.quotas import PinLimits
from prefixgate.gateway.state.replicated import DocumentRegistry, PinRegistry, open_state
from prefixgate.gateway.tokenpool import kvcolumns
from prefixgate.gateway.tokenpool.pool import TokenizerPool
from prefixgate.gateway.tokens.wiring import (
    gateway_tokenizer,
    model_tokenizers,
    tokenizer_pools,
    worker_tokenizer,
)

log = structlog.get_logger("prefixgate.gateway")

CLOSE_TIMEOUT_S = 5.0  # the most any one part may take to close on shutdown
TOKENIZER_POOL_STOP_S = 2.0  # a tokenizer child still running then is killed (it only tokenizes)

KEYLESS_NOTICE = (
    "none: no API keys, so no tenant isolation; every client shares one tenant (documents, "
    "cache, quotas) and 'user' selects nothing; set --api-key KEY=TENANT to isolate tenants"
)


def open_index(
    settings: Settings, on_resync: ResyncHook | None = None, *, replicated: WorkerSlot | None = None
) -> BlockIndex:
    """Embedded index, the shared Redis one behind its degraded-mode wrapper, or (``replicated``:
    a gateway worker on its supervisor's store) this worker's own, kept the same as its
    siblings' through the store's pub/sub (``cachetier.replicated``)."""
    if not settings.redis:
        return MemoryIndex()
    if replicated is not None:
        return ReplicatedIndex(settings.redis, settings.redis_prefix, replicated)
    return cachetier.open_index(
        settings.redis, prefix=settings.redis_prefix, layout=settings.redis_layout, on_resync=on_resync
    )


class GatewayService:
    def __init__(
        self,
        settings: Settings,
        index: BlockIndex | None = None,
        *,
        writes_node_events: bool = True,
        replicated_index: WorkerSlot | None = None,
    ) -> None:
        """``writes_node_events`` False: the nodes' KV events are followed into this process's
        mirror of the shared index only, a sibling worker writing them (``cachetier.resilient``).
        ``replicated_index``: this gateway worker's place among its supervisor's, on whose store
        it routes on an index of its own that its siblings keep the same (``cachetier.replicated``)."""
        self.settings = s = settings
        self.metrics = Metrics()
        if index is None:
            index = open_index(settings, self._index_recovered, replicated=replicated_index)
        self.index = index
        self.tokenizer = gateway_tokenizer(settings)
        self.model_tokenizers = model_tokenizers(settings)  # models whose workers take another
        # workers registered at runtime with options (``POST /workers``), read when connected
        self.worker_options: dict[str, WorkerOptions] = {}
        self.pool = NodePool(
            settings.stats_interval_s,
            connect=self._connector(),
            probe_timeout_s=s.health_check_timeout_s,
            breaker=partial(
                CircuitBreaker,
                threshold=s.breaker_failure_threshold,
                success_threshold=s.breaker_success_threshold,
                base_cooldown_s=s.breaker_cooldown_s,
                max_cooldown_s=s.breaker_max_cooldown_s,
                cooldown_s=s.breaker_cooldown_s,
            ),
            failures_to_trip=s.health_failure_threshold,
            successes_to_rejoin=s.health_success_threshold,
            block_size=s.block_size,
        )
        # Shared by every replica on the same Redis (embedded otherwise): documents, tenants'
        # pins, membership changes, usage.
        self.state = open_state(settings)
        self.documents = DocumentRegistry(
            self.state,
            DocumentLimits(s.document_quota_count, s.document_quota_bytes, s.document_store_bytes),
        )
        self.pins = PinRegistry(
            self.state,
            PinLimits(
                s.pin_quota_blocks_per_node, s.pin_quota_node_share, s.pin_quota_blocks, s.pin_max_seconds
            ),
        )
        prices = Prices(s.price_input_miss, s.price_input_hit, s.price_output, s.price_currency)
        self.usage = UsageLedger(self.state, prices, self.metrics.registry, s.usage_flush_s)
        # Front ends resolve ``document_ids`` first (DocumentRegistry.resolve); the embedded
        # store still answers the pipeline directly.
        local_docs = self.state.documents if isinstance(self.state, MemoryState) else DocumentStore()
        self.pipeline = Pipeline(
            settings, self.pool, self.index, self.tokenizer, self.metrics, local_docs, self.model_tokenizers
        )
        self.pipeline.on_finished = self._count_usage
        # Every worker follows every node's events: with a replicated index each applies them to
        # its own copy alone (none published); with a shared one, one worker writes them.
        repair: BlockIndex | None = None
        if isinstance(self.index, ReplicatedIndex):
            events_index: BlockIndex = self.index.local
        elif writes_node_events:
            events_index = self.index
        else:
            events_index = mirror_writes(self.index)
            repair = None if events_index is self.index else self.index
        self.events = EventSync(self.pool, events_index, self.metrics, repair_index=repair)
        self.pipeline.on_mispredict = self._resync_node
        self.metrics.bind_nodes(self.node_samples)
        # every front end serves requests through it
        self.runner = RequestRunner(
            self.pipeline,
            self.documents,
            RunnerLimits(s.api_keys, s.admin_token, s.max_json_values, s.inline_render_budget_ms / 1000),
        )
        self.limits = RateLimiter(self.state, policy_of(s), self.metrics.registry)
        self.runner.limits = self.limits
        self.discovery = Discovery(
            s.discovery_file,
            s.discovery_dns,
            s.discovery_dns_server,
            s.discovery_interval_s,
            s.discovery_forget_s,
            present=lambda: set(self.pool.nodes),
            add=lambda f: self._add_node(f.role, f.address, f.options),
            forget=self._forget_discovered,
            clear=self.index.clear_node,
            kubernetes=kubernetes_source(s),
        )
        self.switches = SharedSwitches(self.state, self.pipeline.switches)
        self.membership = Membership(
            self.state,
            self.pool,
            self._add_node,
            self._forget_node,
            s.membership_interval_s,
            self.worker_options.get,
            also=(self.switches.sync,),
        )
        # Gateway workers tell their siblings of an admin change at once, not on the beat.
        self.nudges: AdminNudges | None = None
        if replicated_index is not None and replicated_index.count > 1 and s.redis:
            self.nudges = AdminNudges(s.redis, s.redis_prefix, replicated_index, self.membership)
            self.membership.announce = self.switches.announce = self.nudges.announce
        self._started = False
        self.tokenizer_pools: list[TokenizerPool] = []  # made at start, for the final tokenizers

    def _connector(self) -> Callable[[str], NodeClient]:
        """``nodeclient.connect`` for smg-style workers (``workers.connector``: the engine's own
        tokenizer detokenizes when the gateway has it), with KV events over ZMQ for the workers
        ``kv_events`` names."""
        s = self.settings
        ns = Namespace(s.default_model, "", s.block_size, self.tokenizer.name)

        def tokenizer_of(model: str) -> Tokenizer:  # read at connect time: ``start`` may load it
            return self.model_tokenizers.get(model, self.tokenizer)

        # an EngineTokenizer's ``hf`` (a ``tokenizers.Tokenizer``) detokenizes its model's ids
        connect = workers.connector(
            s,
            lambda model: tokenizer_of(model).name,
            codec_for=lambda model: getattr(tokenizer_of(model), "hf", None),
            registered=self.worker_options,
            kv_batch_far=self._kv_batch_far,
        )
        dropped = self.metrics.kv_events_dropped

        def on_drop(what: str, n: int) -> None:
            dropped.labels(what).inc(n)

        if not s.kv_events:  # no worker sends its KV events over ZMQ: pyzmq is never loaded
            return connect
        from prefixgate.gateway.nodeclient.zmq_events import events_connector

        return events_connector(s.kv_events, ns, connect, on_drop, s.tenancy().event_salt)

    def _kv_batch_far(self, raw: bytes) -> kvcolumns.Batch | None:
        """A long KV event batch in columns, read by a tokenizer child (any tokenizer's: it only
        parses), or None when there is none (``SmgOptions.kv_batch_far``)."""
        pools = self.tokenizer_pools
        return pools[0].kv_batch(raw) if pools else None

    def _count_usage(self, ex: Execution) -> None:
        """One request, its prompt counted once: a request's choices after the first (each its
        own execution, ``gateway.core.choices``) add their output tokens only, as the response's
        ``usage`` counts them."""
        p = ex.prep
        if p.sampling.choice:
            self.usage.record(p.tenant, p.model, 0, 0, ex.completion_tokens, requests=0)
            return
        self.usage.record(p.tenant, p.model, ex.prompt_tokens, ex.cached_tokens, ex.completion_tokens)

    async def limit_use(self, tenant: str | None) -> dict[str, list[LimitUse]]:
        """Each tenant's rate limits (one tenant's; None: every configured one) and their use now."""
        keys = self.runner.keys.tenants() or {KEYLESS_TENANT: []}
        names = [tenant] if tenant is not None else sorted(keys)
        return {t: await self.limits.use(t, keys.get(t, [])) for t in names}

    def _resync_node(self, node: Node) -> None:
        self.events.resync(node)

    async def _index_recovered(self, node_ids: Set[str], reason: str) -> None:
        """Redis missed writes (degraded, failed) or lost data (restart, failover): exactly those
        nodes come back from fresh snapshots, which also set their capacity again."""
        nodes = [n for n in list(self.pool.nodes.values()) if n.id in node_ids]
        log.info("index_resyncing_nodes", reason=reason, nodes=[n.id for n in nodes])
        label = "index_recovered" if reason == "recovered" else f"index_{reason}"
        for node in nodes:
            self.metrics.resyncs.labels(label).inc()
            self.events.resync(node)

    @property
    def draining(self) -> bool:
        """Shutting down: new requests are refused (the runner's check), ``/readyz`` is 503."""
        return self.runner.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.runner.draining = value

    @property
    def models(self) -> set[str]:
        """The models served: those the nodes name (OpenAI-compatible workers list theirs), and
        the configured ``model`` for nodes that name none."""
        return self.pool.models(self.settings.model)

    def tokenizer_cache_bytes(self) -> dict[str, int]:
        """Tokenizer name -> bytes its segment cache holds (tokenizers without one left out)."""
        out: dict[str, int] = {}
        for tok in (self.tokenizer, *self.model_tokenizers.values()):
            stats = getattr(tok, "segment_stats", None)
            if stats is not None:
                out[tok.name] = int(stats.bytes)
        return out

    def _check_tenancy(self, address: str) -> None:
        """A worker that would mix tenants' prefixes in its engine cache, refused unless the
        operator agreed to a shared engine cache (``gateway.core.tenancy``)."""
        if self.pipeline.tenancy.refused(isolates=workers.salted(address)):
            raise ValueError(
                f"{address}: its protocol carries no cache salt, so its engine would share one "
                'prefix cache between this gateway\'s tenants (tenant_cache is "isolated")'
            )

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        s = self.settings
        refusal = workers.tenancy_refusal(s)
        if refusal:
            raise ValueError(refusal)
        self.pool.extend("prefill", s.prefill)
        self.pool.extend("decode", s.decode)
        self.pool.extend("monolithic", s.monolithic)
        self.pool.extend("monolithic", s.worker_urls)
        engine_tok = await worker_tokenizer(s)  # ``tokenizer = "engine"`` without a local path
        if engine_tok is not None:
            self.tokenizer = self.pipeline.tokenizer = engine_tok
            log.info(
                "tokenizer_loaded",
                tokenizer=engine_tok.name,
                origin=engine_tok.origin,
                **engine_tok.encoder_facts,
            )
        self.tokenizer_pools = tokenizer_pools(s, (self.tokenizer, *self.model_tokenizers.values()))
        if isinstance(self.index, ReplicatedIndex) and not await self.index.start():
            log.warning("index_peers_not_subscribed", detail="routing on this worker's own writes until then")
        for node in self.pool.nodes.values():
            self.events.watch(node)
        await self.pool.wait_ready(timeout=5.0)
        if self.membership.shared:  # changes made through other replicas before this one started
            try:
                await self.membership.sync()
                await self.switches.sync()
            except Exception as e:
                log.warning("membership_sync_failed", error=repr(e)[:200])
        if self.nudges is not None:
            self.nudges.start()
        self.membership.start()
        if self.discovery.configured:  # the workers it finds join before the gateway says it started
            try:
                await self.discovery.sync()
            except Exception as e:
                log.warning("discovery_sync_failed", error=repr(e)[:200])
            self.discovery.start()
        self.usage.start()
        tenants = len(set(s.api_key_map().values()))
        log.info(
            "gateway_started",
            prefill=len(s.prefill),
            decode=len(s.decode),
            monolithic=len(s.monolithic),
            workers=len(s.worker_urls),
            index=self.index.backend,
            auth=f"api keys, {tenants} tenant(s)" if tenants else KEYLESS_NOTICE,
        )
        shared = [n.id for n in self.pool.nodes.values() if self.shares_tenant_cache(n)]
        if shared:
            log.warning(
                "tenant_cache_shared",
                nodes=shared,
                detail="these engines keep one prefix cache for every tenant (tenant_cache = "
                '"shared"): a tenant\'s latency can tell what another sent; cached_tokens report '
                "only a tenant's own reuse",
            )

    def shares_tenant_cache(self, node: Node) -> bool:
        """The node's engine holds several tenants' prefixes in one cache."""
        return self.pipeline.tenancy.shares_cache(node.client.capabilities.tenant_salt)

    def node_samples(self) -> list[NodeSample]:
        """Every node's state for the scrape-time gauges (no I/O)."""
        out: list[NodeSample] = []
        for n in list(self.pool.nodes.values()):
            st = n.status
            out.append(
                NodeSample(
                    node=n.id,
                    role=n.role,
                    breaker=n.breaker.state,
                    routable=n.routable,
                    draining=n.draining,
                    queued_requests=st.queued_requests if st else 0,
                    queued_tokens=st.queued_tokens if st else 0,
                    running_requests=st.running_requests if st else 0,
                    capacity_blocks=st.capacity_blocks if st else 0,
                    used_blocks=st.used_blocks if st else 0,
                    pinned_blocks=st.pinned_blocks if st else 0,
                )
            )
        return out

    async def _add_node(self, role: str, address: str, options: WorkerOptions | None = None) -> Node:
        self._check_tenancy(address)
        if options is not None:
            self.worker_options[address] = options
        try:
            node = self.pool.add(role, address)
        except BaseException:
            if options is not None:
                self.worker_options.pop(address, None)
            raise
        self.events.watch(node)
        await self.pool.refresh(node, timeout=2.0)
        log.info("node_added", node=node.id, role=role, address=address, reachable=node.reachable)
        return node

    async def _forget_node(self, node: Node) -> None:
        self.events.forget(node)
        await self.pool.remove(node.address)
        self.worker_options.pop(node.address, None)
        log.info("node_removed", node=node.id, role=node.role, address=node.address)

    async def _forget_discovered(self, address: str) -> str | None:
        """A discovered worker gone from its source: out of the pool, its index entries kept for
        it to come back (``cluster.discovery``); its id."""
        node = self.pool.nodes.get(address)
        if node is None:
            return None
        await self._forget_node(node)
        return node.id

    async def add_node(self, role: str, address: str, options: WorkerOptions | None = None) -> Node:
        """Register a node at runtime: poll its stats and follow its KV events; every replica
        sharing this one's Redis does the same. ``options``: what an smg-style registration
        says of the worker (``workers.WorkerOptions``).

        Raises ValueError for an unknown role or an address already registered.
        """
        node = await self._add_node(role, address, options)
        await self.membership.record(node, present=True)
        return node

    async def remove_node(self, node: Node) -> int:
        """Forget a node: stop its watchers, close its channel (in-flight calls on it end) and
        drop its blocks from the index; every replica forgets it. Returns how many blocks the
        index forgot."""
        await self._forget_node(node)
        await self.membership.record(node, present=False)
        forgotten = await self.index.clear_node(node.id)
        log.info("node_index_cleared", node=node.id, index_blocks=forgotten)
        return forgotten

    async def drain_node(self, node: Node, drain: bool) -> None:
        """No new work for the node (or again, ``drain=False``), on every replica."""
        node.draining = drain
        await self.membership.record(node, present=True)

    async def _close_membership(self) -> None:
        await self.membership.close()
        if self.nudges is not None:
            await self.nudges.close()

    async def _close_tokenizer_pools(self) -> None:
        for pool in self.tokenizer_pools:
            await pool.aclose(TOKENIZER_POOL_STOP_S)

    async def stop(self) -> None:
        """Close every part in turn, each bounded and logged as a ``shutdown_stage`` line
        (``gateway.shutdown``): a background task stuck in a call to a Redis node that does not
        answer must not keep the process from exiting, and the log names the part that was slow."""
        self.runner.close()
        stages: tuple[tuple[str, Callable[[], Awaitable[None]], float], ...] = (
            ("discovery", self.discovery.close, CLOSE_TIMEOUT_S),
            ("membership", self._close_membership, CLOSE_TIMEOUT_S),
            ("usage", self.usage.close, CLOSE_TIMEOUT_S),
            ("rate_limits", self.limits.close, CLOSE_TIMEOUT_S),
            ("pipeline", self.pipeline.close, CLOSE_TIMEOUT_S),
            ("tokenizer_processes", self._close_tokenizer_pools, CLOSE_TIMEOUT_S),
            ("kv_events", self.events.close, CLOSE_TIMEOUT_S),
            ("nodes", self.pool.close, CLOSE_TIMEOUT_S),
            ("index", self.index.close, 2.0),
            ("state", self.state.close, 2.0),
        )
        for name, close, bound_s in stages:
            await shutdown.stage(name, close, bound_s)
