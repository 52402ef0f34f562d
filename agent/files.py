"""Files that are whole or absent: written to a temporary file, fsynced, renamed into place
and the folder fsynced, so a crash or a power loss leaves the old file or the new one, never a
mix. Checkpoints, the dataset cache, exported models and reports use it."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any


def _fsync_folder(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def atomic_write(path: Path, write: Any) -> None:
    """Call `write(handle)` on a temporary file beside `path`, then move it into place."""
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
