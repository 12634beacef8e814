"""The on-disk compile cache: named artifacts ("ptx", "cubin", "meta.json", ...) per key.

An entry is one file, `<dir>/<key[:2]>/<key>.entry`, written atomically (temp file in the same
directory, fsync, os.replace) and carrying a sha256 of its contents, so a reader sees a whole
entry or none, and a truncated or corrupted one is dropped as a miss instead of trusted.
Anything else in an entry's place is a miss, and the next store replaces it (a folder too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import importlib
import json
import os
import re
import shutil
import stat
import struct
import tempfile
import warnings
from pathlib import Path

from mhadsl.front.sources import read_regular_file

_FORMAT = 1  # part of every key: bump when the compiler's output for the same inputs changes shape
_MAGIC = b"MHADSLC1"  # file format tag; the digest of the rest follows it
_DIGEST = hashlib.sha256().digest_size
_KEY = re.compile(r"[0-9a-f]{64}")
MAX_ENTRY_BYTES = 256 << 20  # an entry holds one kernel's LLVM IR, PTX and cubin: megabytes
_warned: set[Path] = set()


def cache_dir() -> Path:
    """$MHADSL_CACHE_DIR, else $XDG_CACHE_HOME/mhadsl, else ~/.cache/mhadsl."""
    if override := os.environ.get("MHADSL_CACHE_DIR"):
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):  # the XDG spec says to ignore relative paths
        return Path(xdg) / "mhadsl"
    return Path.home() / ".cache" / "mhadsl"


def _canonical(value: object) -> object:
    """JSON for the values json cannot encode itself; anything else is an error, because
    falling back to repr() could put memory addresses into a key."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return {"dataclass": type(value).__qualname__, "fields": fields}
    if isinstance(value, enum.Enum):
        return {"enum": type(value).__qualname__, "name": value.name}
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"sha256": hashlib.sha256(value).hexdigest()}
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cache_key cannot encode a {type(value).__qualname__}")


def cache_key(**parts: object) -> str:
    """sha256 (hex) of a canonical JSON of everything that changes the compiler's output: the
    source text, the options, the arch, the PTX and LLVM versions, the compiler's sources."""
    text = json.dumps([_FORMAT, parts], sort_keys=True, separators=(",", ":"), default=_canonical)
    return hashlib.sha256(text.encode()).hexdigest()


COMPILER_PACKAGES = ("mhadsl", "mhadsl.codegen", "mhadsl.runtime", "mhadsl.grammar")
_COMPILER_FILES = ("*.py", "*.lark", "*.mha")


@functools.cache
def compiler_hash() -> str:
    """sha256 of every .py, .lark and .mha file of the installed compiler (its packages'
    folders), so editing the compiler can never load a build of the old one. Computed
    once per process."""
    digest = hashlib.sha256()
    for package in COMPILER_PACKAGES:
        root = Path(importlib.import_module(package).__file__).parent
        files = sorted(f for pattern in _COMPILER_FILES for f in root.rglob(pattern))
        for file in files:
            digest.update(f"{package}/{file.relative_to(root).as_posix()}\0".encode())
            digest.update(hashlib.sha256(file.read_bytes()).digest())
    return digest.hexdigest()


def _encode(artifacts: dict[str, bytes]) -> bytes:
    blobs = {name: bytes(data) for name, data in artifacts.items()}
    header = json.dumps([[name, len(data)] for name, data in blobs.items()]).encode()
    body = struct.pack("<I", len(header)) + header + b"".join(blobs.values())
    return _MAGIC + hashlib.sha256(body).digest() + body


def _decode(data: bytes) -> dict[str, bytes] | None:
    """The artifacts, or None when the entry is not one this code wrote whole. A matching
    digest proves nothing about a file someone else wrote, so the header is checked too."""
    start = len(_MAGIC) + _DIGEST
    if not data.startswith(_MAGIC) or len(data) < start + 4:
        return None
    body = data[start:]
    if hashlib.sha256(body).digest() != data[len(_MAGIC) : start]:
        return None
    (header_size,) = struct.unpack_from("<I", body)
    offset = 4 + header_size
    try:
        header = json.loads(body[4:offset])
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        return None
    if not (isinstance(header, list) and all(
            isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)
            and type(item[1]) is int and item[1] >= 0 for item in header)):
        return None
    if offset + sum(size for _, size in header) != len(body):
        return None
    artifacts = {}
    for name, size in header:
        artifacts[name] = body[offset : offset + size]
        offset += size
    return artifacts


def _write_atomically(path: Path, data: bytes) -> None:
    descriptor, temp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".entry")
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


class CompileCache:
    """Named compile artifacts by key. Never raises for file-system trouble: a cache that cannot
    be written warns once and stops caching; one that cannot be read just misses."""

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        self.directory = Path(directory) if directory is not None else cache_dir()
        self._writable = True

    def _path(self, key: str) -> Path:
        if not _KEY.fullmatch(key):  # keys become file names: accept only what cache_key makes
            raise ValueError(f"cache key must be a sha256 hex digest from cache_key(), got {key!r}")
        return self.directory / key[:2] / f"{key}.entry"

    def get(self, key: str) -> dict[str, bytes] | None:
        path = self._path(key)
        try:  # a FIFO or a link to /dev/zero in its place is a miss, not a hang
            data = read_regular_file(path, MAX_ENTRY_BYTES)
        except OSError:
            return None
        artifacts = _decode(data)
        if artifacts is None:
            with contextlib.suppress(OSError):
                path.unlink()
        return artifacts

    def _remove_folder_at(self, path: Path) -> None:
        """Remove a folder in an entry's place (a rename cannot replace one, so it would
        keep every later build from storing), where it is the entry's own path inside the
        cache folder, never what a link leads to. It is moved aside first: a reader or
        another writer sees the folder or nothing there, never half of it."""
        try:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                return  # nothing, or something a rename replaces
        except FileNotFoundError:
            return
        if not path.parent.resolve().is_relative_to(self.directory.resolve()):
            return
        aside = tempfile.mkdtemp(dir=path.parent, prefix=".stale-")
        with contextlib.suppress(FileNotFoundError):  # another writer moved it first
            os.rename(path, os.path.join(aside, "entry"))
        shutil.rmtree(aside, ignore_errors=True)

    def put(self, key: str, artifacts: dict[str, bytes]) -> None:
        path = self._path(key)
        if not self._writable:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._remove_folder_at(path)
            _write_atomically(path, _encode(artifacts))
        except OSError as exc:
            self._writable = False
            if self.directory not in _warned:
                _warned.add(self.directory)
                warnings.warn(
                    f"mhadsl: compile cache at {self.directory} is not writable ({exc}); "
                    "compiling without a cache (set MHADSL_CACHE_DIR to move it)",
                    RuntimeWarning,
                    stacklevel=2,
                )
