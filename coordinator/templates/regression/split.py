"""Split a dataset into one file per device: data/device-1.npz, data/device-2.npz, ...

Each file holds x (samples, features) float32 and y (samples,) float32 targets, the form
`edge-agent --data` reads. The dataset here is generated, so the project runs at once: a
building's power draw (the target) from 8 readings (temperature, occupancy, ...). Every
building follows the same physics, partly nonlinear (heating and cooling saturate), which
a device's own 150 readings are too few to learn well alone; but each building has its own
base load and its sensors their own calibration, so a device's best model is partly its
own. Replace `dataset()` with your own data and keep the rest.

    python split.py [--devices 12] [--samples 150] [--seed 1]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

FOLDER = Path(__file__).resolve().parent / "data"
FEATURES, SATURATING = 8, 4


def dataset(devices: int, samples: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(x, y) of each device."""
    rng = np.random.default_rng(seed)
    # the physics every building shares: a linear part and saturating ones
    linear, bent = rng.normal(0, 0.2, FEATURES), rng.normal(0, 1.0, (FEATURES, SATURATING))
    weights = rng.normal(0, 1.0, SATURATING)
    shares = []
    for _ in range(devices):
        base_load = rng.normal(0, 0.3)  # this building's own
        offset = rng.normal(0, 0.2, FEATURES)  # its sensors' calibration
        readings = rng.normal(0, 1, (samples, FEATURES))
        y = readings @ linear + np.tanh(readings @ bent) @ weights + base_load
        x = readings + offset
        y = y + rng.normal(0, 0.1, samples)
        shares.append((x.astype(np.float32), y.astype(np.float32)))
    return shares


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=12, help="how many device files")
    parser.add_argument("--samples", type=int, default=150, help="samples per device")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if args.devices < 1 or args.samples < 20:
        parser.error("need at least 1 device and 20 samples a device")
    FOLDER.mkdir(exist_ok=True)
    for old in FOLDER.glob("device-*.npz"):
        old.unlink()  # a smaller fleet than last time leaves no stale device behind
    for k, (x, y) in enumerate(dataset(args.devices, args.samples, args.seed), start=1):
        path = FOLDER / f"device-{k}.npz"
        np.savez(path, x=x, y=y)
        print(f"{path.relative_to(FOLDER.parent)}: {len(y)} samples, mean target {y.mean():.2f}")
    print("next: coordinator simulate --run run.toml")


if __name__ == "__main__":
    main()
