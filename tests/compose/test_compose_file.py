"""docker-compose.yml, the Dockerfile and the observability files, checked without Docker."""

from __future__ import annotations

import fnmatch
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from prefixgate.cli import build_parser
from prefixgate.gateway.config import Settings
from tests.compose.topology import (
    COMPOSE_FILE,
    REPO,
    container_ports,
    default_profile,
    depends_on,
    environment,
    interpolate,
    is_prefixgate,
    load_compose,
    local_plan,
    services,
    start_order,
)
from tests.helpers import free_port

DEPLOY = REPO / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "prefixgate.json"
CORE = ["redis", "gateway", "prefill-1", "prefill-2", "decode-1", "decode-2", "decode-3", "decode-4"]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose()


def test_compose_file_matches_the_compose_specification() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "check_jsonschema",
            "--builtin-schema",
            "vendor.compose-spec",
            str(COMPOSE_FILE),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_schema_check_rejects_a_broken_file(tmp_path: Path) -> None:
    """The validation above is not vacuous: a misspelt key fails it."""
    broken = tmp_path / "docker-compose.yml"
    redis_check = '    healthcheck:\n      test: ["CMD", "redis-cli", "ping"]'
    text = COMPOSE_FILE.read_text()
    assert redis_check in text
    broken.write_text(text.replace(redis_check, redis_check.replace("healthcheck", "healthchek")))
    out = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(broken)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "healthchek" in out.stdout


def test_reference_topology(compose: dict[str, Any]) -> None:
    svcs = services(compose)
    core = [n for n, s in svcs.items() if default_profile(s)]
    assert sorted(core) == sorted(CORE)
    assert svcs["redis"]["image"].startswith("redis:7")
    assert svcs["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    roles = {
        n: s["command"][s["command"].index("--role") + 1]
        for n, s in svcs.items()
        if "node" in s.get("command", [])
    }
    assert roles == {
        "prefill-1": "prefill",
        "prefill-2": "prefill",
        **{f"decode-{i}": "decode" for i in range(1, 5)},
    }
    assert start_order(svcs)[-1] in ("gateway", "grafana")  # nothing core waits on the gateway's dependants


def test_gateway_waits_for_healthy_redis_and_nodes(compose: dict[str, Any]) -> None:
    svcs = services(compose)
    deps = depends_on(svcs["gateway"])
    assert deps == {n: "service_healthy" for n in CORE if n != "gateway"}


def test_every_core_service_has_a_healthcheck(compose: dict[str, Any]) -> None:
    for name in CORE:
        hc = services(compose)[name].get("healthcheck")
        assert hc and hc["test"][0] in ("CMD", "CMD-SHELL"), name
    for name, svc in services(compose).items():
        if is_prefixgate(svc):
            assert svc["healthcheck"]["test"] == ["CMD", "python", "/app/deploy/healthcheck.py"], name
            target = environment(svc, {})["PREFIXGATE_HEALTHCHECK"]
            expected = "http://127.0.0.1:8000/healthz" if name == "gateway" else "grpc://127.0.0.1:50051"
            assert target == expected, name


def test_only_the_gateway_publishes_ports(compose: dict[str, Any]) -> None:
    svcs = services(compose)
    published = {n: s["ports"] for n, s in svcs.items() if default_profile(s) and s.get("ports")}
    assert published == {"gateway": ["8000:8000", "50051:50051"]}
    env = environment(svcs["gateway"], {})
    assert (env["PREFIXGATE_PORT"], env["PREFIXGATE_GRPC_PORT"]) == ("8000", "50051")
    # The optional observability services are reachable from this machine only.
    for name in ("prometheus", "grafana"):
        assert svcs[name]["profiles"] == ["observability"]
        assert all(str(p).startswith("127.0.0.1:") for p in svcs[name]["ports"]), name


def test_every_command_is_a_valid_prefixgate_invocation(compose: dict[str, Any]) -> None:
    parser = build_parser()
    ours = {n: s for n, s in services(compose).items() if is_prefixgate(s)}
    assert sorted(ours) == sorted(n for n in CORE if n != "redis")
    for name, svc in ours.items():
        args = parser.parse_args(svc["command"][1:])
        assert args.command == ("gateway" if name == "gateway" else "node"), name
        if name != "gateway":
            assert args.node_id == name
            assert args.host == "0.0.0.0" and args.port == 50051


def test_gateway_settings_come_from_prefixgate_variables(compose: dict[str, Any]) -> None:
    """Every PREFIXGATE_* the gateway gets is a real setting, and the node lists match the services."""
    from prefixgate.gateway.config import load_settings

    svcs = services(compose)
    env = environment(svcs["gateway"], {})
    known = {"PREFIXGATE_" + f.upper() for f in Settings.__dataclass_fields__} | {"PREFIXGATE_HEALTHCHECK"}
    assert set(env) <= known, set(env) - known
    settings = load_settings(environ=env)
    nodes = {n for n in svcs if n.startswith(("prefill-", "decode-"))}
    assert settings.prefill == [f"{n}:50051" for n in sorted(nodes) if n.startswith("prefill")]
    assert settings.decode == [f"{n}:50051" for n in sorted(nodes) if n.startswith("decode")]
    assert settings.redis == "redis://redis:6379/0"
    assert (settings.host, settings.port, settings.grpc_port) == ("0.0.0.0", 8000, 50051)
    assert settings.admin_token == ""  # ${PREFIXGATE_ADMIN_TOKEN:-} with nothing set


def test_prefixgate_services_share_one_image(compose: dict[str, Any]) -> None:
    ours = [s for s in services(compose).values() if is_prefixgate(s)]
    assert {(s["image"], s["build"]) for s in ours} == {("prefixgate:local", ".")}
    assert all(s.get("init") is True for s in ours)


def test_interpolation() -> None:
    env = {"A": "x", "E": ""}
    assert interpolate("${A}-${B:-d}-${E:-d}-${E-d}-$$A", env) == "x-d-d--$A"
    with pytest.raises(ValueError):
        interpolate("${B:?needed}", env)


def test_local_plan_rewrites_only_addresses(compose: dict[str, Any]) -> None:
    svcs = services(compose)
    port_map = {(n, p): free_port() for n, s in svcs.items() for p in container_ports(s, {})}
    port_map[("redis", 6379)] = 6379
    plan = {s.name: s for s in local_plan(compose, port_map, {}, {"PREFIXGATE_REDIS_PREFIX": "t:"})}
    assert list(plan)[-1] == "gateway"
    gw = plan["gateway"].env
    assert gw["PREFIXGATE_REDIS"] == "redis://127.0.0.1:6379/0"
    assert gw["PREFIXGATE_PREFILL"] == ",".join(
        f"127.0.0.1:{port_map[(f'prefill-{i}', 50051)]}" for i in (1, 2)
    )
    assert gw["PREFIXGATE_PORT"] == str(port_map[("gateway", 8000)])
    assert gw["PREFIXGATE_HEALTHCHECK"] == f"http://127.0.0.1:{port_map[('gateway', 8000)]}/healthz"
    node = plan["decode-3"]
    assert node.env["PREFIXGATE_HEALTHCHECK"] == f"grpc://127.0.0.1:{port_map[('decode-3', 50051)]}"
    assert node.argv[node.argv.index("--port") + 1] == str(port_map[("decode-3", 50051)])
    assert node.argv[node.argv.index("--host") + 1] == "127.0.0.1"
    assert node.healthcheck == [sys.executable, str(DEPLOY / "healthcheck.py")]


# --- Dockerfile -----------------------------------------------------------------------------


def _dockerignore() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule for simple patterns: a path is out when it or a parent matches (last match wins)."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    out = False
    for pat in patterns:
        negate = pat.startswith("!")
        pat = pat.removeprefix("!")
        any_depth = pat.startswith("**/")
        core = pat.removeprefix("**/")
        for c in candidates:
            if fnmatch.fnmatch(c, core) or (any_depth and fnmatch.fnmatch(c.rsplit("/", 1)[-1], core)):
                out = not negate
    return out


def test_dockerfile_layers_user_and_healthcheck() -> None:
    text = (REPO / "Dockerfile").read_text()
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert lines[0] == "FROM python:3.11-slim"
    copies = [ln for ln in lines if ln.startswith("COPY")]
    # Dependencies from pyproject.toml before the source: the dependency layer survives code edits.
    assert copies[0].split()[1:-1] == ["pyproject.toml", "deploy/skeleton.py"]
    assert copies[1] == "COPY . /app"
    assert text.index('pip install "/tmp/deps') < text.index("COPY . /app") < text.index("--no-deps")
    user = re.search(r"^USER (\S+)", text, re.M)
    assert user and user.group(1).split(":")[0] not in ("root", "0")
    assert 'CMD ["python", "/app/deploy/healthcheck.py"]' in text
    # What the image needs is in the build context, what it doesn't is not.
    patterns = _dockerignore()
    for needed in (
        "pyproject.toml",
        "README.md",
        "deploy/skeleton.py",
        "deploy/healthcheck.py",
        "prefixgate/cli.py",
        "prefixgate/gateway",
        "gateway/httpfront/app.py",
        "proto/prefixgate/v1/node_pb2.py",
        "backends/profiles.py",
    ):
        assert (REPO / needed).exists() and not _ignored(needed, patterns), needed
    for unwanted in (".git/config", "tests/helpers.py", "gateway/__pycache__/cli.cpython-311.pyc"):
        assert _ignored(unwanted, patterns), unwanted


def test_skeleton_lays_out_every_package(tmp_path: Path) -> None:
    """The dependency layer's skeleton has every package setuptools will look for."""
    (tmp_path / "pyproject.toml").write_bytes((REPO / "pyproject.toml").read_bytes())
    out = subprocess.run(
        [sys.executable, str(DEPLOY / "skeleton.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    dirs = [Path(d) for d in out.stdout.removeprefix("skeleton:").split()]
    assert Path("prefixgate") in dirs  # the root every other package is installed under
    for d in dirs:
        assert (tmp_path / d / "__init__.py").is_file()
        assert (REPO / d / "__init__.py").is_file(), f"{d}: not a package in the source tree"
    assert (tmp_path / "README.md").is_file()


def test_healthcheck_reports_unhealthy_targets() -> None:
    port = free_port()  # nothing listens there
    for target in (f"http://127.0.0.1:{port}/healthz", f"grpc://127.0.0.1:{port}", "tcp://x:1"):
        out = subprocess.run(
            [sys.executable, str(DEPLOY / "healthcheck.py"), target],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 1 and "unhealthy" in out.stderr, (target, out.stderr)


# --- Prometheus and Grafana -----------------------------------------------------------------


def test_prometheus_scrapes_the_gateway(compose: dict[str, Any]) -> None:
    svc = services(compose)["prometheus"]
    mount = next(v for v in svc["volumes"] if "prometheus.yml" in v)
    src, dst = mount.split(":")[:2]
    assert (REPO / src).resolve() == DEPLOY / "prometheus" / "prometheus.yml"
    assert f"--config.file={dst}" in svc["command"]
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == ["gateway:8000"]


def test_grafana_provisioning_points_at_the_dashboard(compose: dict[str, Any]) -> None:
    svc = services(compose)["grafana"]
    mounts = dict(tuple(v.split(":")[:2]) for v in svc["volumes"])
    prov = DEPLOY / "grafana" / "provisioning"
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    datasource = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((prov / "dashboards" / "prefixgate.yml").read_text())["providers"][0]
    assert mounts["./deploy/grafana/dashboards"] == provider["options"]["path"]
    assert svc["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == (
        provider["options"]["path"] + "/" + DASHBOARD.name
    )
    dashboard = json.loads(DASHBOARD.read_text())
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p.get("targets", [])}
    assert uids == {datasource["uid"]}


def test_dashboard_shows_the_four_numbers_and_routing() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p.get("targets", []))
    for metric in (
        "prefixgate_ttft_seconds_bucket",
        "prefixgate_prefill_seconds_bucket",
        "prefixgate_kv_transfer_seconds_bucket",
        "prefixgate_cached_tokens_total",
        "prefixgate_prompt_tokens_total",
    ):
        assert metric in exprs, metric
    assert "sum by (route) (rate(prefixgate_requests_total" in exprs
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
