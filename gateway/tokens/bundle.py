"""The ``GetTokenizer`` bundle of the SMG protocol: fetch, verify, unpack, keep on disk.

The engine streams a zip of its tokenizer files in chunks; the last chunk carries the sha256 of
the whole zip. The checks are SMG's: at least one chunk, a sha256 on the last one, at most
200 MiB, the digest matching (case-insensitive); at most 50 entries and 500 MiB unpacked, flat
names only (no ``/``, ``\\``, ``..``, absolute paths); the whole RPC under one timeout. To those the
gateway adds: no more than ``STALL_TIMEOUT_S`` between two chunks; the entry count (and the size
of the zip's central directory, which is what a zip reader turns into one object per entry) read
from the zip's end record and refused before any entry is looked at; a ``tokenizer.json`` among
the files. Files are written by us from the entries' bytes (never ``extractall``), so no link or
special file can be made, and unpacking counts the bytes it really inflates rather than trusting
the headers.

Unpacked bundles live in ``<cache>/<sha256>/`` (written to a temporary directory, then renamed
into place), with ``<cache>/workers/<key>`` naming the sha256 last fetched from a worker whose
model info gave that key: a restarted gateway loads from disk and does not fetch again. What is
refused is not kept: a temporary directory goes with the failure that ended it (or, left by a
process that died, with the next store after ``STALE_UNPACK_S``), and a bundle whose tokenizer
cannot be loaded is removed (``discard``).
"""

from __future__ import annotations

import hashlib
import io
import os
import struct
import tempfile
import time
import zipfile
import zlib
from collections.abc import AsyncIterable, Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc

MAX_BUNDLE_BYTES = 200 << 20
MAX_ENTRIES = 50
# A directory entry is 46 bytes plus its name, extra fields and comment: 1 KiB an entry is more
# than a tokenizer file needs, and bounds what reading the directory makes however it counts.
MAX_DIRECTORY_BYTES = MAX_ENTRIES * 1024
MAX_UNPACKED_BYTES = 500 << 20
DEFAULT_TIMEOUT_S = 60.0
STALL_TIMEOUT_S = 10.0  # between two chunks (the first included): a worker sending nothing is stuck
STALE_UNPACK_S = 3600.0  # a temporary directory this old belongs to no running store
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


def _check_directory(buf: io.BytesIO) -> None:
    """Refuse a zip with too many entries from its end record alone: reading the central
    directory (``zipfile.ZipFile``) makes an object per entry, 700 bytes each, before anything
    can be counted. The record is found by the zip reader's own function, so the one checked
    is the one it reads (a lying entry count is caught by the directory's size)."""
    end = zipfile._EndRecData(buf)  # type: ignore[attr-defined]  # what ZipFile itself reads first
    if not end:
        raise BundleError("tokenizer bundle is not a zip: no end of central directory record")
    entries, size = end[4], end[5]  # _ECD_ENTRIES_TOTAL, _ECD_SIZE (zip64 values when it is one)
    if entries > MAX_ENTRIES:
        raise BundleError(f"tokenizer bundle has {entries} entries (at most {MAX_ENTRIES})")
    if size > MAX_DIRECTORY_BYTES:
        raise BundleError(
            f"tokenizer bundle has a {size}-byte directory: more than {MAX_ENTRIES} entries need "
            f"(at most {MAX_DIRECTORY_BYTES})"
        )


def unpack(data: bytes, dest: Path) -> list[str]:
    """Write the bundle's files into ``dest`` (which must exist); returns their names."""
    buf = io.BytesIO(data)
    try:
        _check_directory(buf)
        zf = zipfile.ZipFile(buf)
    except (zipfile.BadZipFile, OSError, ValueError, struct.error) as e:
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
    if "tokenizer.json" not in names:
        raise BundleError("tokenizer bundle holds no tokenizer.json")
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
        self._sweep()
        tmp = Path(tempfile.mkdtemp(prefix=".unpack-", dir=self.root))
        try:
            unpack(data, tmp)
            target = self.path(sha256)
            if target.is_dir() and self.lookup(sha256) is None:
                _remove_tree(target)  # a directory holding no tokenizer: nothing worth keeping
            try:
                os.replace(tmp, target)
            except OSError:
                if self.lookup(sha256) is None:  # not a concurrent writer that got there first
                    raise
        finally:
            if tmp.exists():
                _remove_tree(tmp)
        return self.path(sha256)

    def discard(self, sha256: str) -> None:
        """Remove a stored bundle (one whose tokenizer cannot be loaded): nothing refused is kept."""
        p = self.path(sha256)
        if _is_sha(sha256.lower()) and p.is_dir():
            _remove_tree(p)

    def _sweep(self) -> None:
        """Remove the temporary directories of stores that died (older than ``STALE_UNPACK_S``)."""
        cutoff = time.time() - STALE_UNPACK_S
        for p in self.root.glob(".unpack-*"):
            try:
                if p.is_dir() and not p.is_symlink() and p.stat().st_mtime < cutoff:
                    _remove_tree(p)
            except OSError:
                continue  # another store removing it too

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
