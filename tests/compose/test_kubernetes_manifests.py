"""deploy/kubernetes, checked without a cluster: every object against the Kubernetes API's own
schemas (``kubernetes-validate``, strict: an unknown field is an error), the kustomization as
``kubectl kustomize`` renders it and every object as ``kubectl create --dry-run=client`` renders
it (when kubectl is installed; the kinds' discovery it asks first served from loopback), and the
parts agreeing with each other
and with prefixgate: the settings file loads as the gateway loads it, the nodes it lists are the
StatefulSets' pods, ports, probes and scrape annotations name what the gateway serves, the
containers' command lines parse, and the pods outlive the gateway's own shutdown grace."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from prefixgate.cli import build_parser
from prefixgate.gateway.config import load_settings
from prefixgate.gateway.ops.supervisor import STOP_MARGIN_S
from tests.helpers import REPO, Handler, serve_http

K8S = REPO / "deploy" / "kubernetes"
#: The oldest Kubernetes the manifests are for: native gRPC probes are GA from 1.27 and the
#: preStop ``sleep`` action from 1.30; 1.32 is the kubectl of Debian's kubernetes-client here.
VERSIONS = ("1.32.0", kubernetes_validate.latest_version())


def _objects() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    out = []
    for name in kustomization["resources"]:
        out += [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    return out


OBJECTS = _objects()


def _one(kind: str, name: str) -> dict[str, Any]:
    found = [o for o in OBJECTS if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name)
    return found[0]


def _container(obj: dict[str, Any]) -> dict[str, Any]:
    containers = obj["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return dict(containers[0])


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("obj", OBJECTS, ids=lambda o: f"{o['kind']}/{o['metadata']['name']}")
def test_every_object_is_valid_kubernetes(obj: dict[str, Any], version: str) -> None:
    kubernetes_validate.validate(obj, version, strict=True)


def test_the_schema_check_refuses_an_unknown_field() -> None:
    """The check above can fail: a misspelt field is caught."""
    bad = yaml.safe_load(yaml.safe_dump(_one("Deployment", "prefixgate-gateway")))
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {"path": "/readyz"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSIONS[0], strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_renders_the_kustomization() -> None:
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60, check=True
    )
    rendered = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert sorted((d["kind"], d["metadata"]["name"]) for d in rendered) == sorted(
        (o["kind"], o["metadata"]["name"]) for o in OBJECTS
    )
    for d in rendered:
        assert d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "prefixgate"
        kubernetes_validate.validate(d, VERSIONS[0], strict=True)


def _config(tmp_path: Path) -> tuple[dict[str, Any], Any]:
    text = _one("ConfigMap", "prefixgate-config")["data"]["prefixgate.toml"]
    path = tmp_path / "prefixgate.toml"
    path.write_text(text)
    return tomllib.loads(text), load_settings(str(path), {})


def test_the_settings_file_loads_and_lists_the_statefulsets_pods(tmp_path: Path) -> None:
    raw, settings = _config(tmp_path)
    assert settings.redis == "redis://prefixgate-redis:6379/0"
    redis = _one("Service", "prefixgate-redis")["spec"]["ports"][0]["port"]
    assert settings.redis.endswith(f":{redis}/0")
    for role in ("prefill", "decode"):
        sts = _one("StatefulSet", f"prefixgate-{role}")
        service = _one("Service", sts["spec"]["serviceName"])
        assert service["spec"]["clusterIP"] == "None"  # headless: a DNS name per pod
        port = service["spec"]["ports"][0]["port"]
        pods = [
            f"{sts['metadata']['name']}-{i}.{service['metadata']['name']}:{port}"
            for i in range(sts["spec"]["replicas"])
        ]
        assert raw[role] == pods
        assert getattr(settings, role) == pods
        cmd = _container(sts)["command"]
        assert cmd[cmd.index("--role") + 1] == role and cmd[cmd.index("--port") + 1] == str(port)


def test_the_gateway_pod_serves_what_its_probes_service_and_scrape_name(tmp_path: Path) -> None:
    _, settings = _config(tmp_path)
    deployment = _one("Deployment", "prefixgate-gateway")
    pod = deployment["spec"]["template"]
    container = _container(deployment)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": settings.port, "grpc": settings.grpc_port}
    assert settings.host == "0.0.0.0"  # reachable from the Service, not loopback only
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["startupProbe"]["httpGet"]["path"] == "/healthz"
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(settings.port)
    assert annotations["prometheus.io/path"] == "/metrics"
    service = {p["name"]: p for p in _one("Service", "prefixgate")["spec"]["ports"]}
    assert {n: p["targetPort"] for n, p in service.items()} == {"http": "http", "grpc": "grpc"}
    env = {e["name"]: e for e in container["env"]}
    assert env["PREFIXGATE_CONFIG"]["value"] == f"{container['volumeMounts'][0]['mountPath']}/prefixgate.toml"
    assert env["PREFIXGATE_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]["optional"] is True
    # the pod is given the gateway's grace for open requests, the preStop pause and a margin
    pause = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["spec"]["terminationGracePeriodSeconds"] >= settings.shutdown_grace_s + pause + STOP_MARGIN_S
    pdb = _one("PodDisruptionBudget", "prefixgate-gateway")
    assert pdb["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert pdb["spec"]["minAvailable"] < deployment["spec"]["replicas"]  # a drain can proceed


def test_the_gateways_account_may_read_the_pods_and_nothing_more() -> None:
    account = _one("ServiceAccount", "prefixgate-gateway")["metadata"]["name"]
    pod = _one("Deployment", "prefixgate-gateway")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account
    binding = _one("RoleBinding", "prefixgate-gateway-pod-reader")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    role = _one("Role", binding["roleRef"]["name"])
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]


def test_every_containers_command_line_parses() -> None:
    """The commands are prefixgate's own (``$(POD_NAME)`` as Kubernetes fills it in)."""
    parser = build_parser()
    for obj in OBJECTS:
        if obj["kind"] not in ("Deployment", "StatefulSet") or obj["metadata"]["name"] == "prefixgate-redis":
            continue
        container = _container(obj)
        assert container["image"] == "prefixgate:local"
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert obj["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == 10001  # the image's user
        argv = [a.replace("$(POD_NAME)", "prefixgate-pod-0") for a in container["command"]]
        assert argv[0] == "prefixgate"
        args = parser.parse_args(argv[1:])
        assert args.command in ("gateway", "node")


#: What ``kubectl create --dry-run=client`` asks the API before rendering: which resource each
#: kind is (discovery). Served from loopback for the kinds the manifests use, as an API server
#: would; kubectl then renders every object itself, sending nothing.
_DISCOVERY: dict[str, dict[str, Any]] = {
    "/api": {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []},
    "/apis": {
        "kind": "APIGroupList",
        "apiVersion": "v1",
        "groups": [
            {
                "name": g,
                "versions": [{"groupVersion": f"{g}/v1", "version": "v1"}],
                "preferredVersion": {"groupVersion": f"{g}/v1", "version": "v1"},
            }
            for g in ("apps", "policy", "rbac.authorization.k8s.io")
        ],
    },
}
_RESOURCES = {
    "/api/v1": [("configmaps", "ConfigMap"), ("services", "Service"), ("serviceaccounts", "ServiceAccount")],
    "/apis/apps/v1": [("deployments", "Deployment"), ("statefulsets", "StatefulSet")],
    "/apis/policy/v1": [("poddisruptionbudgets", "PodDisruptionBudget")],
    "/apis/rbac.authorization.k8s.io/v1": [("roles", "Role"), ("rolebindings", "RoleBinding")],
}
for _path, _kinds in _RESOURCES.items():
    _DISCOVERY[_path] = {
        "kind": "APIResourceList",
        "groupVersion": _path.removeprefix("/apis/").removeprefix("/api/"),
        "resources": [
            {"name": n, "singularName": k.lower(), "namespaced": True, "kind": k, "verbs": ["create", "get"]}
            for n, k in _kinds
        ],
    }


class _DiscoveryHandler(Handler):
    def do_GET(self) -> None:
        body = _DISCOVERY.get(self.path.split("?")[0])
        self.reply(200 if body is not None else 404, json.dumps(body).encode() if body is not None else b"{}")


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_renders_every_object_with_a_client_dry_run(tmp_path: Path) -> None:
    rendered = subprocess.run(
        ["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    (tmp_path / "all.yaml").write_text(rendered)
    with serve_http(_DiscoveryHandler) as url:
        # --validate=false: kubectl would download the API's OpenAPI document to validate against;
        # kubernetes-validate checks the same schemas above
        argv = ["kubectl", "create", "--dry-run=client", "--validate=false", "-o", "json"]
        argv += ["-f", str(tmp_path / "all.yaml"), "--server", url]
        # HOME: kubectl keeps its discovery cache under $HOME/.kube (without one, in the checkout)
        env = {"KUBECONFIG": os.devnull, "PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path)}
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    items, text, at = [], out.stdout, 0  # one JSON document per object, one after another
    decoder = json.JSONDecoder()
    while text[at:].strip():
        at += len(text[at:]) - len(text[at:].lstrip())
        item, at = decoder.raw_decode(text, at)
        items.append(item)
    assert sorted((i["kind"], i["metadata"]["name"]) for i in items) == sorted(
        (o["kind"], o["metadata"]["name"]) for o in OBJECTS
    )
