"""Atomic checkpoints: an agent never loses a completed round, nor reads half a file.

Written as temporary file + fsync + rename + fsync of the folder, so after a crash or a power
loss the checkpoint is either the previous round's or this round's, never a mix; a full disk
leaves the previous one too (and raises `agent.files.DiskFullError`). Read with
`torch.load(weights_only=True)`: a checkpoint holds tensors and plain data only, so loading
one cannot run code.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from agent.files import atomic_write, disk_full_as_error
from agent.learning import Published

FORMAT = 1


class CheckpointError(RuntimeError):
    """A checkpoint exists but cannot be used (corrupt, another format, another run)."""


def save(path: Path, payload: dict[str, Any]) -> None:
    """Serialize in memory first: torch's zip writer turns a failing file write into its own
    RuntimeError ("unexpected pos ..."), which would hide that the disk is full."""
    buffer = io.BytesIO()
    torch.save({"format": FORMAT, **payload}, buffer)
    atomic_write(path, lambda handle: handle.write(buffer.getbuffer()))


def load(path: Path) -> dict[str, Any] | None:
    """The saved payload, or None when there is no checkpoint yet."""
    if not path.exists():
        return None
    try:
        payload = torch.load(path, weights_only=True)
    except Exception as exc:  # torch raises many types for damaged files
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a checkpoint of format {FORMAT}")
    return payload


def saved_model(model: Published) -> dict[str, Any]:
    """A model as a checkpoint holds it: plain tensors, masks as a dict ({} when dense)."""
    return {"weights": model.weights, "masks": model.masks or {}, "samples": model.num_samples}


def restored_model(saved: Mapping[str, Any]) -> Published:
    """A model read back from `saved_model` (one saved without its sample count: 0)."""
    return Published(saved["weights"], saved["masks"] or None, saved.get("samples", 0))


def append_record(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON line and fsync, so the per-round log survives a crash; a torn last
    line (a crash or a full disk mid-write) is cut off first, so the record never glues
    onto it."""
    with disk_full_as_error(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a+b") as handle:
            _cut_torn_tail(handle)
            handle.write(json.dumps(record).encode() + b"\n")
            handle.flush()
            os.fsync(handle.fileno())


def _cut_torn_tail(handle: Any) -> None:
    """Truncate an open log after its last newline, when its last line has none."""
    end = handle.seek(0, os.SEEK_END)
    if end == 0:
        return
    handle.seek(end - 1)
    if handle.read(1) == b"\n":
        return
    handle.seek(0)
    handle.truncate(handle.read().rfind(b"\n") + 1)


def _parse(line: str) -> dict[str, Any] | None:
    """One round's record, or None for a line that is not one (torn, or zeros)."""
    try:
        record = json.loads(line)
        int(record["round"])
    except (ValueError, TypeError, KeyError):
        return None
    return record if isinstance(record, dict) else None


def read_records(path: Path) -> dict[int, dict[str, Any]]:
    """Per-round records by round; a round redone after a crash keeps its last record, and a
    torn line (a crash mid-write) is skipped."""
    records: dict[int, dict[str, Any]] = {}
    if not path.exists():
        return records
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        record = _parse(line)
        if record is not None:
            records[int(record["round"])] = record
    return records


def repair_records(path: Path) -> dict[int, dict[str, Any]]:
    """`read_records`, having rewritten the log (atomically) without the lines that are not
    records and with a final newline, when it had any such damage: what a restore does before
    it appends again."""
    if not path.exists():
        return {}
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.splitlines()
    good = [line for line in lines if _parse(line) is not None]
    if len(good) != len(lines) or (text and not text.endswith("\n")):
        fixed = "".join(line + "\n" for line in good).encode()
        atomic_write(path, lambda handle: handle.write(fixed))
    return read_records(path)
