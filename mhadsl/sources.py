"""Reading `.mha` files that may be hostile: the one way the CLI, the API and imports read
a source file, and the way the compile cache reads its entries.

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

from mhadsl.diagnostics import MhaError, Source, Span

MAX_SOURCE_BYTES = 16 << 20  # far past any hand-written or generated .mha file
SOURCE_SUFFIX = ".mha"


def read_regular_file(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of a regular file of at most `limit` bytes; anything else is an `OSError`
    whose `strerror` says why."""
    _require_regular(os.stat(path).st_mode, path)  # opening some devices does something
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
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
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    if not stat.S_ISREG(mode):
        raise OSError(errno.EINVAL, "not a regular file (a device, FIFO or socket)", str(path))


def read_source_file(path: str | os.PathLike, name: str | None = None) -> Source:
    """A `.mha` file's text as a `Source` reported as `name` (default: the path).

    Raises `OSError` (its `strerror` says why) for anything but a regular file named
    `*.mha` of at most `MAX_SOURCE_BYTES`, and `MhaError` for bytes that are not UTF-8.
    Only `.mha` files are accepted, so no diagnostic ever quotes another kind of file.
    """
    data = read_regular_file(path, MAX_SOURCE_BYTES)
    if not os.fspath(path).endswith(SOURCE_SUFFIX):
        raise OSError(errno.EINVAL, f"not a {SOURCE_SUFFIX} file", str(path))
    return decode_source(name or str(path), data)


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

