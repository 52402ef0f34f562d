"""Synthetic run-to-failure sensor windows: each machine wears at its own rate; temperature,
vibration and current drift as it wears, with noise, and the target is the remaining useful
life (1 when new, 0 at failure). Machines are the groups: with `partition = "natural"` each
device monitors its own machines. Each machine's last `TEST_WINDOWS` are set aside for
testing (`test`): a device is scored on 120 windows of its machines.
"""

from __future__ import annotations

import numpy as np

MACHINES = 16
WINDOWS = 64
TEST_WINDOWS = 60
STEPS, SENSORS = 20, 3


def load(seed: int = 1) -> dict[str, np.ndarray]:
    """edgefl calls this (with the run's seed) at the start of every run: x (N, 20, 3)
    float32 windows, y (N,) float32 remaining useful life, groups the machine, test the
    windows set aside for testing."""
    rng = np.random.default_rng(seed)
    xs, ys, groups, test = [], [], [], []
    for machine in range(MACHINES):
        rate = rng.uniform(0.6, 1.6)  # how fast this machine wears
        offset = rng.normal(0, 0.3, SENSORS)  # its own sensor calibration
        for window in range(WINDOWS + TEST_WINDOWS):
            life = rng.uniform(0, 1)
            wear = 1 - life + np.linspace(0, 0.05, STEPS)[:, None]
            signal = np.concatenate(
                [wear * rate, (wear * rate) ** 2, np.sqrt(np.clip(wear, 0, None))], axis=1
            )
            xs.append(signal + offset + rng.normal(0, 0.1, (STEPS, SENSORS)))
            ys.append(life)
            groups.append(machine)
            test.append(window >= WINDOWS)
    return {
        "x": np.asarray(xs, np.float32),
        "y": np.asarray(ys, np.float32),
        "groups": np.asarray(groups, np.int64),
        "test": np.asarray(test),
    }
