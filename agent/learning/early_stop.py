"""Early stopping (ALGORITHMS.md 2): after each round an agent computes
L_t = 0.7 L_train + 0.3 L_val and asks its stop rule (`--stop-rule`) whether it stops; a
stopped agent keeps its model. Measured in studies/early_stopping.py (20 agents, Dirichlet 0.3,
60 rounds x 2 epochs; fedspu, fedavg-ft, dadpfl; mnist1d, digits; 3 seeds; cut = agent-rounds
not trained, change = final mean accuracy over all agents against the same run without):

* `paper`: stop after `patience` (default 1) consecutive rises of L_t over L_(t-1); patience
  1 is the FedSPU paper's rule as printed. An edge agent validates on a few to a few dozen
  samples, so L_t rises by noise within a few rounds while the fleet is still learning, and
  the agent keeps that early model: cut 69-94%, change -16 to -63 points (patience 3: cut
  1-44%, change -0.4 to -21 points).
* `progress` (the default): stop once the last `patience` (default 20) rounds lowered the agent's
  best L by at most a fraction `delta` (default 0.1) of all it lowered it since its first round,
  L_1 - L_best: "the curve has levelled off". It reads only the best L, so a noisy rise changes
  nothing, and it measures progress against the agent's own (L's scale differs by dataset and
  agent). On digits, where the fleet converges by round ~45, it cut 30-34% of the agent-rounds at
  -0.27 (fedspu) and -0.45 (fedavg-ft) points, the paper's claim; on mnist1d, still learning at
  round 60, it cut 5-7% and there was no 25% to take: stopping every agent at round 45 costs
  0.7-5.9 points. At 150 rounds mnist1d still learns (a 25% cut costs ~3 points even stopping all
  agents at once) and the rule stops every agent, cutting 53-62% at -5 to -11 points; at 300
  rounds (3 seeds), where stopping all agents at round 225 stays within a point in 4 of 9 runs, it
  stops them all by round 139 at -9 to -16 points: on mnist1d an agent's own L stalls for 20
  rounds and falls again as the fleet's models improve, which no rule on the agent's L alone told
  apart. A round that pruned the agent's model (DA-DPFL) restarts the window: L from before
  belongs to another model, and an agent that stopped right after pruning kept a model that had
  not recovered. A DA-DPFL agent's neighbours leave it out once it stopped (`rounds.live`): with
  its last model standing in, they lost 1.34 points on digits (10 seeds; 1.66 for the agents
  that trained on), and 0.97 (0.30) without it, at the same 32% cut; on mnist1d 2.67 and 0.64
  (3 seeds). With delta 0 it is the usual patience against the best L (no new best in `patience`
  rounds), which stopped agents mid-learning in the replay (up to 3.5 points at 10 rounds).
  On the 20-40-round runs of bench/learning_quality.py (keyword spotting, digits and mnist1d
  at Dirichlet 0.5, a feature-shift task; local, fedavg, fedspu, dadpfl; 2 seeds; with the
  default optimizer, which levels off sooner) a shorter window cut more and cost more: patience
  5 cut 25% of the agent-rounds at -0.3 to -14 points (keyword spotting: -6 to -14), patience
  10 cut 13% at up to -3.7 points (fedspu on mnist1d): the default stays 20.
* `scaled`: `progress` with its window a third of the run's rounds (at least 5: 10 on a
  30-round run, 20 on a 60-round one) and delta 0.05, for runs of 30-60 rounds, where a fixed
  window of 20 leaves little to cut. bench/early_stopping.py recorded the grid's runs without
  early stopping (keyword spotting, digits and mnist1d at Dirichlet 0.5, synthetic-shift;
  local, fedavg, fedspu, dadpfl; seeds 1-3; 30 rounds, mnist1d 40) and replayed candidate
  rules on each agent's figures (cut: agent-rounds not trained, the mean over the 16 cells;
  change: fleet mean of the final metric in points, mean over cells and the worst cell's
  mean over seeds; a stopped agent's effect on the others left out). `progress` 20 (the
  default): 7% at -0.03 (worst -0.41); window 10, delta 0.1: 25% at -0.76 (worst -3.2);
  `scaled`: 18% at -0.22 (worst -1.06). Rules read against the validation set's noise did
  worse: no new best validation metric in 10 rounds cut 28% at -0.88 (worst -4.1), none
  beyond one standard error 38% at -2.4 (worst -11): with 12-28 validation samples the
  metric's standard error is about 8-10 points, and on digits it reaches 98-99% while the test
  metric still climbs a point. L_val alone (window 10, delta 0.05): 21% at -0.59 (worst
  -4.0); the gain projected at the last 10 rounds' pace over the rounds left at most 5% of
  the fall so far: 21% at -0.18 (worst -1.25). Real runs with `scaled`: 17% of the
  agent-rounds (mean over cells; 20% of all) at -0.15 points on average, worst cell -0.72
  (fedspu on digits); it cut 52-54% of local-only training on digits and mnist1d (26% on
  synthetic-shift), 22-37% of fedavg and fedspu on digits and synthetic-shift at -0.08 to
  -0.72 (spread over seeds 0.35-0.67),
  1-12% of the fleets that still learn at their last round (mnist1d), nothing on keyword
  spotting (every cell still rises at round 30) and nothing of DA-DPFL, whose pruning rounds
  restarted the window: its plan prunes every 1-5 rounds, 3-17% of the kept weights each
  (every round near the end, where the prune removes nothing), so the window never filled.
  `scaled` now restarts on a pruning round only when L rose in it by more than 2 standard
  deviations of L's round-to-round changes over the window (`StopWatch.jumped`: the prune
  hurt, the L before belongs to another model); `progress` and `paper` restart as before.
  Replayed on DA-DPFL's cells (bench/early_stopping.py, seeds 1-3), against restarting on
  every prune (0.2% cut): never restarting cut 21% at -0.10 (worst -0.27), restarting only
  when the prune removed more than 10% of the kept weights 1.4%, more than 20% (no prune did)
  as never; the jump beyond 1, 2, 3 standard deviations 17%, 21%, 21% at -0.11, -0.06, -0.07;
  a grace of 2 rounds after each prune lowered the cut to 13-14% at no gain. Measured (real
  runs, the agents' neighbours leaving a stopped agent out): digits 37% +- 2% of the
  agent-rounds at -0.40 +- 0.74 points, synthetic-shift 24% +- 4% at +0.11 +- 0.29, mnist1d
  17% +- 3% at -0.16 +- 0.60, keyword spotting 0% (still learning at round 30). Over the 16
  cells `scaled` then cuts 22% (it was 17%; the other strategies never prune, their runs are
  unchanged) at -0.16 points on average (-0.15 before), worst cell still -0.72 (fedspu on
  digits), 14 of 16 cells within 0.5 points. Even stopping every agent at the one best round,
  the run's future known, cut only 8-11% of mnist1d's fedavg and fedspu within 0.5 points (42%
  over all cells): the issue's target, 25% at no more than 0.5 points, is not on offer on runs
  that end about where learning ends, and `progress` stays the default. On runs longer than
  the task needs it pays: at 60 rounds (digits, synthetic-shift; 8 cells x 3 seeds,
  measured) `scaled`, whose window is then the default's 20, cut 31% at -0.36 points on
  average before the pruning change, which left DA-DPFL uncut (the default, replayed: 39% at
  -0.47), 49-59% on digits (fedavg -0.65, fedspu -0.70, spread 0.66-0.96) and 25-35% on
  synthetic-shift, whose worst cell, local at -1.00, has a spread of 1.92 over seeds; with
  it DA-DPFL's cells cut 47% +- 3% (digits, -0.58 +- 0.38) and 24% +- 8% (synthetic-shift,
  +0.22 +- 0.64), and the 8 cells 40% at -0.40: within 0.5 points on average, not in every
  cell.
  `scaled` also stops an agent over a short window, a fifth of the run (6 rounds at 30, 12 at
  60; `SCALED_SMOOTH_SHARE`), once its best L fell there at no more than the long window's
  pace (delta x 6/10) with L's round-to-round changes there within 1% of its fall since round
  1 (`SCALED_SMOOTH_NOISE`, `StopWatch.smooth`): a plateau that no noise explains need not
  wait out the long window. Screened on the grid recorded again (bench/early_stopping.py,
  seeds 1-3; replayed: 26% at -0.28, against 23% at -0.24 without it), beside rules on L's
  slope against its noise, on log L, on L's fall against its level, a round of confirmation
  and a floor of rounds, none of which did better. Measured (real runs; keyword spotting's
  cells, where no agent stops, equal the runs without): over the 16 cells at 30-40 rounds
  25.3% of the agent-rounds (22.0% without it) at -0.19 points on average (-0.16), 14 of 16
  cells within 0.5 points (14); the worst, fedspu on digits, -0.90 +- 0.31 at a 46% cut
  (-0.72 at 37%), then fedavg on synthetic-shift -0.67 +- 0.36 at 23% (-0.08 at 22%: seed
  noise at the same cut). It cut local-only training most (64% on digits and mnist1d, 29%
  on synthetic-shift), digits' fleets 41-46%, DA-DPFL 17-44%. At 60 rounds (digits,
  synthetic-shift, 8 cells) it cut 47% at -0.56 (40% at -0.40 without it), worst -1.03
  (local on synthetic-shift, spread 1.91), 3 of 8 cells within 0.5 points (3): the issue's
  target, 25% at no more than 0.5 points, is met on average at 30-40 rounds and missed at 60
  rounds, and by the worst cells at both. So the short window runs only on runs of at most
  40 rounds (`SCALED_SMOOTH_ROUNDS`): longer runs take the long window alone, measured above
  at 60 rounds at 40% and -0.40. That meets the target on the grid's mean at both lengths,
  not in its worst cells (three seeds cannot tell 0.5 point from noise per cell: even an
  agent stopped by an oracle at its best round misses 0.5 in 4 of 16): `progress` stays the
  default.
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from agent.learning.config import (
    DEFAULT_STOP_RULE,
    SCALED_DELTA,
    SCALED_LEAST,
    SCALED_PRUNE_NOISE,
    SCALED_SHARE,
    SCALED_SMOOTH_NOISE,
    SCALED_SMOOTH_ROUNDS,
    SCALED_SMOOTH_SHARE,
    STOP_RULES,
)

if TYPE_CHECKING:
    from agent.learning.config import StrategyConfig
    from agent.learning.facts import LocalData
    from agent.learning.model_facts import ModelFacts
    from agent.learning.sparse import State


@dataclass(frozen=True)
class StopRule:
    """How an agent decides to stop: the rule, its patience (`paper`: consecutive rises of L;
    `progress`, `scaled`: the window of rounds) and their fraction delta (`scaled` is
    `progress` with its window a share of the run and its own delta). `prune_noise`: a
    pruning round restarts the window only when L rose in it by more than that many standard
    deviations of L's round-to-round changes over the window (None: every pruning round
    restarts it; `scaled`: `SCALED_PRUNE_NOISE`). `smooth_window`, `smooth_noise`: a shorter
    window over which a smooth plateau stops the agent early (`StopWatch.smooth`; 0: none;
    `scaled`: a `SCALED_SMOOTH_SHARE` of the run, `SCALED_SMOOTH_NOISE`, on runs of at most
    `SCALED_SMOOTH_ROUNDS`)."""

    name: str = DEFAULT_STOP_RULE
    patience: int = STOP_RULES[DEFAULT_STOP_RULE]
    delta: float = 0.1
    prune_noise: float | None = None
    smooth_window: int = 0
    smooth_noise: float = 0.0

    @classmethod
    def of(cls, cfg: StrategyConfig) -> StopRule:
        """The rule `cfg` configures (`--stop-patience` 0: the rule's default; `scaled`'s is
        a third of the run's rounds, at least 5), or a one-line ValueError naming the option
        that is wrong."""
        if cfg.stop_rule not in STOP_RULES:
            raise ValueError(
                f"--stop-rule must be one of {', '.join(STOP_RULES)}, got {cfg.stop_rule}"
            )
        if cfg.stop_patience < 0:
            raise ValueError(
                f"--stop-patience must be >= 0 (0: the rule's default), got {cfg.stop_patience}"
            )
        if not 0 <= cfg.stop_delta < 1:
            raise ValueError(f"--stop-delta must be in [0, 1), got {cfg.stop_delta}")
        if cfg.stop_rule == "scaled":
            window = max(SCALED_LEAST, round(SCALED_SHARE * cfg.rounds))
            smooth = max(SCALED_LEAST, round(SCALED_SMOOTH_SHARE * cfg.rounds))
            if cfg.rounds > SCALED_SMOOTH_ROUNDS:  # measured: it costs more than it cuts there
                smooth = 0
            return cls(
                "scaled",
                cfg.stop_patience or window,
                SCALED_DELTA,
                SCALED_PRUNE_NOISE,
                smooth,
                SCALED_SMOOTH_NOISE,
            )
        patience = cfg.stop_patience or STOP_RULES[cfg.stop_rule]
        return cls(cfg.stop_rule, patience, cfg.stop_delta)

    @property
    def reason(self) -> str:
        """Why an agent under this rule stopped, for its log."""
        return "its loss rose" if self.name == "paper" else "its loss levelled off"


@dataclass(frozen=True)
class StopWatch:
    """An agent's early-stopping state, both rules' statistics, as plain numbers so that it
    checkpoints and a restored agent decides as one that never restarted: its last L and how
    many rounds in a row L rose (`paper`); its first finite L (since the last pruning
    round) and its best L after each of the latest rounds, at most `patience` + 1
    (`progress`); the latest finite L themselves, as many, for the noise a pruning round's
    rise is read against (`prune_noise`). A checkpoint from before the rules (only
    `previous` and `rises`) or before `losses` still loads; `progress` then starts its
    window anew, and a pruning round before the window holds two changes of L restarts it."""

    previous: float | None = None
    rises: int = 0
    first: float | None = None
    bests: tuple[float, ...] = field(default=())
    losses: tuple[float, ...] = field(default=())

    def after(
        self,
        loss: float,
        patience: int,
        rule: str = "paper",
        delta: float = 0.1,
        restart: bool = False,
        prune_noise: float | None = None,
        smooth_window: int = 0,
        smooth_noise: float = 0.0,
    ) -> tuple[StopWatch, bool]:
        """The state after a round with loss `loss`, and whether the agent stops under `rule`
        (a StopRule's fields; `paper` unless told, the watch's only rule before `progress`;
        `scaled` decides as `progress`, on the window and delta its StopRule carries).
        A NaN L (no validation split) is never a rise, and `progress` skips it, so an agent
        without a validation split never stops. `restart` (a round that pruned the model:
        the L before it may belong to another model) starts `progress` anew from this
        round's L, so the agent trains at least `patience` more rounds, unless `prune_noise`
        says the prune left L within its noise (`jumped`); `paper` counts as printed.
        `smooth_window` (0: none) shorter than `patience`: `progress` also stops on a smooth
        plateau over that many rounds (`smooth`)."""
        rose = self.previous is not None and loss > self.previous
        if restart and prune_noise is not None:
            restart = self.jumped(loss, prune_noise)
        first, bests = (None, ()) if restart else (self.first, tuple(self.bests))
        losses = tuple(self.losses)
        if not math.isnan(loss):
            first = loss if first is None else first
            bests = (*bests, min(loss, bests[-1]) if bests else loss)[-(patience + 1) :]
            losses = (*losses, loss)[-(patience + 1) :]
        watch = StopWatch(loss, self.rises + 1 if rose else 0, first, bests, losses)
        if rule == "paper":
            return watch, watch.rises >= patience
        levelled = watch.levelled(patience, delta)
        return watch, levelled or watch.smooth(smooth_window, patience, delta, smooth_noise)

    def under(self, loss: float, rule: StopRule, restart: bool = False) -> tuple[StopWatch, bool]:
        """`after`, with the window, delta and noise figures `rule` carries."""
        return self.after(
            loss,
            rule.patience,
            rule.name,
            rule.delta,
            restart,
            rule.prune_noise,
            rule.smooth_window,
            rule.smooth_noise,
        )

    def levelled(self, window: int, delta: float) -> bool:
        """Whether the last `window` rounds lowered the best L by at most `delta` of all it
        fell since the first L (`progress`: "the curve has levelled off")."""
        bests = self.bests
        return (
            self.first is not None
            and len(bests) > window
            and bests[-1 - window] - bests[-1] <= delta * (self.first - bests[-1])
        )

    def smooth(self, window: int, patience: int, delta: float, noise: float) -> bool:
        """Whether the best L fell over the last `window` rounds at no more than the pace
        `progress` allows over `patience` (delta x window / patience of its fall since the
        first L), with L's round-to-round changes there (their standard deviation) within
        `noise` of that fall: a smooth plateau, no stretch of noise, which `scaled` stops
        without waiting out its long window. On the grid's 30-40-round runs it stops agents
        of local-only training and of fleets whose L flattens smoothly (digits, mnist1d,
        synthetic-shift) a few rounds sooner; where L is noisy (keyword spotting) or still
        falls at its pace it does not fire (bench/early_stopping.py)."""
        if not 2 <= window < patience or not self.levelled(window, delta * window / patience):
            return False
        changes = [b - a for a, b in itertools.pairwise(self.losses[-1 - window :])]
        fall = self.first - self.bests[-1] if self.first is not None else 0.0
        return statistics.stdev(changes) <= noise * fall

    def jumped(self, loss: float, noise: float) -> bool:
        """Whether a pruning round's L rose over the round before by more than `noise`
        standard deviations of L's round-to-round changes over the window: a prune that
        hurt the model, whose L before belongs to another model. On the grid DA-DPFL's
        prunes (3-17% of the kept weights each, every 1-5 rounds) seldom did: restarting on
        each kept its agents from ever stopping (bench/early_stopping.py). With fewer than
        two changes to read the noise from, and on a NaN L, it says yes (restart, as before)."""
        changes = [b - a for a, b in itertools.pairwise(self.losses)]
        if math.isnan(loss) or len(changes) < 2:
            return True
        return loss - self.losses[-1] > noise * statistics.stdev(changes)


@dataclass
class EarlyStop:
    """One agent's early stopping (ALGORITHMS.md 2), the same object in the simulator and on
    a device: after each round it computes L = 0.7 L_train + 0.3 L_val and asks its rule
    whether the agent stops (off unless `enabled`)."""

    enabled: bool
    rule: StopRule
    watch: StopWatch = StopWatch()

    @classmethod
    def of(cls, cfg: StrategyConfig) -> EarlyStop:
        """An agent's early stopping as `cfg` configures it (`--early-stop`, `--stop-*`)."""
        return cls(cfg.early_stop, StopRule.of(cfg))

    def after(
        self,
        learner: ModelFacts,
        weights: State,
        train_loss: float,
        data: LocalData,
        restart: bool = False,
    ) -> bool:
        """Whether the agent stops after a round that ended with `weights`; `restart`: the
        round pruned the model (`RoundResult.pruned`), which restarts `progress`."""
        if not self.enabled:
            return False
        loss = learner.stopping_loss(weights, train_loss, data)
        self.watch, stops = self.watch.under(loss, self.rule, restart)
        return stops
