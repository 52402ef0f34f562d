"""Split a dataset into one file per device: data/device-1.npz, data/device-2.npz, ...

Each file holds x (windows, channels, steps) float32 of normal operation and no y (the model
learns to rebuild x), the form `edge-agent --data` reads. The dataset here is generated, so
the project runs at once: vibration windows of pumps, 2 channels of 32 steps, each pump
humming at its own frequency and amplitude. data/anomalies.npy holds windows of failing
pumps (a bearing defect's high-frequency burst) to score with a trained model. Replace
`dataset()` with your own data and keep the rest.

    python split.py [--devices 4] [--samples 300] [--seed 1]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

FOLDER = Path(__file__).resolve().parent / "data"
CHANNELS, STEPS = 2, 32


def hum(rng: np.random.Generator, count: int, frequency: float, amplitude: float) -> np.ndarray:
    """`count` windows of a pump in normal operation."""
    t = np.linspace(0, 1, STEPS)
    phase = rng.uniform(0, 2 * np.pi, (count, 1, 1))
    base = amplitude * np.sin(2 * np.pi * frequency * t + phase)
    second = 0.5 * amplitude * np.cos(2 * np.pi * frequency * t + phase)
    noise = rng.normal(0, 0.05, (count, CHANNELS, STEPS))
    return np.concatenate([base, second], axis=1) + noise


def dataset(devices: int, samples: int, seed: int) -> list[np.ndarray]:
    """x of each device: its pump's normal windows."""
    rng = np.random.default_rng(seed)
    return [
        hum(rng, samples, rng.uniform(2, 4), rng.uniform(0.6, 1.0)).astype(np.float32)
        for _ in range(devices)
    ]


def anomalies(count: int, seed: int) -> np.ndarray:
    """Windows of failing pumps: normal hum plus a high-frequency burst."""
    rng = np.random.default_rng(seed + 1)
    x = hum(rng, count, rng.uniform(2, 4), rng.uniform(0.6, 1.0))
    burst = 0.8 * np.sin(2 * np.pi * 13 * np.linspace(0, 1, STEPS))
    return (x + burst * (rng.uniform(0, 1, (count, CHANNELS, 1)) > 0.3)).astype(np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4, help="how many device files")
    parser.add_argument("--samples", type=int, default=300, help="windows per device")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if args.devices < 1 or args.samples < 20:
        parser.error("need at least 1 device and 20 samples a device")
    FOLDER.mkdir(exist_ok=True)
    for old in FOLDER.glob("device-*.npz"):
        old.unlink()  # a smaller fleet than last time leaves no stale device behind
    for k, x in enumerate(dataset(args.devices, args.samples, args.seed), start=1):
        path = FOLDER / f"device-{k}.npz"
        np.savez(path, x=x)
        print(f"{path.relative_to(FOLDER.parent)}: {len(x)} windows of normal operation")
    np.save(FOLDER / "anomalies.npy", anomalies(20, args.seed))
    print("data/anomalies.npy: 20 windows of failing pumps, to score with a trained model")
    print("next: coordinator simulate --run run.toml")


if __name__ == "__main__":
    main()
