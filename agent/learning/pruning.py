"""When to prune further: detection score, fleet vote, t* and the schedule (ALGORITHMS.md 1.7-1.8).

Timing follows Algorithm 1 of the paper: in round t each agent trains, computes its detection
score and votes (line 16-17); pruning in round t happens only if t is already in the schedule
(line 18); the schedule is filled at the end of round t* (line 27). So there is no further
pruning at t* itself: the first event is at t* + I_1, and every pruning time is > t* and < T.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from agent.learning.config import DETECTION_SCALES, DISTANCES

_EPS = 1e-9


def _ceil(x: float) -> int:
    """ceil with relative slack, so 10.000000000000002 (float error) counts as 10."""
    return math.ceil(x - _EPS * max(1.0, abs(x)))


def distance_from_init(
    state: Mapping[str, torch.Tensor],
    init_state: Mapping[str, torch.Tensor],
    prunable: Iterable[str],
    kind: str = "norm",
) -> float:
    """D_k^t = ||w - w0|| over the prunable tensors, in float64 (1.7, eq. 4).

    ``init_state`` is the agent's own starting model w_k^0 = w0 (.) m_k. ALGORITHMS.md 1.7
    takes the norm, as the authors' code computes it; ``kind="squared"`` gives ||w - w0||^2,
    as the paper prints it. The norm's score is the squared one times
    sqrt(D^1) / (sqrt(D^t) + sqrt(D^(t-1))), at most half of it while D stays above D^1 and
    less as D grows, so it settles below delta_pr much earlier: with the square, t* comes so
    late that DA-DPFL never prunes further within T (studies/paper_claims.py).
    """
    if kind not in DISTANCES:
        raise ValueError(f"distance must be one of {', '.join(DISTANCES)}, got {kind!r}")
    squared = math.fsum(
        float((state[n].to(torch.float64) - init_state[n].to(torch.float64)).square().sum())
        for n in sorted(prunable)
    )
    return squared if kind == "squared" else math.sqrt(squared)


def detection_score(d_t: float, d_prev: float, d_1: float) -> float:
    """Score_k^t = |D^t - D^(t-1)| / |D^1| (1.7, eq. 4); D^0 = 0, so round 1 scores 1.

    D^1 = 0 means the model did not move in round 1 (no data, zero learning rate): then the
    score is 0 if it is still not moving (0/0: settled) and +inf if it is (no scale: not settled).
    """
    change = abs(d_t - d_prev)
    if d_1 == 0:
        return 0.0 if change == 0 else math.inf
    return change / abs(d_1)


def scaled_score(distances: Sequence[float], scale: str = "peak") -> float:
    """The latest round's detection score from an agent's distances D^1..D^t (D^0 = 0).

    `first` is the paper's, |D^t - D^(t-1)| / |D^1| (`detection_score`). `peak` measures the
    change against the largest change so far, |D^t - D^(t-1)| / max_s |D^s - D^(s-1)|: "the
    model now moves away from its start at less than delta_pr of its fastest", which is
    free of D^1's own scale. That scale decides whether the paper's score ever falls below
    a fixed delta_pr: on the keyword-spotting example (BatchNorm, weights that keep drifting
    after their first round) it stayed at 0.2-0.3 for all 30 rounds, so t* never came, while
    on digits it fell below 0.02 only at round 17 of 30; relative to its own peak the score
    settles in both (bench/learning_quality.py)."""
    if scale not in DETECTION_SCALES:
        raise ValueError(
            f"detection scale must be one of {', '.join(DETECTION_SCALES)}, got {scale!r}"
        )
    previous = distances[-2] if len(distances) > 1 else 0.0
    if scale == "first":
        return detection_score(distances[-1], previous, distances[0])
    changes = [abs(b - a) for a, b in zip([0.0, *distances[:-1]], distances, strict=True)]
    peak = max(changes)
    return changes[-1] / peak if peak > 0 else 0.0


def vote(score: float, delta_pr: float = 0.02) -> bool:
    """v_t(k) = 1 when the model has settled: score < delta_pr (1.7, eq. 5)."""
    return score < delta_pr


def tally(votes: Mapping[str, bool], roster: Sequence[str], delta_v: float = 0.5) -> bool:
    """True when the fraction of 1-votes over the roster reaches delta_v (1.7).

    Roster members without a vote count as 0; votes from ids outside the roster are ignored.
    """
    members = set(roster)
    if not members:
        raise ValueError("empty roster")
    yes = sum(1 for a in members if votes.get(a, False))
    return yes / len(members) >= delta_v


def pruning_times(t_star: int, total_rounds: int, b: float = 0.0, c: float = 1.3) -> list[int]:
    """Further-pruning rounds t_p = t* + I_1 + ... + I_p, kept while < T (1.8, eq. 6).

    I_tau = max(1, ceil((t* + b) / c^(tau - 1))), each computed directly from the formula
    (no rounding of one interval into the next).
    """
    if t_star < 1 or total_rounds < 1 or c <= 0:
        raise ValueError("need t_star >= 1, total_rounds >= 1, c > 0")
    times: list[int] = []
    t, tau = t_star, 1
    while True:
        t += max(1, _ceil((t_star + b) / c ** (tau - 1)))
        if t >= total_rounds:
            return times
        times.append(t)
        tau += 1


@dataclass
class PruningPlan:
    """Decides t* once and answers "prune this round?" (1.7-1.8).

    Feed ``observe(t, tally_reached)`` once per round, in increasing t. t* is the first
    observed round whose tally is reached; later tallies never move it. A plan restored with a
    known ``t_star`` answers from it directly.
    """

    total_rounds: int
    b: float = 0.0
    c: float = 1.3
    t_star: int | None = None
    _last_round: int = field(default=0, repr=False)

    def observe(self, t: int, tally_reached: bool) -> int | None:
        """Record round t's tally; returns t* (None while undecided)."""
        if t <= self._last_round:
            raise ValueError(
                f"rounds must be observed in increasing order, got {t} after {self._last_round}"
            )
        self._last_round = t
        if self.t_star is None and tally_reached:
            self.t_star = t
        return self.t_star

    @property
    def times(self) -> list[int]:
        """The pruning rounds (empty until t* is decided)."""
        if self.t_star is None:
            return []
        return pruning_times(self.t_star, self.total_rounds, self.b, self.c)

    def is_pruning_round(self, t: int) -> bool:
        """Whether round t prunes further (the caller also checks sparsity < s*, 1.9)."""
        return t in self.times
