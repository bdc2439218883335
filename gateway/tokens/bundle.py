"""The ``GetTokenizer`` bundle of the SMG protocol: fetch, verify, unpack, keep on disk.

The engine streams a zip of its tokenizer files in chunks; the last chunk carries the sha256 of
the whole zip. The checks are SMG's: at least one chunk, a sha256 on the last one, at most
200 MiB, the digest matching (case-insensitive); at most 50 entries and 500 MiB unpacked, flat
names only (no ``/``, ``\\``, ``..``, absolute paths); the whole RPC under one timeout. Files are
written by us from the entries' bytes (never ``extractall``), so no link or special file can be
made, and unpacking counts the bytes it really inflates rather than trusting the headers.

Unpacked bundles live in ``<cache>/<sha256>/`` (written to a temporary directory, then renamed
into place), with ``<cache>/workers/<key>`` naming the sha256 last fetched from a worker whose
model info gave that key: a restarted gateway loads from disk and does not fetch again.
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
import zipfile
import zlib
from collections.abc import AsyncIterable, Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc

MAX_BUNDLE_BYTES = 200 << 20
MAX_ENTRIES = 50
MAX_UNPACKED_BYTES = 500 << 20
DEFAULT_TIMEOUT_S = 60.0
_READ = 1 << 20
_SHA_HEX = frozenset("0123456789abcdef")


class BundleError(RuntimeError):
    """A bundle that failed a check, or a worker that could not give one."""


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/prefixgate/tokenizers`` (``~/.cache`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "prefixgate" / "tokenizers"


def _is_sha(value: str) -> bool:
    return len(value) == 64 and set(value) <= _SHA_HEX


async def collect_chunks(chunks: AsyncIterable[tuple[bytes, str]]) -> tuple[bytes, str]:
    """Concatenate ``(data, sha256)`` chunks, checking sizes and the final digest."""
    buf = bytearray()
    n = 0
    last_sha = ""
    async for data, sha in chunks:
        n += 1
        if len(buf) + len(data) > MAX_BUNDLE_BYTES:
            raise BundleError(f"tokenizer bundle exceeds {MAX_BUNDLE_BYTES} bytes")
        buf += data
        last_sha = sha
    if n == 0:
        raise BundleError("tokenizer bundle stream had no chunk")
    digest = last_sha.strip().lower()
    if not digest:
        raise BundleError("the last tokenizer bundle chunk carries no sha256")
    actual = hashlib.sha256(buf).hexdigest()
    if digest != actual:
        raise BundleError(f"tokenizer bundle sha256 mismatch: announced {digest[:16]}…, got {actual[:16]}…")
    return bytes(buf), actual


def _safe_name(name: str) -> bool:
    return (
        bool(name)
        and "/" not in name
        and "\\" not in name
        and ".." not in name
        and not name.startswith(".")
        and "\0" not in name
        and ":" not in name
    )


def unpack(data: bytes, dest: Path) -> list[str]:
    """Write the bundle's files into ``dest`` (which must exist); returns their names."""
    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile as e:
        raise BundleError(f"tokenizer bundle is not a zip: {e}") from None
    with zf:
        infos = zf.infolist()
        if len(infos) > MAX_ENTRIES:
            raise BundleError(f"tokenizer bundle has {len(infos)} entries (at most {MAX_ENTRIES})")
        if sum(i.file_size for i in infos) > MAX_UNPACKED_BYTES:
            raise BundleError(f"tokenizer bundle unpacks to more than {MAX_UNPACKED_BYTES} bytes")
        names: list[str] = []
        total = 0
        for info in infos:
            if info.is_dir():
                continue
            if not _safe_name(info.filename):
                raise BundleError(f"tokenizer bundle entry {info.filename[:80]!r} is not a plain file name")
            if info.filename in names:
                raise BundleError(f"tokenizer bundle names {info.filename!r} twice")
            try:
                with zf.open(info) as src, open(dest / info.filename, "xb") as out:
                    while chunk := src.read(_READ):
                        total += len(chunk)
                        if total > MAX_UNPACKED_BYTES:
                            raise BundleError(
                                f"tokenizer bundle unpacks to more than {MAX_UNPACKED_BYTES} bytes"
                            )
                        out.write(chunk)
            except (zipfile.BadZipFile, zlib.error, EOFError, RuntimeError, NotImplementedError) as e:
                if isinstance(e, BundleError):
                    raise
                raise BundleError(f"tokenizer bundle entry {info.filename!r} cannot be read: {e}") from None
            names.append(info.filename)
    if not names:
        raise BundleError("tokenizer bundle holds no file")
    return names


@dataclass(frozen=True, slots=True)
class BundleCache:
    """Unpacked bundles by sha256 under ``root`` (see the module docstring)."""

    root: Path

    def path(self, sha256: str) -> Path:
        return self.root / sha256.lower()

    def lookup(self, sha256: str) -> Path | None:
        if not _is_sha(sha256.lower()):
            return None
        p = self.path(sha256)
        return p if (p / "tokenizer.json").is_file() else None

    def store(self, data: bytes, sha256: str) -> Path:
        """Unpack ``data`` (already verified against ``sha256``) unless it is there already."""
        sha256 = sha256.lower()
        if not _is_sha(sha256):
            raise BundleError(f"not a sha256: {sha256[:80]!r}")
        found = self.lookup(sha256)
        if found is not None:
            return found
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".unpack-", dir=self.root))
        try:
            unpack(data, tmp)
            try:
                os.replace(tmp, self.path(sha256))
            except OSError:
                if self.lookup(sha256) is None:  # not a concurrent writer that got there first
                    raise
        finally:
            if tmp.exists():
                _remove_tree(tmp)
        return self.path(sha256)

    def remembered(self, key: str) -> Path | None:
        """The bundle last stored for the worker ``key``, if still on disk."""
        f = self.root / "workers" / key
        try:
            sha = f.read_text(encoding="ascii").strip()
        except (OSError, UnicodeDecodeError):
            return None
        return self.lookup(sha)

    def remember(self, key: str, sha256: str) -> None:
        d = self.root / "workers"
        d.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".w-", dir=d)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(sha256.lower() + "\n")
        os.replace(tmp, d / key)


def _remove_tree(path: Path) -> None:
    for p in sorted(path.rglob("*"), key=lambda q: len(q.parts), reverse=True):
        if p.is_dir() and not p.is_symlink():
            p.rmdir()
        else:
            p.unlink()
    path.rmdir()


def worker_key(address: str, facts: Iterable[str]) -> str:
    """A file name for a worker and what its model info says about its tokenizer."""
    h = hashlib.sha256("\0".join([address, *facts]).encode("utf-8"))
    return h.hexdigest()[:32]


def grpc_target(address: str) -> str:
    """``grpc://HOST:PORT [BOOTSTRAP]`` or ``HOST:PORT`` -> ``HOST:PORT``."""
    a = address.strip().split()[0] if address.strip() else ""
    for scheme in ("grpc://", "grpcs://"):
        if a.startswith(scheme):
            a = a[len(scheme) :]
    return a.rstrip("/")


CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", 256 << 20),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
)


def channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(grpc_target(address), options=CHANNEL_OPTIONS)
