"""The server limits are settings, flags and PREFIXGATE_* variables alike."""

from __future__ import annotations

from prefixgate.cli import _GATEWAY_KEYS, _overrides, build_parser
from prefixgate.gateway.config import load_settings
from prefixgate.gateway.httpfront.connections import fd_bounded_connections


def test_flags_and_environment_set_the_server_limits() -> None:
    args = build_parser().parse_args(
        [
            "gateway",
            "--decode",
            "127.0.0.1:1",
            "--header-timeout",
            "2.5",
            "--body-timeout",
            "7",
            "--keepalive-timeout",
            "3",
            "--max-connections",
            "300",
            "--max-header-bytes",
            "16384",
            "--shutdown-grace",
            "20",
            "--trusted-proxy",
            "10.0.0.0/8",
            "--trusted-proxy",
            "127.0.0.1",
            "--admin-origin",
            "https://ops.example.com",
            "--metrics-token",
            "m",
        ]
    )
    s = load_settings(None, _overrides(args, _GATEWAY_KEYS), environ={})
    assert (s.header_timeout_s, s.body_timeout_s, s.keepalive_timeout_s) == (2.5, 7.0, 3.0)
    assert (s.max_connections, s.max_header_bytes, s.shutdown_grace_s) == (300, 16384, 20.0)
    assert s.trusted_proxies == ["10.0.0.0/8", "127.0.0.1"]
    assert s.admin_origins == ["https://ops.example.com"] and s.metrics_token == "m"
    env = {"PREFIXGATE_SHUTDOWN_GRACE_S": "1.5", "PREFIXGATE_TRUSTED_PROXIES": "10.0.0.1, 10.0.0.2"}
    s = load_settings(None, {}, environ=env)
    assert s.shutdown_grace_s == 1.5 and s.trusted_proxies == ["10.0.0.1", "10.0.0.2"]


def test_the_connection_cap_stays_under_the_open_file_limit() -> None:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY:
        assert fd_bounded_connections(10**9) == soft - 64
    assert fd_bounded_connections(10) == 10
