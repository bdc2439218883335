"""The engine tokenizer from a worker: ``GetModelInfo.tokenizer_path``, the disk cache, or the
``GetTokenizer`` bundle, from our node's real gRPC server and from small real servers on loopback
that serve good and bad bundles."""

from __future__ import annotations

import asyncio
import hashlib
import io
import struct
import time
import tracemalloc
import zipfile
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import (
    common_pb2,
    sglang_scheduler_pb2,
    sglang_scheduler_pb2_grpc,
    vllm_engine_pb2,
    vllm_engine_pb2_grpc,
)

from prefixgate.backends.hftok import TOKENIZER_DIR, bundle
from prefixgate.backends.server import NodeServer, start_node
from prefixgate.gateway.tokens import (
    BundleError,
    TokenizerLoadError,
    load_engine_tokenizer,
    open_tokenizer_dir,
)
from prefixgate.gateway.tokens.bundle import BundleCache, unpack

SHIPPED_NAME = open_tokenizer_dir(TOKENIZER_DIR).name
GOOD, GOOD_SHA = bundle(TOKENIZER_DIR)


@pytest.fixture
async def node() -> AsyncIterator[NodeServer]:
    ns = await start_node("monolithic", "127.0.0.1", 0, time_scale=0.0)
    try:
        yield ns
    finally:
        await ns.stop(grace=0.2)


async def test_our_node_gives_its_bundle_once_and_a_restart_reads_the_disk(
    node: NodeServer, tmp_path: Path
) -> None:
    worker = f"grpc://{node.address}"
    tok = await load_engine_tokenizer(workers=[worker], cache_dir=tmp_path, local_paths=False)
    assert tok.name == SHIPPED_NAME and "bundle" in tok.origin and "cached" not in tok.origin
    assert (tmp_path / GOOD_SHA / "tokenizer.json").read_bytes() == (
        TOKENIZER_DIR / "tokenizer.json"
    ).read_bytes()
    assert tok.directory == tmp_path / GOOD_SHA
    again = await load_engine_tokenizer(workers=[worker], cache_dir=tmp_path, local_paths=False)
    assert again.name == tok.name and again.origin.endswith("(cached)")
    # the node's own tokenizer_path exists on this host: SMG's first choice, no bundle needed
    local = await load_engine_tokenizer(workers=[node.address], cache_dir=tmp_path / "other")
    assert local.name == tok.name and "tokenizer_path" in local.origin
    assert not (tmp_path / "other").exists()


# -- a small engine that serves whatever bundle a test gives it ------------------------------


@dataclass
class Bundles:
    chunks: list[tuple[bytes, str]]
    calls: int = 0
    info_calls: int = 0
    fail: grpc.StatusCode | None = None
    seen: list[str] = field(default_factory=list)
    stall_after: int = -1  # chunks sent before the stream goes silent (-1: never)


def _info(cls: Any) -> Any:
    return cls(
        model_path="/models/remote", tokenizer_path="/not/on/this/host", served_model_name="m", vocab_size=7
    )


class SglangBundles(sglang_scheduler_pb2_grpc.SglangSchedulerServicer):  # type: ignore[misc]
    def __init__(self, state: Bundles) -> None:
        self.state = state

    async def GetModelInfo(self, request: Any, context: Any) -> Any:
        self.state.info_calls += 1
        return _info(sglang_scheduler_pb2.GetModelInfoResponse)

    async def GetTokenizer(self, request: Any, context: Any) -> AsyncIterator[Any]:
        self.state.calls += 1
        if self.state.fail is not None:
            await context.abort(self.state.fail, "no tokenizer here")
        for i, (data, sha) in enumerate(self.state.chunks):
            if i == self.state.stall_after:
                await asyncio.sleep(30)
            yield common_pb2.GetTokenizerChunk(data=data, sha256=sha)


class VllmBundles(vllm_engine_pb2_grpc.VllmEngineServicer):  # type: ignore[misc]
    def __init__(self, state: Bundles) -> None:
        self.state = state

    async def GetModelInfo(self, request: Any, context: Any) -> Any:
        self.state.info_calls += 1
        return _info(vllm_engine_pb2.GetModelInfoResponse)

    async def GetTokenizer(self, request: Any, context: Any) -> AsyncIterator[Any]:
        self.state.calls += 1
        for data, sha in self.state.chunks:
            yield common_pb2.GetTokenizerChunk(data=data, sha256=sha)


Serve = Callable[..., Awaitable[tuple[str, Bundles]]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    servers: list[grpc.aio.Server] = []

    async def make(
        chunks: list[tuple[bytes, str]], *, vllm: bool = False, **state: Any
    ) -> tuple[str, Bundles]:
        s = Bundles(chunks, **state)
        server = grpc.aio.server()
        if vllm:
            vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(VllmBundles(s), server)
        else:
            sglang_scheduler_pb2_grpc.add_SglangSchedulerServicer_to_server(SglangBundles(s), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        return f"grpc://127.0.0.1:{port}", s

    yield make
    for server in servers:
        await server.stop(0.2)


def split(data: bytes, size: int, sha: str) -> list[tuple[bytes, str]]:
    parts = [data[i : i + size] for i in range(0, len(data), size)]
    return [(p, sha if i == len(parts) - 1 else "") for i, p in enumerate(parts)]


def make_zip(entries: list[tuple[str, bytes]]) -> tuple[bytes, str]:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in entries:
            zf.writestr(name, data)
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()


async def test_chunks_are_joined_and_verified_and_kept_by_sha256(serve: Serve, tmp_path: Path) -> None:
    addr, state = await serve(split(GOOD, 1000, GOOD_SHA.upper()))  # the digest is case-insensitive
    tok = await load_engine_tokenizer(workers=[addr], cache_dir=tmp_path)
    assert tok.name == SHIPPED_NAME and state.calls == 1
    for _ in range(2):  # restarts: model info again, never the bundle
        again = await load_engine_tokenizer(workers=[addr], cache_dir=tmp_path)
        assert again.name == SHIPPED_NAME
    assert state.calls == 1 and state.info_calls == 3


async def test_a_vllm_worker_is_asked_on_its_own_service(serve: Serve, tmp_path: Path) -> None:
    addr, state = await serve(split(GOOD, 64 << 10, GOOD_SHA), vllm=True)
    tok = await load_engine_tokenizer(workers=[addr], cache_dir=tmp_path)
    assert tok.name == SHIPPED_NAME and state.calls == 1


EVIL_ZIP, EVIL_SHA = make_zip([("tokenizer.json", b"{}"), ("../escape.json", b"x")])
MANY_ZIP, MANY_SHA = make_zip([(f"f{i}.json", b"{}") for i in range(51)])
NOT_ZIP = b"not a zip at all"
NO_TOKENIZER_ZIP, NO_TOKENIZER_SHA = make_zip([("tokenizer_config.json", b"{}")])
# A tokenizer.json no tokenizer loads from, with a large file beside it (kept on disk until now).
JUNK_ZIP, JUNK_SHA = make_zip([("tokenizer.json", b"{}"), ("vocab.json", b"0" * (4 << 20))])

BAD: dict[str, tuple[list[tuple[bytes, str]], str]] = {
    "no chunk": ([], "no chunk"),
    "no sha256": ([(GOOD, "")], "carries no sha256"),
    "wrong sha256": ([(GOOD, "0" * 64)], "sha256 mismatch"),
    "altered data": ([(GOOD[:100] + bytes([GOOD[100] ^ 1]) + GOOD[101:], GOOD_SHA)], "sha256 mismatch"),
    "path traversal": ([(EVIL_ZIP, EVIL_SHA)], "not a plain file name"),
    "too many entries": ([(MANY_ZIP, MANY_SHA)], "entries"),
    "not a zip": ([(NOT_ZIP, hashlib.sha256(NOT_ZIP).hexdigest())], "not a zip"),
    "no tokenizer.json": ([(NO_TOKENIZER_ZIP, NO_TOKENIZER_SHA)], "no tokenizer.json"),
    "a tokenizer.json no tokenizer loads": ([(JUNK_ZIP, JUNK_SHA)], "tokenizer.json"),
}


@pytest.mark.parametrize("case", list(BAD))
async def test_a_bad_bundle_is_refused_and_nothing_is_kept(serve: Serve, tmp_path: Path, case: str) -> None:
    chunks, message = BAD[case]
    addr, _ = await serve(chunks)
    cache = tmp_path / "cache"
    with pytest.raises(TokenizerLoadError, match=message):
        await load_engine_tokenizer(workers=[addr], cache_dir=cache)
    kept = [p for p in cache.rglob("*")] if cache.exists() else []
    assert kept == [] and not (tmp_path / "escape.json").exists()


async def test_the_first_worker_that_gives_a_tokenizer_wins(serve: Serve, tmp_path: Path) -> None:
    broken, b = await serve([], fail=grpc.StatusCode.FAILED_PRECONDITION)
    good, g = await serve(split(GOOD, 4096, GOOD_SHA))
    tok = await load_engine_tokenizer(workers=[broken, good], cache_dir=tmp_path)
    assert tok.name == SHIPPED_NAME and b.calls == 1 and g.calls == 1
    with pytest.raises(TokenizerLoadError, match="FAILED_PRECONDITION"):
        await load_engine_tokenizer(workers=[broken], cache_dir=tmp_path / "x")


async def test_an_unreachable_worker_is_an_error_within_the_timeout(tmp_path: Path) -> None:
    with pytest.raises(TokenizerLoadError, match="GetModelInfo"):
        await load_engine_tokenizer(workers=["grpc://127.0.0.1:1"], cache_dir=tmp_path, timeout_s=2.0)


@pytest.mark.parametrize("name", ["/etc/passwd", "a/b.json", "..", "..json", "x\\y", ".hidden"])
def test_unpack_takes_flat_plain_names_only(tmp_path: Path, name: str) -> None:
    data, _ = make_zip([(name, b"x")])
    with pytest.raises(BundleError):
        unpack(data, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_the_cache_refuses_a_name_that_is_not_a_sha256(tmp_path: Path) -> None:
    with pytest.raises(BundleError):
        BundleCache(tmp_path).store(GOOD, "../" + GOOD_SHA[3:])
    assert BundleCache(tmp_path).lookup("../x") is None


def test_a_corrupt_entry_is_a_bundle_error(tmp_path: Path) -> None:
    noise = b"".join(hashlib.sha256(bytes([i])).digest() for i in range(64))  # does not compress
    data, _ = make_zip([("tokenizer.json", noise)])
    body = data.index(b"tokenizer.json") + len("tokenizer.json")  # the local header's name ends here
    broken = data[:body] + bytes(b ^ 0x5A for b in data[body : body + 16]) + data[body + 16 :]
    with pytest.raises(BundleError, match="cannot be read"):
        unpack(broken, tmp_path)


def many_entries(n: int, *, declared: int | None = None) -> bytes:
    """A zip of ``n`` directory entries (one empty stored file, named ``n`` times), built by
    hand in no time; its end record declares ``declared`` entries (default ``n``, in a zip64
    record when it takes one)."""
    local = struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, 0, 0, 0x21, 0, 0, 0, 1, 0) + b"a"
    entry = struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, 0, 0, 0x21, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0)
    directory = (entry + b"a") * n
    count = n if declared is None else declared
    at, size = len(local), len(directory)
    tail = b""
    if count > 0xFFFF:
        z64 = struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, size, at)
        tail = z64 + struct.pack("<4sLQL", b"PK\x06\x07", 0, at + size, 1)
        count = 0xFFFF
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, count, count, size, at, 0)
    return local + directory + tail + end


@pytest.mark.parametrize("declared", [None, 1], ids=["declared", "a lying count"])
def test_a_zip_of_many_entries_is_refused_before_its_directory_is_read(
    tmp_path: Path, declared: int | None
) -> None:
    data = many_entries(100_000, declared=declared)
    assert len(zipfile.ZipFile(io.BytesIO(many_entries(60))).infolist()) == 60  # a real zip
    tracemalloc.start()
    try:
        with pytest.raises(BundleError, match=r"entries|directory"):
            unpack(data, tmp_path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak  # reading its 100,000 entries would take some 70 MB
    assert list(tmp_path.iterdir()) == []


async def test_a_stalled_bundle_stream_fails_in_one_line_at_the_stall_deadline(
    serve: Serve, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefixgate.gateway.tokens import bundle as bundle_module
    from prefixgate.gateway.tokens.loader import wait_engine_tokenizer

    # 0.3 s instead of the shipped 10 s stall deadline: the same code path, without a 10 s test
    monkeypatch.setattr(bundle_module, "STALL_TIMEOUT_S", 0.3)
    addr, _ = await serve(split(GOOD, 4096, GOOD_SHA), stall_after=1)
    t0 = time.monotonic()
    with pytest.raises(TokenizerLoadError) as info:  # a worker that answers is not waited for
        await wait_engine_tokenizer([addr], wait_s=30, cache_dir=tmp_path, timeout_s=20)
    took = time.monotonic() - t0
    message = str(info.value)
    assert "stalled: no chunk for 0.3 s after 1 chunks (4096 bytes)" in message and addr in message
    assert "\n" not in message and took < 2.0, took
    assert not await asyncio.to_thread(lambda: any(tmp_path.rglob("*")))
