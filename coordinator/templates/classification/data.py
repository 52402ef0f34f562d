"""How a device reads its own data, and how the lab reads every device's.

- On a device, `edge-agent --data python:./data.py:device` calls `device()`: it reads
  data/device.npz beside this file (the device's own file from split.py). Replace its body
  with what reads your device's own samples (a sensor log, a folder of recordings).
- `coordinator simulate` and `emulate` call `fleet()` (run.toml's dataset): every device
  file that split.py wrote, each device one group, so that with `partition = "natural"`
  each simulated agent trains on one device's file, as a real device would.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

FOLDER = Path(__file__).resolve().parent / "data"


def read(path: Path) -> dict[str, np.ndarray]:
    """x (samples, features) float32 and y (samples,) int64 class labels, from one file."""
    with np.load(path, allow_pickle=False) as stored:
        return {"x": stored["x"].astype(np.float32), "y": stored["y"].astype(np.int64)}


def device() -> dict[str, np.ndarray]:
    """This device's own samples (`edge-agent --data python:./data.py:device`)."""
    path = FOLDER / "device.npz"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: copy this device's file from split.py's data/ here")
    return read(path)


def fleet() -> dict[str, np.ndarray]:
    """Every device's samples, `groups` saying whose (the simulated fleet's dataset)."""
    files = sorted(FOLDER.glob("device-*.npz"), key=lambda p: int(p.stem.split("-")[1]))
    if not files:
        raise FileNotFoundError(f"no device files in {FOLDER}: run `python split.py` first")
    parts = [read(path) for path in files]
    return {
        "x": np.concatenate([part["x"] for part in parts]),
        "y": np.concatenate([part["y"] for part in parts]),
        "groups": np.concatenate([np.full(len(p["x"]), k) for k, p in enumerate(parts)]),
    }
