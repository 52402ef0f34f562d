"""Atomic checkpoints: an agent never loses a completed round, nor reads half a file.

Written as temporary file + fsync + rename + fsync of the folder, so after a crash or a power
loss the checkpoint is either the previous round's or this round's, never a mix. Read with
`torch.load(weights_only=True)`: a checkpoint holds tensors and plain data only, so loading
one cannot run code.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from agent.files import atomic_write
from agent.learning import Published

FORMAT = 1


class CheckpointError(RuntimeError):
    """A checkpoint exists but cannot be used (corrupt, another format, another run)."""


def run_folder(state_dir: Path, run_id: str) -> Path:
    """Where one run's checkpoint and round log live in an agent's state folder: a
    long-lived agent takes part in many runs, and a restart resumes the run it was in."""
    return state_dir / "runs" / run_id


def save(path: Path, payload: dict[str, Any]) -> None:
    atomic_write(path, lambda handle: torch.save({"format": FORMAT, **payload}, handle))


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
    """Append one JSON line and fsync, so the per-round log survives a crash."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def read_records(path: Path) -> dict[int, dict[str, Any]]:
    """Per-round records by round; a round redone after a crash keeps its last record, and a
    torn last line (a crash mid-write) is skipped."""
    records: dict[int, dict[str, Any]] = {}
    if not path.exists():
        return records
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        records[int(record["round"])] = record
    return records
