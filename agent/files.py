"""Files that are whole or absent: written to a temporary file, fsynced, renamed into place
and the folder fsynced, so a crash or a power loss leaves the old file or the new one, never a
mix. Checkpoints, the dataset cache, exported models and reports use it.

A write that fails because the disk is full (or out of quota, or read-only) raises
`DiskFullError`, one line naming the file, so a long-lived agent on a full SD card says why it
stopped instead of dying with a chained traceback.
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})
"""The write errors no retry fixes: the device's disk needs room (or to be writable)."""


class DiskFullError(RuntimeError):
    """A file could not be written: its disk is full, out of quota or read-only.

    Not an OSError, so no `except OSError` on the way up (a transport's, a retry's) takes it
    for a passing I/O hiccup: it ends the run with its one-line message.
    """

    def __init__(self, path: Path, cause: OSError) -> None:
        name = errno.errorcode.get(cause.errno or 0, "E?")
        super().__init__(f"disk full: cannot write {path}: {cause.strerror or cause} ({name})")
        self.path = path


@contextmanager
def disk_full_as_error(path: Path) -> Iterator[None]:
    """Turn a disk-full OSError raised inside into a `DiskFullError` naming `path`."""
    try:
        yield
    except OSError as exc:
        if exc.errno in DISK_FULL_ERRNOS:
            raise DiskFullError(path, exc) from exc
        raise


def _fsync_folder(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def atomic_write(path: Path, write: Any) -> None:
    """Call `write(handle)` on a temporary file beside `path`, then move it into place.

    On any failure (a full disk included) the temporary file is removed and the file at
    `path`, if any, is left as it was.
    """
    with disk_full_as_error(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(descriptor, "wb") as handle:
                write(handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        _fsync_folder(path.parent)
