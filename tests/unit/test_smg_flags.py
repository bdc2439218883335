"""``smg launch`` flags on ``prefixgate gateway``: each one taken flag maps onto the right setting,
every other smg flag is refused in one line with exit status 2, and a real gateway started with an
smg PD command line serves a chat and answers /metrics on its prometheus port."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from prefixgate.backends.hftok import TOKENIZER_DIR
from prefixgate.cli import build_parser, gateway_settings, main
from prefixgate.gateway.cluster.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from prefixgate.gateway.config import Settings
from prefixgate.gateway.core.auth import KeyRing
from prefixgate.gateway.ops.smg_flags import (
    POLICY_MAP,
    POLICY_REFUSED,
    REFUSED,
    SHARED,
    TAKEN,
    SmgFlagRefused,
)
from tests.helpers import free_port, spawn

SMG_FLAGS = [
    line.strip()
    for line in (Path(__file__).parent / "smg_launch_flags.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
]


def settings_of(*argv: str) -> Settings:
    """What ``prefixgate gateway ARGV`` would run with (the command's own parsing and mapping)."""
    return gateway_settings(build_parser().parse_args(["gateway", *argv]))


def test_every_smg_flag_is_shared_taken_or_refused() -> None:
    assert len(SMG_FLAGS) == 221  # smg 1.13.0's option strings, from its own parser
    known = set(SHARED) | set(TAKEN) | set(REFUSED)
    assert [f for f in SMG_FLAGS if f not in known] == []
    assert not set(TAKEN) & set(REFUSED) and not set(SHARED) & (set(TAKEN) | set(REFUSED))
    assert not known - set(SMG_FLAGS)  # nothing named that smg does not have


def test_taken_flags_map_to_their_settings() -> None:
    s = settings_of(
        "--pd-disaggregation", "--prefill", "grpc://127.0.0.1:1", "9000", "--decode", "grpc://127.0.0.1:2",
        "--host", "0.0.0.0", "--port", "30000",
        "--policy", "cache_aware",
        "--prometheus-host", "127.0.0.2", "--prometheus-port", "29000",
        "--api-key", "sk-one", "--tenant-api-key", "acme:sk-acme",
        "--max-concurrent-requests", "64", "--request-timeout-secs", "1800",
        "--retry-max-retries", "5", "--retry-initial-backoff-ms", "50", "--retry-max-backoff-ms", "30000",
        "--retry-backoff-multiplier", "1.5", "--retry-jitter-factor", "0.2",
        "--cb-failure-threshold", "10", "--cb-success-threshold", "3", "--cb-timeout-duration-secs", "60",
        "--health-failure-threshold", "4", "--health-success-threshold", "2",
        "--health-check-timeout-secs", "5", "--health-check-interval-secs", "7",
        "--shutdown-grace-period-secs", "180", "--header-read-timeout-secs", "30",
        "--idle-connection-timeout-secs", "90", "--max-payload-size", "1048576",
        "--log-level", "warn", "--log-json", "--no-remove-unhealthy-workers",
    )  # fmt: skip
    assert (s.prefill, s.decode, s.bootstrap_ports) == (
        ["grpc://127.0.0.1:1"],
        ["grpc://127.0.0.1:2"],
        ["grpc://127.0.0.1:1=9000"],
    )
    assert (s.host, s.port, s.policy) == ("0.0.0.0", 30000, "prefixgate")
    assert (s.prometheus_host, s.prometheus_port) == ("127.0.0.2", 29000)
    ring = KeyRing(s.api_keys)
    assert ring.authenticate("Bearer sk-one") == "default"  # smg's single key: one tenant, not the key
    assert ring.authenticate("Bearer sk-acme") == "acme"
    assert (s.max_inflight, s.request_timeout_s) == (64, 1800.0)
    assert (s.retry_max_attempts, s.retry_backoff_initial_s, s.retry_backoff_max_s) == (5, 0.05, 30.0)
    assert (s.retry_backoff_multiplier, s.retry_jitter_factor, s.retry_jitter_s) == (1.5, 0.2, 0.0)
    assert (s.breaker_failure_threshold, s.breaker_success_threshold) == (10, 3)
    assert (s.breaker_cooldown_s, s.breaker_max_cooldown_s) == (60.0, 60.0)  # smg's fixed wait
    assert (s.health_failure_threshold, s.health_success_threshold) == (4, 2)
    assert (s.health_check_timeout_s, s.stats_interval_s) == (5.0, 7.0)
    assert (s.shutdown_grace_s, s.header_timeout_s, s.keepalive_timeout_s) == (180.0, 30.0, 90.0)
    assert s.max_body_bytes == 1048576
    assert (s.log_level, s.log_format) == ("warning", "json")


def test_defaults_stay_when_no_smg_flag_is_given() -> None:
    s, d = settings_of("--decode", "127.0.0.1:1"), Settings()
    kept = ("max_inflight", "retry_max_attempts", "retry_jitter_s", "breaker_cooldown_s", "stats_interval_s")
    for name in kept:
        assert getattr(s, name) == getattr(d, name)
    assert (s.prometheus_port, s.policy) == (0, "prefixgate")  # no metrics listener unless asked


@pytest.mark.parametrize(
    ("argv", "name", "value"),
    [
        (["--disable-retries", "--retry-max-retries", "5"], "retry_max_attempts", 1),
        (["--disable-circuit-breaker"], "breaker_failure_threshold", 0),
        (["--max-concurrent-requests", "-1"], "max_inflight", Settings().max_inflight),
        (["--prefill-policy", "power_of_two", "--policy", "round_robin"], "policy", "least_loaded"),
        (["--policy", "round_robin", "--decode-policy", "least_load"], "policy", "round_robin"),
        (["--policy", "prefixgate:affinity=5"], "policy", "prefixgate:affinity=5"),  # ours, as given
        (["--model-path", str(TOKENIZER_DIR)], "tokenizer_path", str(TOKENIZER_DIR)),
        (["--queue-size", "64"], "scheduler_queue_requests", 64),
        (["--queue-timeout-secs", "2.5"], "scheduler_max_wait_s", 2.5),
        (
            ["--service-discovery", "--selector", "app=sglang", "tier=gpu"],
            "discovery_kubernetes",
            ["regular=app=sglang,tier=gpu"],
        ),
        (
            ["--discovery-provider", "kubernetes", "--prefill-selector", "r=p", "--decode-selector", "r=d"],
            "discovery_kubernetes",
            ["prefill=r=p", "decode=r=d"],
        ),
        (["--service-discovery", "--selector", "a=b"], "discovery_kubernetes_scheme", "http"),
        (
            ["--service-discovery", "--selector", "a=b", "--service-discovery-port", "30000"],
            "discovery_kubernetes_port",
            30000,
        ),
        (
            ["--service-discovery", "--selector", "a=b", "--service-discovery-namespace", "llm"],
            "discovery_kubernetes_namespace",
            "llm",
        ),
    ],
)
def test_switches_and_combinations(argv: list[str], name: str, value: object) -> None:
    assert getattr(settings_of("--decode", "127.0.0.1:1", *argv), name) == value


@pytest.mark.parametrize("smg_name", sorted(POLICY_MAP))
def test_every_mapped_policy_runs(smg_name: str) -> None:
    assert settings_of("--decode", "127.0.0.1:1", "--policy", smg_name).policy == POLICY_MAP[smg_name]


def _refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    rc = main(["gateway", "--decode", "127.0.0.1:1", *argv])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_every_refused_flag_says_so_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()  # one parser for them all (building one per flag is most of the time)
    for flag in sorted(REFUSED):
        with pytest.raises(SmgFlagRefused) as e:
            parser.parse_args(["gateway", "--decode", "127.0.0.1:1", flag, "1"])
        line = str(e.value)
        assert line.startswith(f"{flag} is an smg flag prefixgate does not take ("), line
        assert line.endswith(")") and "\n" not in line and len(line) > len(flag) + 60, line  # why / instead
    for flag in ("--mesh-port", "--enable-igw", "--cb-window-duration-secs"):  # the command: rc 2, one line
        assert _refused(capsys, flag, "1").startswith(f"prefixgate gateway: {flag} is an smg flag ")


def test_refused_policies_name_themselves(capsys: pytest.CaptureFixture[str]) -> None:
    for flag in ("--policy", "--prefill-policy"):
        for name in sorted(POLICY_REFUSED):
            line = _refused(capsys, flag, name)
            assert f"{flag} {name}: smg's {name} policy is not in prefixgate" in line and "use " in line


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--pd-disaggregation"], "--pd-disaggregation needs at least one --prefill and one --decode"),
        (["--decode-policy", "cache_aware"], "--decode-policy cache_aware: prefixgate always picks"),
        (["--max-concurrent-requests", "0"], "--max-concurrent-requests 0"),
        (["--idle-connection-timeout-secs", "0"], "--idle-connection-timeout-secs 0"),
        (["--tenant-api-key", "no-colon"], "--tenant-api-key 'no-colon': use TENANT_ID:KEY"),
        (["--retry-max-retries", "0"], "setting 'retry_max_attempts': 0 is below 1"),
        (["--model-path", "Qwen/Qwen3-8B"], "'Qwen/Qwen3-8B' is not a directory"),
        (["--selector", "a=b"], "--selector needs --service-discovery"),
        (["--service-discovery"], "--service-discovery needs --selector"),
        (["--discovery-provider", "file"], "--discovery-provider file: prefixgate's discovery file"),
    ],
)
def test_values_without_the_same_meaning_are_refused(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert says in _refused(capsys, *argv)


def test_breaker_success_threshold_and_no_threshold() -> None:
    b = CircuitBreaker(threshold=1, success_threshold=2, base_cooldown_s=1.0)
    b.on_failure(0.0)
    assert b.state == OPEN and b.allows(1.0) and b.state == HALF_OPEN
    b.on_dispatch()
    b.on_success()
    assert b.state == HALF_OPEN and b.allows(1.0)  # one success of two: still on trial
    b.on_dispatch()
    b.on_success()
    assert b.state == CLOSED
    off = CircuitBreaker(threshold=0)  # --disable-circuit-breaker
    for t in range(50):
        off.on_failure(float(t))
    assert off.state == CLOSED


def test_pd_command_line_from_smg_serves_and_exposes_metrics() -> None:
    """`smg launch` flags with `prefixgate gateway` in front of our nodes over grpc://."""
    boot = free_port()
    pre = spawn(["node", "--role", "prefill", "--time-scale", "0.05", "--block-size", "16",
                 "--bootstrap-port", str(boot)])  # fmt: skip
    dec = spawn(["node", "--role", "decode", "--time-scale", "0.05", "--block-size", "16"])
    gw = None
    try:
        ready = r'"event": "node_ready".*"address": "([^"]+)"'
        p_addr, d_addr = pre.wait_for(ready, timeout=30).group(1), dec.wait_for(ready, timeout=30).group(1)
        port, prom = free_port(), free_port()
        gw = spawn([
            "gateway", "--host", "127.0.0.1", "--port", str(port),
            "--pd-disaggregation", "--prefill", f"grpc://{p_addr}", str(boot), "--decode", f"grpc://{d_addr}",
            "--policy", "cache_aware", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom),
            "--log-level", "warn",
        ])  # fmt: skip
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert gw.proc.poll() is None and time.monotonic() < deadline, "\n".join(list(gw.lines)[-30:])
            time.sleep(0.1)
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30)
        raw = client.chat.completions.with_raw_response.create(
            model="prefixgate-sim",
            messages=[{"role": "user", "content": "Tell me about prefix caches. " * 8}],
            max_tokens=4,
        )
        assert raw.headers["x-prefixgate-route"] == "disaggregated"
        assert raw.parse().choices[0].message.content
        scraped = httpx.get(f"http://127.0.0.1:{prom}/metrics", timeout=5)
        assert scraped.status_code == 200 and "prefixgate_requests_total" in scraped.text
        assert 'route="disaggregated"' in scraped.text  # the same registry as the main port's
        assert httpx.get(f"http://127.0.0.1:{prom}/v1/models", timeout=5).status_code == 404  # /metrics only
        assert httpx.get(f"{base}/metrics", timeout=5).status_code == 200  # still on the main port
        assert gw.stop() == 0
    finally:
        if gw is not None:
            gw.stop()
        pre.stop()
        dec.stop()
