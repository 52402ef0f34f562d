"""Split a dataset into one file per device: data/device-1.npz, data/device-2.npz, ...

Each file holds x (samples, features) float32 and y (samples,) int64 class labels, the form
`edge-agent --data` reads. The dataset here is generated, so the project runs at once:
readings of 12 sensors that tell 4 machine states apart. A state reads differently at each
of the machines' 16 operating points (load, speed), the same way on every machine, and a
device has only 150 labelled readings, too few to learn those 64 patterns alone. Each
device mostly sees some of the states and reads its sensors with its own calibration
offset, as real devices do; federation lends each device what the others learnt of the
patterns it rarely sees. Replace `dataset()` with your own data and keep the rest.

    python split.py [--devices 12] [--samples 150] [--seed 1]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

FOLDER = Path(__file__).resolve().parent / "data"
FEATURES, CLASSES, OPERATING_POINTS = 12, 4, 16


def dataset(devices: int, samples: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(x, y) of each device."""
    rng = np.random.default_rng(seed)
    # how each state reads at each operating point: the same on every machine
    centres = rng.normal(0, 1.8, (CLASSES, OPERATING_POINTS, FEATURES))
    shares = []
    for _ in range(devices):
        mix = rng.dirichlet(np.ones(CLASSES))  # the states this device sees most
        offset = rng.normal(0, 0.3, FEATURES)  # its own calibration
        y = rng.choice(CLASSES, size=samples, p=mix)
        point = rng.integers(0, OPERATING_POINTS, samples)
        x = centres[y, point] + offset + rng.normal(0, 1.0, (samples, FEATURES))
        shares.append((x.astype(np.float32), y.astype(np.int64)))
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
        counts = " ".join(str(n) for n in np.bincount(y, minlength=CLASSES))
        print(f"{path.relative_to(FOLDER.parent)}: {len(y)} samples, of states 0-3: {counts}")
    print("next: coordinator simulate --run run.toml")


if __name__ == "__main__":
    main()
