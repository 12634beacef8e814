"""Reading `.mha` files that may be hostile: the one way the CLI, the API and imports read
a source file (and check an include folder), and the way the compile cache reads its entries.

Only regular files are read, and only up to a size limit: a path that names a FIFO or a
device such as /dev/zero is refused after `stat`, before it is opened, and again after
`fstat` of what was opened (with O_NONBLOCK, so a FIFO put there meanwhile does not wait for
a writer); at most limit + 1 bytes are read, so memory stays bounded whatever the file is.
"""
from __future__ import annotations

import codecs
import errno
import os
import stat

from mhadsl.front.diagnostics import MhaError, Source, Span

MAX_SOURCE_BYTES = 16 << 20  # far past any hand-written or generated .mha file
SOURCE_SUFFIX = ".mha"


def read_regular_file(path: str | os.PathLike, limit: int, *, follow_links: bool = True
                      ) -> bytes:
    """The bytes of a regular file of at most `limit` bytes; anything else is an `OSError`
    whose `strerror` says why. Without `follow_links`, a link at `path` is refused."""
    # opening some devices does something
    _require_regular(os.stat(path, follow_symlinks=follow_links).st_mode, path)
    no_follow = 0 if follow_links else os.O_NOFOLLOW
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | no_follow)
    try:
        _require_regular(os.fstat(descriptor).st_mode, path)  # it may have been replaced
        with open(descriptor, "rb", closefd=False) as file:
            data = file.read(limit + 1)  # one byte past the limit tells a file over it
    finally:
        os.close(descriptor)
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"larger than {limit >> 20} MB", str(path))
    return data


def _require_regular(mode: int, path: str | os.PathLike) -> None:
    if stat.S_ISLNK(mode):  # where a resolved path was expected: a loop of links
        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(path))
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    if not stat.S_ISREG(mode):
        raise OSError(errno.EINVAL, "not a regular file (a device, FIFO or socket)", str(path))


def read_source_file(path: str | os.PathLike, name: str | None = None) -> Source:
    """A `.mha` file's text as a `Source` reported as `name` (default: the path).

    Raises `OSError` (its `strerror` says why) for anything but a regular file named
    `*.mha` of at most `MAX_SOURCE_BYTES`, and `MhaError` for bytes that are not UTF-8.
    Only `.mha` files are accepted, so no diagnostic ever quotes another kind of file. A
    link is judged by the file it leads to (`p.mha` linked to a key file is refused), and
    that file's own path is what is opened, refusing a link put in its place meanwhile.
    """
    real = os.path.realpath(path)
    data = read_regular_file(real, MAX_SOURCE_BYTES, follow_links=False)
    if not real.endswith(SOURCE_SUFFIX):
        resolved = "" if real == os.path.abspath(path) else f" (it resolves to {real})"
        raise OSError(errno.EINVAL, f"not a {SOURCE_SUFFIX} file{resolved}", str(path))
    return decode_source(name or str(path), data)


def check_include_dir(path: str | os.PathLike) -> None:
    """An include folder (`-I DIR`, `include_dirs=`) must be an existing folder: else a
    `FileNotFoundError` or `NotADirectoryError` whose `strerror` says which."""
    if os.path.isdir(path):
        return
    if os.path.exists(path):
        raise NotADirectoryError(errno.ENOTDIR, "not a folder", str(path))
    raise FileNotFoundError(errno.ENOENT, "no such folder", str(path))


def decode_source(name: str, data: bytes) -> Source:
    """A file's bytes as a `Source`: UTF-8, with a leading byte-order mark dropped.

    Bytes that are not UTF-8 are an `MhaError` pointing at the first of them; the line is
    not shown, since a file that is not text may be anything (a binary, a key).
    """
    data = data.removeprefix(codecs.BOM_UTF8)
    try:
        return Source(name, data.decode("utf-8"))
    except UnicodeDecodeError as err:
        line_start = data.rfind(b"\n", 0, err.start) + 1
        span = Span(Source(name, "", quoted=False), data.count(b"\n", 0, err.start) + 1,
                    len(data[line_start:err.start].decode("utf-8")) + 1)
        raise MhaError(f"this file is not UTF-8 text: byte 0x{data[err.start]:02x} cannot be "
                       f"decoded", span) from None

