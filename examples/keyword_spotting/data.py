"""Synthetic keyword spectrograms: each keyword is a frequency sweep (its own start and end
band) over the frames, drawn by speakers who each shift it in pitch and speed, with noise.
Speakers are the groups: with `partition = "natural"` every device hears its own speakers,
the non-IID setting keyword spotting on devices is. Each speaker's last `TEST_UTTERANCES`
are set aside for testing (`test`): a device is scored on 120 utterances of its speakers, so
that one utterance is less than a point.
"""

from __future__ import annotations

import numpy as np

KEYWORDS = 6
SPEAKERS = 16
UTTERANCES = 48
TEST_UTTERANCES = 60
MEL_BINS, FRAMES = 16, 24


def load(seed: int = 1) -> dict[str, np.ndarray]:
    """edgefl calls this (with the run's seed) at the start of every run: x (N, 1, 16, 24)
    float32 log-mel-like energies, y the keyword, groups the speaker, test the utterances
    set aside for testing."""
    rng = np.random.default_rng(seed)
    starts = rng.uniform(2, MEL_BINS - 3, KEYWORDS)
    ends = rng.uniform(2, MEL_BINS - 3, KEYWORDS)
    bins = np.arange(MEL_BINS)[:, None]
    xs, ys, groups, test = [], [], [], []
    for speaker in range(SPEAKERS):
        pitch, speed = rng.normal(0, 1.0), rng.uniform(0.8, 1.2)
        for utterance in range(UTTERANCES + TEST_UTTERANCES):
            word = int(rng.integers(KEYWORDS))
            t = np.clip(np.arange(FRAMES) / FRAMES * speed, 0, 1)
            centre = starts[word] + (ends[word] - starts[word]) * t + pitch
            energy = np.exp(-0.5 * ((bins - centre[None, :]) / 1.2) ** 2)
            xs.append(energy + rng.normal(0, 0.15, energy.shape))
            ys.append(word)
            groups.append(speaker)
            test.append(utterance >= UTTERANCES)
    x = np.asarray(xs, np.float32)[:, None]
    return {
        "x": x,
        "y": np.asarray(ys, np.int64),
        "groups": np.asarray(groups, np.int64),
        "test": np.asarray(test),
    }
