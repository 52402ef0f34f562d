"""Synthetic vibration windows of pumps in normal operation: each pump hums at its own
frequency and amplitude, with noise. `anomalies` makes windows of failing pumps (a bearing
defect's high-frequency burst) to score with the trained model. Each pump's last
`TEST_WINDOWS` are set aside for testing (`test`): a device is scored on 120 windows of its
pumps."""

from __future__ import annotations

import numpy as np

PUMPS = 16
WINDOWS = 48
TEST_WINDOWS = 60
CHANNELS, STEPS = 2, 32


def _hum(rng: np.random.Generator, count: int) -> np.ndarray:
    t = np.linspace(0, 1, STEPS)
    frequency, amplitude = rng.uniform(2, 4), rng.uniform(0.6, 1.0)
    phase = rng.uniform(0, 2 * np.pi, (count, 1, 1))
    base = amplitude * np.sin(2 * np.pi * frequency * t + phase)
    second = 0.5 * amplitude * np.cos(2 * np.pi * frequency * t + phase)
    return np.concatenate([base, second], axis=1) + rng.normal(0, 0.05, (count, CHANNELS, STEPS))


def load(seed: int = 1) -> dict[str, np.ndarray]:
    """edgefl calls this (with the run's seed) at the start of every run: x (N, 2, 32) of
    normal operation, no y (the model reconstructs x), groups the pump, test the windows set
    aside for testing."""
    rng = np.random.default_rng(seed)
    per_pump = WINDOWS + TEST_WINDOWS
    x = np.concatenate([_hum(rng, per_pump) for _ in range(PUMPS)]).astype(np.float32)
    groups = np.repeat(np.arange(PUMPS), per_pump)
    test = np.tile(np.arange(per_pump) >= WINDOWS, PUMPS)
    return {"x": x, "groups": groups, "test": test}


def anomalies(count: int = 20, seed: int = 2) -> np.ndarray:
    """Windows of failing pumps: normal hum plus a high-frequency burst."""
    rng = np.random.default_rng(seed)
    x = _hum(rng, count)
    t = np.linspace(0, 1, STEPS)
    x += 0.8 * np.sin(2 * np.pi * 13 * t) * (rng.uniform(0, 1, (count, CHANNELS, 1)) > 0.3)
    return x.astype(np.float32)
