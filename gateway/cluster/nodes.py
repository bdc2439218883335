"""The gateway's view of its nodes: clients, polled status, local load, health.

Each node is polled for its status every ``stats_interval_s``; the poll is also the active
health probe: bounded by ``probe_timeout_s``, so a node that accepts connections but answers no
call (wedged, e.g. stopped) is noticed as surely as one that refuses them. Failed probes make the
node unreachable at once and, ``failures_to_trip`` in a row (``PROBE_FAILURES_TO_TRIP``), open its
circuit breaker; once ``successes_to_rejoin`` probes in a row pass again the node is reachable and
a breaker the probes opened lets one trial request through (half-open), whose outcome closes or
re-opens the breaker.

A node whose breaker opens (probes or failed requests) is declared gone: ``Node.gone`` wakes every
attempt still waiting on it for a first token, which is then retried elsewhere at once rather than
after its first-token deadline. One missed probe only takes a node out of routing: a node slow to
answer its status once keeps the prefills it is computing.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import structlog

from prefixgate.cachetier.tasks import stop_tasks
from prefixgate.gateway import nodeclient
from prefixgate.gateway.cluster.breaker import HALF_OPEN, OPEN, CircuitBreaker
from prefixgate.gateway.config import DEFAULT_MODEL
from prefixgate.gateway.nodeclient import CostProfile, KVFormat, NodeClient, NodeFailure, NodeStatus
from prefixgate.gateway.nodeclient.nominal import NOMINAL_PROFILE
from prefixgate.gateway.routing import NodeView
from prefixgate.gateway.routing.costmodel import prefill_seconds
from prefixgate.gateway.routing.deadline import Speed
from prefixgate.gateway.vocab import Role

log = structlog.get_logger("prefixgate.nodes")

ROLES = tuple(r.value for r in Role)  # in the order admin lists them
MIN_TIMED_PREFILL_S = 0.005
MAX_OVERRUN = 64.0
MIN_TIMED_TOKENS = 64  # a prefill this short is mostly fixed overhead: its rate says little
SLOWNESS_DEADBAND = 1.5
PROBE_TIMEOUT_S = 1.5
PROBE_FAILURES_TO_TRIP = 2


def went_down(was_up: bool, up: bool) -> bool:
    """Whether a node's change of state declares it gone (pure: the caller knows both states)."""
    return was_up and not up


class Spell:
    """One spell a node is up: ended once, when the node is declared gone, calling back whoever
    watches it then. A callback on the spell instead of a task awaiting an event: every attempt
    and every stream that may migrate watches its nodes, and a task each cost more than the
    rest of their bookkeeping."""

    __slots__ = ("_watchers", "ended")

    def __init__(self) -> None:
        self.ended = False
        self._watchers: dict[int, Callable[[], None]] = {}

    def watch(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` when the spell ends (at once when it has); the function returned
        stops watching. Callbacks must not raise: they wake a waiter, nothing more."""
        if self.ended:
            callback()
            return _nothing
        key = next(_WATCH_KEYS)
        self._watchers[key] = callback

        def unwatch() -> None:
            self._watchers.pop(key, None)

        return unwatch

    def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        watchers, self._watchers = self._watchers, {}
        for callback in watchers.values():
            callback()


def _nothing() -> None:
    return None


_WATCH_KEYS = itertools.count()


class Departure:
    """Wakes whoever waits on a node when it is declared gone: one ``Spell`` per spell the node
    is up, ended when the spell ends and replaced by a fresh one, so an attempt started after the
    node came back watches the new spell's."""

    def __init__(self) -> None:
        self._spell = Spell()
        self._up = True

    @property
    def spell(self) -> Spell:
        """The current spell's: ended once the node goes down."""
        return self._spell

    def observe(self, up: bool) -> bool:
        """The node's state now; True when that declares it gone (its watchers are called)."""
        down = went_down(self._up, up)
        self._up = up
        if down:
            spell, self._spell = self._spell, Spell()
            spell.end()
        return down


class Lease:
    """A request's load on a node (``Node.load``), given back when its block is left or before
    (``release``, idempotent). A class of its own, not a generator's context manager: every
    attempt takes one, and contextlib's wrapping costs more than the counting."""

    __slots__ = ("_node", "_tokens")

    def __init__(self, node: Node, tokens: int) -> None:
        self._node: Node | None = node
        self._tokens = tokens
        node.local_requests += 1
        node.local_tokens += tokens

    def release(self) -> None:
        node, self._node = self._node, None
        if node is not None:
            node.local_requests -= 1
            node.local_tokens -= self._tokens

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class _Counted:
    """One of a node's counts (``attr``) taken for the length of a block (``Node.dispatched``,
    ``Node.streaming``), as ``Lease`` is for the load."""

    __slots__ = ("_attr", "_node")

    def __init__(self, node: Node, attr: str) -> None:
        self._node, self._attr = node, attr

    def __enter__(self) -> None:
        setattr(self._node, self._attr, getattr(self._node, self._attr) + 1)

    def __exit__(self, *exc: object) -> None:
        setattr(self._node, self._attr, getattr(self._node, self._attr) - 1)


@dataclass(eq=False)
class Node:
    """One node as this gateway knows it."""

    role: str
    address: str
    client: NodeClient
    node_id: str = ""
    status: NodeStatus | None = None
    status_at: float = 0.0
    reachable: bool = False
    draining: bool = False
    # This gateway's own in-flight work on the node.
    local_requests: int = 0
    local_tokens: int = 0
    active_streams: int = 0
    # Attempts whose stream is on the node, from their dispatch to their first token (then an
    # active stream): the streams its views count before the node reports them.
    pending_streams: int = 0
    # Ours in the last status, as (requests, prefill tokens) when it arrived: the rest is other
    # gateways' work. Our requests that finished since, or went on to decode, are not load.
    own_at_status: tuple[int, int] = (0, 0)
    mispredictions: int = 0
    probe_failures: int = 0
    probe_successes: int = 0  # in a row, since the last failed probe
    last_error: str = ""
    # Why the node takes no work though it answers its probes (empty: it may take work): what it
    # reported makes every request fail there (``NodePool.refusal``).
    refused: str = ""
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    # Observed / estimated prefill time (EWMA): a node slower than it claims gets less traffic.
    slowness: float = 1.0
    # For a node that states no prefill speed: the rate (tokens/s) its prefills went at as the
    # gateway timed them (EWMA; 0: none timed yet).
    measured_tokens_per_s: float = 0.0
    overrun: float = 1.0  # first-token deadlines here are this many times the prediction (ran_past)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    departure: Departure = field(default_factory=Departure, repr=False)
    _role: Role = field(init=False, repr=False)  # ``role`` as the enum, made once: views take it

    def __post_init__(self) -> None:
        self._role = Role(self.role)

    @property
    def id(self) -> str:
        return self.node_id or self.address

    @property
    def gone(self) -> Spell:
        """Ended when the node is next declared gone (its breaker opens): what an attempt waiting
        for its first token here, and a stream that may migrate from it, watch."""
        return self.departure.spell

    def settle(self) -> None:
        """After the breaker or the probe changed the node's state: a breaker that opened wakes
        the attempts waiting on the node."""
        if self.departure.observe(self.breaker.state != OPEN):
            log.warning("node_gone", node=self.id, address=self.address, error=self.last_error[:200])

    def load(self, tokens: int) -> Lease:
        """Count a request of ours on the node, with its ``tokens`` to prefill, until it is done
        there (its prefill, for one that goes on to decode: the lease may be given back then,
        before the block ends): between two stats polls the policies see the work just sent
        only through this. A context manager: ``with node.load(n) as lease``."""
        return Lease(self, tokens)

    def dispatched(self) -> _Counted:
        """Count an attempt's stream on the node from its dispatch until the attempt ends (at its
        first token the execution takes ``streaming`` instead, with no await in between): a
        split request spends its prefill on another node, and a decode node chosen by streams
        would otherwise look idle to every request dispatched meanwhile, and take them all."""
        return _Counted(self, "pending_streams")

    def streaming(self) -> _Counted:
        """Count a stream of ours on the node from its first token until it is closed: the one
        place ``active_streams`` is taken and given back, so no path leaks or releases it twice."""
        return _Counted(self, "active_streams")

    @property
    def instance_id(self) -> str:
        return self.status.instance_id if self.status is not None else ""

    @property
    def routable(self) -> bool:
        return (
            self.reachable
            and not self.draining
            and not self.refused
            and self.status is not None
            and self.breaker.allows(time.monotonic())
        )

    @property
    def healthy(self) -> bool:
        return self.reachable and self.breaker.state == "closed"

    def observe_prefill(self, estimated_s: float, observed_s: float, alpha: float = 0.3) -> None:
        """Learn how much slower (or faster) the node is than its profile claims.

        Prefills too short to time well (scheduler jitter dominates) teach nothing.
        """
        if estimated_s < MIN_TIMED_PREFILL_S or observed_s <= 0:
            return
        ratio = min(100.0, max(0.1, observed_s / estimated_s))
        self.slowness = (1 - alpha) * self.slowness + alpha * ratio

    def observe_rate(self, tokens: int, seconds: float, alpha: float = 0.3) -> None:
        """Learn the speed of a node that states none from one prefill the gateway timed (from
        dispatch to its end: the node's queue included, so the rate errs on the slow side, which
        lengthens the first-token deadline rather than cutting a healthy prefill)."""
        if tokens < MIN_TIMED_TOKENS or seconds < MIN_TIMED_PREFILL_S:
            return
        rate = tokens / seconds
        m = self.measured_tokens_per_s
        self.measured_tokens_per_s = rate if m <= 0 else (1 - alpha) * m + alpha * rate

    def ran_past(self) -> None:
        """A prefill was cut at its deadline: the next ones on the node get twice as long (up to
        ``MAX_OVERRUN`` times the prediction), so a node slower than its profile, or than it was
        measured, is not cut again and again before a prefill done in time can teach its speed.
        Routing does not see it: a node that hung once is not shunned once it is back."""
        self.overrun = min(MAX_OVERRUN, 2 * self.overrun)

    def in_time(self, tokens: int, seconds: float) -> None:
        """A prefill done in time: its rate learned (``observe_rate``), the overrun halved."""
        self.observe_rate(tokens, seconds)
        self.overrun = max(1.0, self.overrun / 2)

    @property
    def prefill_speed(self) -> Speed | None:
        """The prefill speed a first-token deadline is predicted with: the node's profile slowed by
        what it was observed to lag behind it (never sped up: a deadline errs long), else the
        rate the gateway measured; either slowed by the ``overrun``; None: unknown."""
        prof = self.status.profile if self.status is not None else None
        # a figure declared for a worker that states none is no measure of it
        if prof is not None and prof.prefill_tokens_per_s > 0 and prof != NOMINAL_PROFILE:
            slow = max(1.0, self.slowness) * self.overrun
            return Speed(prof.prefill_tokens_per_s / slow, prof.attention_coeff_s * slow)
        if self.measured_tokens_per_s > 0:
            return Speed(self.measured_tokens_per_s / self.overrun)
        return None

    def _routing_rate(self, prof: CostProfile | None) -> float:
        """The prefill rate the policy weighs the node with: its profile's slowed by what it lags
        behind it; for a node stating none (an SMG worker) the rate the gateway measured, so a
        slow one loses its share; until measured, as good as any (it is tried, then timed)."""
        if prof is not None and prof.prefill_tokens_per_s > 0:
            return prof.prefill_tokens_per_s / self.speed_factor
        return self.measured_tokens_per_s if self.measured_tokens_per_s > 0 else 1e9

    @property
    def speed_factor(self) -> float:
        """The learned slowness, with a dead band so equal nodes with noisy timings stay equal."""
        s = self.slowness
        return s if s > SLOWNESS_DEADBAND or s < 1 / SLOWNESS_DEADBAND else 1.0

    @property
    def models(self) -> tuple[str, ...]:
        """The models the node says it serves (empty: it does not say)."""
        return self.status.models if self.status is not None else ()

    def serves(self, model: str, default: str = DEFAULT_MODEL) -> bool:
        """Whether the node serves ``model``; one that names no model serves ``default``."""
        models = self.models
        return model in models if models else model == default

    @property
    def max_context_tokens(self) -> int:
        """The longest request the node says it serves (0: it does not say)."""
        return self.status.max_context_tokens if self.status is not None else 0

    @property
    def capacity_blocks(self) -> int:
        return self.status.capacity_blocks if self.status is not None else 0

    def profile_prefill_s(self, new_tokens: int, context_tokens: int) -> float:
        """Prefill time the node's own profile predicts (before learned slowness)."""
        prof = self.status.profile if self.status is not None else None
        if prof is None or prof.prefill_tokens_per_s <= 0 or new_tokens <= 0:
            return 0.0
        return prefill_seconds(prof.prefill_tokens_per_s, prof.attention_coeff_s, new_tokens, context_tokens)

    def outstanding_tokens(self) -> int:
        """``view().outstanding_tokens`` without the rest of the view: prompt tokens queued on
        the node, ours as they are now and other gateways' as its last status said."""
        st = self.status
        if st is None:
            return self.local_tokens
        remote = int(st.queued_tokens) - self.own_at_status[1]
        return self.local_tokens + remote if remote > 0 else self.local_tokens

    def view(self) -> NodeView:
        """The node as routing sees it now. A request views every node it may go to: the status
        is read once here, its properties not walked again."""
        st = self.status
        streams = self.active_streams + self.pending_streams
        routable = self.routable  # first: its check moves an open breaker to half-open
        trial = self.breaker.state == HALF_OPEN
        remote_reqs = capacity = used = context = 0
        prof: CostProfile | None = None
        fmt: KVFormat | None = None
        if st is not None:
            # Work queued on the node by other gateways (ours is counted locally, as it is now):
            # the status less what was ours when it was taken. Less ours as it is now, our
            # requests done (or decoding) since the poll would stay counted as someone else's
            # until the next one, and a node that just served a burst would look loaded when
            # it is idle.
            own_reqs = self.own_at_status[0]  # the tokens likewise (``outstanding_tokens``)
            queued = int(st.queued_requests + st.running_requests)
            remote_reqs = max(0, queued - own_reqs)
            # The node's count holds ours, or some of them (a split request reaches its decode
            # node once prefilled): never counted twice, at least what either count says.
            if queued > streams:
                streams = queued
            prof, fmt = st.profile, st.kv_format
            capacity, context = st.capacity_blocks, st.max_context_tokens
            used = st.in_use_blocks  # a warm idle cache is not busy
        return NodeView(
            node_id=self.node_id or self.address,
            outstanding_requests=self.local_requests + remote_reqs,
            outstanding_tokens=self.outstanding_tokens(),
            prefill_tokens_per_s=self._routing_rate(prof),
            attention_coeff_s=(prof.attention_coeff_s * self.speed_factor) if prof else 0.0,
            transfer_bytes_per_s=prof.transfer_bytes_per_s if prof else 0.0,
            kv_bytes_per_token=fmt.bytes_per_token if fmt else 0,
            capacity_blocks=capacity,
            routable=routable,
            trial=trial,
            role=self._role,
            kv_format=fmt,
            streams=streams,
            used_blocks=used,
            max_context_tokens=context,
        )


class NodePool:
    """Every node of every role; keeps their status fresh (the health probe) and tells who can
    take work."""

    def __init__(
        self,
        stats_interval_s: float = 0.5,
        *,
        connect: Callable[[str], NodeClient] = nodeclient.connect,
        probe_timeout_s: float = PROBE_TIMEOUT_S,
        poll: bool = True,
        breaker: Callable[[], CircuitBreaker] = CircuitBreaker,
        failures_to_trip: int = PROBE_FAILURES_TO_TRIP,
        successes_to_rejoin: int = 1,
        block_size: int = 0,
    ) -> None:
        self.nodes: dict[str, Node] = {}  # by address
        self.block_size = block_size  # the gateway's (0: no node is checked against it)
        self.stats_interval_s = stats_interval_s
        self.probe_timeout_s = probe_timeout_s
        self.failures_to_trip = failures_to_trip
        self.successes_to_rejoin = successes_to_rejoin
        self._breaker = breaker
        self._connect = connect
        self._poll_nodes = poll  # False: no background probe (the caller refreshes)
        self._closed = False

    def add(self, role: str, address: str) -> Node:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if address in self.nodes:
            raise ValueError(f"node {address} is already registered")
        client = self._connect(address)
        if role != Role.MONOLITHIC and not client.capabilities.split:
            raise ValueError(f"node {address} serves whole requests only: add it as a monolithic node")
        node = Node(role=role, address=address, client=client, breaker=self._breaker())
        self.nodes[address] = node
        if self._poll_nodes and not self._closed:
            node.tasks.append(asyncio.create_task(self._poll(node), name=f"stats:{address}"))
        return node

    def extend(self, role: str, addresses: Iterable[str]) -> None:
        for a in addresses:
            self.add(role, a)

    async def remove(self, address: str) -> Node | None:
        node = self.nodes.pop(address, None)
        if node is not None:
            await self._stop_node(node)
        return node

    def by_id(self, node_id: str) -> Node | None:
        for n in self.nodes.values():
            if n.id == node_id or n.address == node_id:
                return n
        return None

    def role(self, role: str) -> list[Node]:
        return [n for n in self.nodes.values() if n.role == role]

    def routable(self, role: str) -> list[Node]:
        return [n for n in self.nodes.values() if n.role == role and n.routable]

    def _names(self) -> tuple[set[str], bool]:
        """The model names the nodes give, and whether some node gives none."""
        named: set[str] = set()
        unnamed = False
        for n in self.nodes.values():
            if n.models:
                named.update(n.models)
            else:
                unnamed = True
        return named, unnamed

    def canonical(self, model: str, alias: str) -> str:
        """The name the nodes know ``model`` by: ``alias`` (the ``model`` setting) stands for the
        one model every node names, when they all name the same one."""
        if alias and model == alias:
            named, unnamed = self._names()
            if len(named) == 1 and not unnamed:
                return next(iter(named))
        return model

    def serving(self, model: str, alias: str) -> list[Node]:
        """Every node of every role serving ``model`` (see ``Node.serves``; ``alias`` is the
        ``model`` setting); all of them when no node names a model (one model: requests were
        checked against it when parsed)."""
        nodes = list(self.nodes.values())
        if not any(n.models for n in nodes):
            return nodes
        model = self.canonical(model, alias)
        return [n for n in nodes if n.serves(model, alias or DEFAULT_MODEL)]

    def models(self, alias: str) -> set[str]:
        """The models served: those the nodes name; the ``model`` setting (``alias``, else
        ``DEFAULT_MODEL``) for nodes that name none (or when no node names any); and ``alias``
        as another name of the one model the nodes name."""
        named, unnamed = self._names()
        out = set(named)
        if unnamed or not named:
            out.add(alias or DEFAULT_MODEL)
        elif alias and len(named) == 1:
            out.add(alias)
        return out

    async def refresh(self, node: Node, timeout: float | None = None) -> bool:
        """Ask the node for its status: the health probe. Feeds reachability and the breaker."""
        try:
            st = await node.client.status(timeout=self.probe_timeout_s if timeout is None else timeout)
        except Exception as e:  # an answer the adapter cannot read is a failed probe, not a dead poll
            error = str(e) if isinstance(e, NodeFailure) else f"unreadable status: {e!r}"
            if node.reachable:
                log.warning("node_unreachable", node=node.id, address=node.address, error=error[:200])
            node.reachable = False
            node.last_error = error[:500]
            node.probe_failures += 1
            node.probe_successes = 0
            if node.probe_failures >= self.failures_to_trip:
                node.breaker.trip(time.monotonic())
                node.settle()
            return False
        node.probe_successes += 1
        # A node that failed its probes rejoins after ``successes_to_rejoin`` passing ones in a
        # row; one that never answered before joins on its first.
        rejoins = node.status is None or node.probe_successes >= self.successes_to_rejoin
        if not node.reachable and rejoins:
            log.info("node_reachable", node=st.node_id or node.address, address=node.address, role=st.role)
        node.status = st
        node.status_at = time.monotonic()
        node.own_at_status = (node.local_requests + node.active_streams, node.local_tokens)
        node.node_id = st.node_id or node.address
        node.probe_failures = 0
        self._judge(node, st)
        if not (node.reachable or rejoins):
            return False
        node.reachable = True
        node.breaker.on_probe_ok(node.status_at)
        node.settle()
        return True

    def refusal(self, node: Node, st: NodeStatus) -> str:
        """Why the node, answering with ``st``, can serve no request from this gateway (empty:
        it can). A node given the prompt's block hashes at the gateway's block size checks them
        against its own page and refuses every request when the two differ: it is kept out of
        routing rather than blamed on each client with a 400."""
        page = st.kv_format.block_size
        if self.block_size and node.client.capabilities.block_hashes and page != self.block_size:
            return (
                f"its KV page is {page} tokens and the gateway hashes {self.block_size}-token"
                " blocks: start the node with the gateway's block size, or set the gateway's to"
                " the node's"
            )
        return ""

    def _judge(self, node: Node, st: NodeStatus) -> None:
        refused = self.refusal(node, st)
        if refused == node.refused:
            return
        if refused:
            log.warning("node_refused", node=node.id, address=node.address, reason=refused)
        else:
            log.info("node_accepted", node=node.id, address=node.address)
        node.refused = refused

    async def _poll(self, node: Node) -> None:
        while not self._closed:
            await self.refresh(node)
            await asyncio.sleep(self.stats_interval_s)

    async def wait_ready(self, timeout: float = 10.0) -> bool:
        """Until every node answered once (or the timeout)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(n.status is not None for n in self.nodes.values()):
                return True
            await asyncio.sleep(0.05)
        return False

    async def _stop_node(self, node: Node) -> None:
        tasks: list[asyncio.Future[Any]] = list(node.tasks)
        node.tasks.clear()
        await stop_tasks(tasks)  # cancelled until they end: one cancellation can be lost
        await node.client.close()

    async def close(self) -> None:
        self._closed = True
        for node in list(self.nodes.values()):
            await self._stop_node(node)
