"""smg-style worker flags: the command line, the TOML file and PREFIXGATE_* give the same pools."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefixgate.cli import build_parser
from prefixgate.gateway.cluster import workers
from prefixgate.gateway.config import load_settings
from prefixgate.gateway.nodeclient import connect
from prefixgate.gateway.nodeclient.prefixgate_grpc import GrpcNodeClient
from prefixgate.gateway.nodeclient.smg_common import SmgNodeClient

SMG_LINE = [
    "gateway",
    "--prefill", "grpc://127.0.0.1:50051", "8998",
    "--prefill", "grpc://127.0.0.1:50052",
    "--decode", "grpc://127.0.0.1:50061",
    "--worker-urls", "grpc://127.0.0.1:50071", "grpc://127.0.0.1:50072",
    "--backend", "sglang",
]  # fmt: skip
EXPECTED = {
    "prefill": ["grpc://127.0.0.1:50051", "grpc://127.0.0.1:50052"],
    "decode": ["grpc://127.0.0.1:50061"],
    "monolithic": ["grpc://127.0.0.1:50071", "grpc://127.0.0.1:50072"],
    "bootstrap_ports": ["grpc://127.0.0.1:50051=8998"],
    "backend": "sglang",
}


def _pools(s: object) -> dict[str, object]:
    return {k: getattr(s, k) for k in EXPECTED}


def test_an_smg_command_line_carries_over() -> None:
    args = build_parser().parse_args(SMG_LINE)
    args.prefill = workers.flag_entries(args.prefill)
    args.worker_urls = workers.flat_urls(args.worker_urls)
    keys = ("prefill", "decode", "worker_urls", "backend")
    s = load_settings(None, {k: getattr(args, k) for k in keys}, environ={})
    assert _pools(s) == EXPECTED


def test_the_same_in_toml_and_environment(tmp_path: Path) -> None:
    toml = tmp_path / "g.toml"
    toml.write_text(
        "[gateway]\n"
        'prefill = ["grpc://127.0.0.1:50051 8998", "grpc://127.0.0.1:50052"]\n'
        'decode = ["grpc://127.0.0.1:50061"]\n'
        'worker-urls = ["grpc://127.0.0.1:50071", "grpc://127.0.0.1:50072"]\n'
        'backend = "sglang"\n'
    )
    assert _pools(load_settings(toml, environ={})) == EXPECTED
    env = {
        "PREFIXGATE_PREFILL": "grpc://127.0.0.1:50051 8998,grpc://127.0.0.1:50052",
        "PREFIXGATE_DECODE": "grpc://127.0.0.1:50061",
        "PREFIXGATE_WORKER_URLS": "grpc://127.0.0.1:50071,grpc://127.0.0.1:50072",
        "PREFIXGATE_BACKEND": "sglang",
    }
    assert _pools(load_settings(None, environ=env)) == EXPECTED


def test_todays_forms_keep_working() -> None:
    args = build_parser().parse_args(["gateway", "--prefill", "127.0.0.1:1", "--monolithic", "127.0.0.1:2"])
    s = load_settings(
        None, {"prefill": workers.flag_entries(args.prefill), "monolithic": args.monolithic}, environ={}
    )
    assert (s.prefill, s.monolithic, s.bootstrap_ports) == (["127.0.0.1:1"], ["127.0.0.1:2"], [])


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        ({"prefill": ["grpc://h:1 x"]}, "not a number"),
        ({"prefill": ["grpc://h:1 70000"]}, "out of range"),
        ({"decode": ["grpc://h:1 8998"]}, "only a prefill worker"),
        ({"backend": "trtllm"}, "backend"),
    ],
)
def test_bad_worker_settings_are_refused(overrides: dict[str, object], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        load_settings(None, overrides, environ={})


async def test_the_scheme_picks_the_adapter() -> None:
    ours, smg = connect("127.0.0.1:1"), connect("grpc://127.0.0.1:1")
    try:
        assert isinstance(ours, GrpcNodeClient) and isinstance(smg, SmgNodeClient)
        assert smg.address == "grpc://127.0.0.1:1" and smg.host == "127.0.0.1"
        with pytest.raises(ValueError, match="unknown node protocol"):
            connect("ftp://127.0.0.1:1")
    finally:
        await ours.close()
        await smg.close()


def test_engine_status_codes_become_failure_kinds() -> None:
    import grpc

    from prefixgate.gateway.nodeclient.smg_common import failure
    from prefixgate.gateway.vocab import FailureKind, Stage

    def err(code: grpc.StatusCode, *trailer: tuple[str, str]) -> grpc.aio.AioRpcError:
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailer), "x")

    kinds = {
        grpc.StatusCode.INVALID_ARGUMENT: FailureKind.INVALID,  # 400, not retried
        grpc.StatusCode.RESOURCE_EXHAUSTED: FailureKind.OVERLOADED,  # 429 when every node says so
        grpc.StatusCode.UNAVAILABLE: FailureKind.UNAVAILABLE,  # another worker is tried
        grpc.StatusCode.DEADLINE_EXCEEDED: FailureKind.TIMEOUT,
        grpc.StatusCode.FAILED_PRECONDITION: FailureKind.INTERNAL,  # the node's state: retried elsewhere
        grpc.StatusCode.INTERNAL: FailureKind.INTERNAL,
    }
    for code, kind in kinds.items():
        assert failure("w", Stage.GENERATE, err(code)).kind == kind, code
    grammar = err(grpc.StatusCode.FAILED_PRECONDITION, ("smg-constraint-failed", "engine"))
    assert failure("w", Stage.GENERATE, grammar).kind == FailureKind.CONSTRAINT  # the request's fault: 422
