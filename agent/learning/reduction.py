"""How a budgeted agent cuts a round to p_k: prune to a density cap, freeze neurons, or the
rule that picks between them (ALGORITHMS.md 5)."""

from __future__ import annotations

from dataclasses import dataclass

from agent.learning.learner import Learner
from agent.learning.sparse import Masks


def capped_density(learner: Learner, p_k: float | None, masks: Masks | None) -> float | None:
    """The density the budget allows this round's sparse model (None: no cap applies)."""
    if p_k is None or masks is None:
        return None
    return density_cap(p_k, learner.config.density, learner.flops_per_density(masks))


FREEZE_MIN_ACTIVE = 0.5
"""`--reduce auto` freezes when that leaves at least this fraction of neurons training."""


MIN_ACTIVE = 0.05


@dataclass(frozen=True)
class Reduction:
    """How an agent cuts this round's compute to its budget (ALGORITHMS.md 5)."""

    density_cap: float | None = None
    """Prune the aggregated model to this density first (DA-DPFL's way)."""
    active_fraction: float | None = None
    """Train only this fraction of the neurons, freezing the rest (FedSPU's way)."""


def local_reduction(learner: Learner, p_k: float | None, masks: Masks | None) -> Reduction:
    """`--reduce`: prune (cap the density), freeze (train a fraction of the neurons, the rest
    frozen and kept), or auto (freeze if at least half the neurons can still train, else prune).

    p_k is the fraction of a dense round's FLOPs the agent can afford; a full round of the
    sparse model costs c, its FLOP fraction. A frozen weight skips only its weight-gradient
    pass, a third of its cost (`frozen_training_flops`), so training a fraction a of the
    weights costs c (2 + a) / 3 and a = 3 p_k / c - 2 meets the budget; taking a as the
    neuron fraction errs on the cheap side (a weight trains only when both its neurons do).
    Freezing cannot go below 2/3 of a round: an agent further short needs pruning, which
    auto picks.
    """
    if p_k is None or masks is None:
        return Reduction()
    cost = learner.forward_flops(masks) / learner.dense_flops
    mode = learner.config.reduce
    active = 3.0 * p_k / cost - 2.0
    if mode == "auto":
        mode = "freeze" if active >= FREEZE_MIN_ACTIVE else "prune"
    if mode == "freeze":
        if active >= 1.0:
            return Reduction()
        return Reduction(active_fraction=max(active, MIN_ACTIVE))
    return Reduction(density_cap=capped_density(learner, p_k, masks))


def density_cap(p_k: float, initial_density: float, flops_per_density: float = 1.0) -> float:
    """The highest density a pruned (DA-DPFL) model may train at this round.

    cap = min(initial_density, p_k / flops_per_density). A pruned model's training FLOPs are
    its FLOP fraction times the dense ones, so the cap keeps them within p_k of a dense round.
    With p_k = 1 the cap never binds: it is at least the current density (a FLOP fraction is
    at most 1) and DA-DPFL never exceeds its initial density.
    It may go below the target density 1 - s*: s* is where the algorithm's own pruning stops,
    the cap is what the device can afford; a weaker device gets a lower cap, so fewer FLOPs.

    flops_per_density: FLOP fraction / density of the masks the agent trains with, measured
    each round with `forward_flops`. Parameter density is not FLOP density: ERK gives
    ResNet-18's early layers (few parameters, many FLOPs) a higher density, so at density 0.2
    its FLOP fraction is 0.5 (ratio 2.5, 1.6 at density 0.5); for the bundled cnn1d and cnn2d
    the ratio is about 0.85. Pruning to the cap changes the ratio; the next round's cap,
    computed from the new masks, corrects for it.
    """
    if not 0 < p_k <= 1 or not 0 < initial_density <= 1 or not flops_per_density > 0:
        raise ValueError(
            f"need p_k and initial_density in (0, 1] and a positive flops_per_density, got "
            f"{p_k}, {initial_density}, {flops_per_density}"
        )
    return min(initial_density, p_k / flops_per_density)


def active_fraction(p_k: float) -> float:
    """The fraction of neurons a frozen (FedSPU) model trains this round: p_k itself, as
    ALGORITHMS.md section 2 decides (the per-layer floor of one neuron is FedSPU's).

    Freezing saves less than it trains: frozen neurons still run forward and pass gradients
    back to active ones, so only the weight-gradient third of the backward pass shrinks (to
    about a^2 of it between hidden layers). Training FLOPs stay above ~2/3 of dense whatever
    p_k is: freezing alone cannot meet a budget below that.
    """
    if not 0 < p_k <= 1:
        raise ValueError(f"p_k must be in (0, 1], got {p_k}")
    return p_k
