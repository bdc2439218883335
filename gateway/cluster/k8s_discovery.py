"""Workers found in Kubernetes: pods by label selector, per role, listed and then watched.

``discovery_kubernetes = ["prefill=app=sglang,role=prefill", "decode=app=sglang,role=decode"]``
(``ROLE=SELECTOR``, ROLE ``prefill``, ``decode``, ``monolithic`` or smg's ``regular``), in
``discovery_kubernetes_namespace`` (default: the gateway pod's own). A pod is a worker while it
is Running, Ready and not being deleted, at ``SCHEME://POD_IP:PORT``: the port from its
``prefixgate.io/port`` annotation, else ``discovery_kubernetes_port``; a prefill pod's bootstrap
port from ``sglang.ai/bootstrap-port`` (the annotation smg reads). The scheme is
``discovery_kubernetes_scheme`` (``grpc``: SGLang or vLLM; ``http``; ``prefixgate``: our nodes).

The API is reached from inside the cluster as a pod does (the service account's token and CA,
``KUBERNETES_SERVICE_HOST``), or at ``discovery_kubernetes_api`` (a ``kubectl proxy``, say). Each
selector is listed, then watched from the list's ``resourceVersion``; a watch that ends is
resumed, one the API says is too old (410) or that fails is replaced by a new list (the resync),
at most once a ``RELIST_PAUSE_S``. ``Discovery`` reads what the watches hold every interval.

``pod_worker`` and ``apply_event`` are pure.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from prefixgate.cachetier.tasks import stop_task
from prefixgate.gateway.cluster.discovery import MAX_WORKERS, Found, discovered
from prefixgate.gateway.cluster.worker_spec import ROLE_NAMES

if TYPE_CHECKING:
    from prefixgate.gateway.config import Settings

log = structlog.get_logger("prefixgate.discovery")

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
PORT_ANNOTATION = "prefixgate.io/port"
BOOTSTRAP_ANNOTATION = "sglang.ai/bootstrap-port"
SCHEMES = {"grpc": "grpc://", "http": "http://", "prefixgate": ""}
WATCH_TIMEOUT_S = 300  # the API ends a watch after this; it is resumed
RELIST_PAUSE_S = 1.0
MAX_LINE_BYTES = 4 * 1024 * 1024  # one watch event (a pod object)


@dataclass(frozen=True, slots=True)
class Selector:
    role: str
    labels: str


def parse_selector(entry: str) -> Selector:
    role, sep, labels = entry.partition("=")
    kinds = ROLE_NAMES
    if not sep or role.strip() not in kinds or not labels.strip():
        raise ValueError(
            f"discovery_kubernetes {entry!r}: expected ROLE=LABEL_SELECTOR, ROLE one of {', '.join(kinds)}"
        )
    return Selector(kinds[role.strip()], labels.strip())


def _int(value: Any) -> int | None:
    try:
        port = int(str(value))
    except (TypeError, ValueError):
        return None
    return port if 0 < port < 65536 else None


def pod_worker(pod: Mapping[str, Any], role: str, scheme: str, default_port: int) -> Found | None:
    """The worker a pod is now (None: not one: not running, not ready, going, no address)."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp") or status.get("phase") != "Running":
        return None
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ()
    )
    ip = status.get("podIP")
    if not ready or not isinstance(ip, str) or not ip:
        return None
    annotations = meta.get("annotations") or {}
    port = _int(annotations.get(PORT_ANNOTATION)) or default_port
    return discovered(role, scheme, ip, port, _int(annotations.get(BOOTSTRAP_ANNOTATION)))


def apply_event(pods: dict[str, Mapping[str, Any]], event: Mapping[str, Any]) -> str | None:
    """One watch event into ``pods`` (by uid); the new resourceVersion, or None for an ERROR."""
    kind = event.get("type")
    obj = event.get("object") or {}
    meta = obj.get("metadata") or {}
    if kind == "ERROR":
        return None
    version = str(meta.get("resourceVersion", ""))
    uid = str(meta.get("uid") or meta.get("name") or "")
    if kind == "DELETED":
        pods.pop(uid, None)
    elif kind in ("ADDED", "MODIFIED") and uid and len(pods) < MAX_WORKERS:
        pods[uid] = obj
    return version


class _Watch:
    """One selector's pods, kept current by list and watch."""

    def __init__(self, api: KubernetesAPI, selector: Selector) -> None:
        self.api, self.selector = api, selector
        self.pods: dict[str, Mapping[str, Any]] = {}
        self.listed = False
        self.task: asyncio.Task[None] | None = None

    async def run(self) -> None:
        while True:
            try:
                version: str | None = await self._list()
                while version is not None:
                    version = await self._watch(version)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the API away: the pods stay as they were until a list works
                log.warning("discovery_kubernetes_failed", selector=self.selector.labels, error=repr(e)[:300])
            await asyncio.sleep(RELIST_PAUSE_S)

    async def _list(self) -> str:
        body = await self.api.get_json(self.api.pods_path, {"labelSelector": self.selector.labels})
        items = body.get("items") or []
        self.pods = {str(p["metadata"].get("uid") or p["metadata"]["name"]): p for p in items[:MAX_WORKERS]}
        self.listed = True
        return str((body.get("metadata") or {}).get("resourceVersion", ""))

    async def _watch(self, version: str) -> str | None:
        """Follow events until the watch ends: the version to resume from, or None to list again."""
        params = {
            "labelSelector": self.selector.labels,
            "watch": "1",
            "resourceVersion": version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(WATCH_TIMEOUT_S),
        }
        async for event in self.api.stream_json(self.api.pods_path, params):
            if event.get("type") == "ERROR":
                code = (event.get("object") or {}).get("code")
                log.info("discovery_kubernetes_relist", selector=self.selector.labels, code=code)
                return None  # 410 Gone (too old) and the rest: a new list
            if event.get("type") == "BOOKMARK":
                version = str(
                    ((event.get("object") or {}).get("metadata") or {}).get("resourceVersion", version)
                )
                continue
            version = apply_event(self.pods, event) or version
        return version


class KubernetesAPI:
    """GET and watch under the API's base URL, with the service account's token when in a pod."""

    def __init__(self, base: str, namespace: str, token: str = "", ca: str | bool = True) -> None:
        import httpx  # with the first Kubernetes discovery: most gateways have none

        headers = {"authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.AsyncClient(
            base_url=base, headers=headers, verify=ca, timeout=httpx.Timeout(30.0, read=WATCH_TIMEOUT_S + 30)
        )
        self.pods_path = f"/api/v1/namespaces/{namespace}/pods"

    @classmethod
    def configured(cls, api: str, namespace: str) -> KubernetesAPI:
        if not namespace:
            ns_file = SERVICE_ACCOUNT / "namespace"
            namespace = ns_file.read_text().strip() if ns_file.exists() else "default"
        if api:
            return cls(api.rstrip("/"), namespace)
        host, port = (
            os.environ.get("KUBERNETES_SERVICE_HOST"),
            os.environ.get("KUBERNETES_SERVICE_PORT", "443"),
        )
        if not host:
            raise ValueError(
                "discovery_kubernetes: not in a pod (no KUBERNETES_SERVICE_HOST); "
                "set discovery_kubernetes_api"
            )
        token = (SERVICE_ACCOUNT / "token").read_text().strip()
        shown = f"[{host}]" if ":" in host else host
        return cls(f"https://{shown}:{port}", namespace, token, str(SERVICE_ACCOUNT / "ca.crt"))

    async def get_json(self, path: str, params: Mapping[str, str]) -> dict[str, Any]:
        r = await self.http.get(path, params=dict(params))
        r.raise_for_status()
        body = r.json()
        if not isinstance(body, dict):
            raise ValueError("the API's answer is not an object")
        return body

    async def stream_json(self, path: str, params: Mapping[str, str]) -> Any:
        async with self.http.stream("GET", path, params=dict(params)) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if len(line) > MAX_LINE_BYTES:
                    raise ValueError("a watch event over the size bound")
                if line.strip():
                    event = json.loads(line)
                    if isinstance(event, dict):
                        yield event

    async def close(self) -> None:
        await self.http.aclose()


class KubernetesSource:
    """Every selector's watch; ``found()`` the workers their pods are now."""

    def __init__(self, entries: Sequence[str], namespace: str, api: str, scheme: str, port: int) -> None:
        if scheme not in SCHEMES:
            raise ValueError(f"discovery_kubernetes_scheme: one of {', '.join(SCHEMES)}, got {scheme!r}")
        self.selectors = [parse_selector(e) for e in entries]
        self.namespace, self.api_url = namespace, api
        self.scheme, self.port = SCHEMES[scheme], port
        self.api: KubernetesAPI | None = None
        self.watches: list[_Watch] = []

    def start(self) -> None:
        if self.api is not None:
            return
        self.api = KubernetesAPI.configured(self.api_url, self.namespace)
        self.watches = [_Watch(self.api, s) for s in self.selectors]
        for w in self.watches:
            w.task = asyncio.create_task(w.run(), name=f"k8s:{w.selector.labels}")

    def found(self) -> dict[str, Found]:
        out: dict[str, Found] = {}
        for w in self.watches:
            for pod in w.pods.values():
                f = pod_worker(pod, w.selector.role, self.scheme, self.port)
                if f is not None:
                    out[f.address] = f
        return out

    @property
    def listed(self) -> bool:
        return all(w.listed for w in self.watches)

    async def close(self) -> None:
        for w in self.watches:
            await stop_task(w.task)
        if self.api is not None:
            await self.api.close()
            self.api = None


def kubernetes_source(settings: Settings) -> KubernetesSource | None:
    """The settings' Kubernetes discovery, or None when they ask for none."""
    s = settings
    if not s.discovery_kubernetes:
        return None
    return KubernetesSource(
        s.discovery_kubernetes,
        s.discovery_kubernetes_namespace,
        s.discovery_kubernetes_api,
        s.discovery_kubernetes_scheme,
        s.discovery_kubernetes_port,
    )
