"""Early-stopping rules (issue 17, point 3): agent-rounds cut and accuracy lost, per rule.

    python bench/early_stopping.py [--seeds 1,2,3] [--datasets mnist1d,digits]
        [--strategies fedspu,fedavg-ft,dadpfl] [--agents 20] [--rounds 60] [--epochs 2]
        [--rules paper,paper3,progress,progress25]
        [--out bench/results/early_stopping.json] [--resume]

`--resume` keeps the runs already in --out (same agents, rounds, epochs) and runs the rest;
`--rules` picks the RUNS to run for real (the baselines and the replay always run).

The FedSPU paper stops a client at the first rise of L = 0.7 L_train + 0.3 L_val and reports
25-71% fewer rounds at no real loss (T = 500). Per (strategy, dataset, seed), Dirichlet 0.3:

1. a run without early stopping that records every agent's L after each round (it only
   evaluates, so its figures are the plain run's: fedspu mnist1d seed 1 0.7277, as in
   bench/strategies.py); it is the baseline of that strategy and seed;
2. every candidate rule replayed offline on those L sequences (an agent stopped after round s
   keeps its round-s accuracy), to shortlist: cheap, but a stopped agent changes what its
   neighbours receive, so the figures below come from
3. real runs with `--early-stop` for the rules in RUNS.

Cut = 1 - agent-rounds trained / the baseline's; change = final-round mean accuracy over all
agents (a stopped agent keeps its model and is still evaluated: the simulator repeats its
last round's figures) minus the baseline's, in points. Target: cut >= 25% at <= 1 point lost.
One simulation at a time, one torch thread.

What the default run shows (seeds 1-3, 20 agents, 60 rounds x 2 epochs; 90 simulations, one
at a time on 2 busy cores: the 18 baselines about 570 s, `paper`, `paper3` and `progress`
1490 s, `progress25` 518 s, each batch added with `--resume`;
bench/results/early_stopping.json). Cut in %, change in points, mean (min..max) over
the seeds; met: mean cut >= 25% and mean change >= -1:

    rule        dataset  strategy   cut %               change, points            met
    paper       mnist1d  fedspu     90 (89..92)         -16.20 (-19.81..-13.64)   no
    paper       mnist1d  fedavg-ft  92 (92..94)         -17.06 (-20.27..-15.11)   no
    paper       mnist1d  dadpfl     93 (93..94)         -16.30 (-17.99..-13.72)   no
    paper       digits   fedspu     69 (66..74)         -25.89 (-28.09..-21.76)   no
    paper       digits   fedavg-ft  86 (82..91)         -53.24 (-63.80..-47.56)   no
    paper       digits   dadpfl     94 (94..94)         -63.48 (-69.14..-60.01)   no
    paper3      mnist1d  fedspu     26 (21..29)         -5.88 (-9.46..-1.65)      no
    paper3      mnist1d  fedavg-ft  32 (28..36)         -9.35 (-11.27..-7.40)     no
    paper3      mnist1d  dadpfl     44 (40..48)         -13.65 (-16.18..-11.56)   no
    paper3      digits   fedspu     12 (5..25)          -4.96 (-11.49..-1.55)     no
    paper3      digits   fedavg-ft  1 (0..3)            -0.38 (-1.14..+0.00)      no
    paper3      digits   dadpfl     39 (28..52)         -21.40 (-44.75..-5.85)    no
    progress    mnist1d  fedspu     7 (6..8)            +1.42 (-1.12..+2.97)      no
    progress    mnist1d  fedavg-ft  7 (5..8)            +0.19 (-0.41..+0.82)      no
    progress    mnist1d  dadpfl     5 (5..6)            -2.67 (-3.35..-1.80)      no
    progress    digits   fedspu     34 (29..36)         -0.27 (-0.41..-0.08)      yes
    progress    digits   fedavg-ft  30 (25..35)         -0.45 (-0.62..-0.30)      yes
    progress    digits   dadpfl     31 (29..33)         -1.18 (-2.00..-0.07)      no
    progress25  mnist1d  fedspu     2 (2..2)            -0.14 (-1.68..+1.08)      no
    progress25  mnist1d  fedavg-ft  2 (0..4)            -1.29 (-3.05..+0.66)      no
    progress25  mnist1d  dadpfl     1 (0..2)            -1.29 (-3.28..+0.00)      no
    progress25  digits   fedspu     25 (20..27)         -0.28 (-0.62..-0.08)      no
    progress25  digits   fedavg-ft  21 (17..26)         -0.21 (-0.62..+0.16)      no
    progress25  digits   dadpfl     25 (21..27)         -0.96 (-1.51..-0.07)      no (*)

DA-DPFL's `progress` rows are with the pruning restart (a round that pruned the agent's model
starts its window anew: agent/learning/early_stop.py), 6 runs, 146 s. Before it (kept in the
JSON as `progress-norestart`, `progress25-norestart`; (*) progress25 was not run again):

    progress    mnist1d  dadpfl     5 (5..6)            -2.67 (-3.35..-1.80)      no
    progress    digits   dadpfl     33 (30..36)         -1.80 (-2.77..-0.07)      no

Per seed on digits: seed 1 unchanged (30%, -0.07: pruning only at round 56), seed 2 36% ->
33%, -2.77 -> -2.00; seed 3 34% -> 29%, -2.57 -> -1.47. mnist1d is unchanged bit for bit:
at 60 rounds no DA-DPFL agent pruned (t* came too late), so its loss has another cause. The
final accuracy of the agents that trained to the end, against the same agents without early
stopping ("bystanders" in the JSON; the runs that recorded each agent): DA-DPFL's lost in
every case, -1.35, -2.55, -2.66 (mnist1d seeds 1-3) and -2.08, -0.38 (digits seeds 2, 3; in
seed 1 all 20 stopped), while fedspu's and fedavg-ft's (mnist1d seed 1) moved +0.03 and
+4.80. So stopped neighbours, whose last models stay in the others' aggregates, likely cost
DA-DPFL about 1-2.5 points; it is not proven: on mnist1d one run's noise is several points.

Offline replay (step 2), mean over the seeds per cell, cut % and change; m/ = mnist1d,
d/ = digits; best = progress with delta 0 (no new best L in that many rounds); the top 12
and the paper's rule; DA-DPFL with the pruning restart (pruning rounds recorded by a
re-run of the baselines, identical L and accuracy):

    candidate        met  m/fedspu  m/fedavg-ft  m/dadpfl  d/fedspu  d/fedavg-ft  d/dadpfl
    progress20d0.1   3      9%  +0.0    8%  +0.7    4%  -0.1   34%  -0.2   31%  -0.2   30%  -0.8
    progress25d0.2   3     17%  -1.3   12%  +0.1    7%  -1.1   34%  -0.2   30%  -0.3   27%  -0.3
    progress15d0.05  2      6%  -1.1   11%  -1.9    6%  -1.3   35%  -0.3   31%  -0.2   34%  -1.7
    progress15d0.1   2     26%  -1.8   24%  -3.3   16%  -2.7   44%  -0.8   41%  -0.9   42%  -2.8
    progress30d0.2   1      7%  +0.1    4%  +0.1    1%  -0.6   25%  -0.2   22%  -0.0   12%  +0.1
    progress25d0.1   1      2%  -0.4    2%  -0.9    1%  -0.3   25%  -0.1   22%  -0.0   20%  -0.5
    progress20d0.2   1     32%  -2.5   23%  -2.2   18%  -2.2   43%  -0.5   39%  -1.3   37%  -1.2
    progress30d0.05  0      0%  +0.0    0%  +0.0    0%  +0.0    7%  +0.0    7%  +0.1    3%  +0.1
    progress30d0.1   0      1%  +0.1    0%  -0.0    0%  -0.3   17%  -0.0   14%  -0.0    7%  +0.1
    progress25d0.05  0      0%  -0.1    1%  -0.4    0%  -0.4   14%  +0.1   13%  -0.0   11%  -0.0
    best20           0      0%  -0.4    1%  -0.2    0%  +0.0    0%  +0.0    0%  +0.0    0%  +0.0
    progress20d0.05  0      0%  -0.4    3%  +0.6    2%  -0.3   23%  -0.1   21%  +0.1   24%  -0.7
    best10           0      8%  -1.8   17%  -2.6   12%  -2.3    2%  -0.6    1%  -1.0    5%  -3.5
    paper3           0     25%  -4.6   36%  -8.4   38%  -9.1    8%  -2.6    1%  -0.4   15%  -6.4
    paper1           0     90% -14.8   91% -15.2   94% -16.4   69% -26.0   84% -57.3   93% -63.1

Longer horizon, mnist1d, 150 rounds (seeds 1-3, `--rounds 150 --datasets mnist1d --rules
progress`, bench/results/early_stopping_150.json; 9 baselines and 9 runs, about 13 minutes):

    rule        dataset  strategy   cut %               change, points            met
    progress    mnist1d  fedspu     57 (57..57)         -5.02 (-6.44..-3.31)      no
    progress    mnist1d  fedavg-ft  53 (52..55)         -6.12 (-8.96..-2.19)      no
    progress    mnist1d  dadpfl     62 (60..63)         -10.58 (-12.85..-7.22)    no

Every agent stopped, and the replay found no candidate within a point that cut 25% (the
closest: progress30d0.05, cut 10-24% at -0.3 to -2.9). The fleet is still learning at round
150: the baselines' mean accuracy (5-round mean) rose from round 105 to 150 by 2.1-3.1
(fedspu), 3.2-3.6 (fedavg-ft) and 3.5-5.5 points (dadpfl), and stopping every agent at round
113 (a 25% cut) costs 3.13 (0.71..4.39), 2.81 (1.97..4.30) and 2.76 (0.03..5.42) points. So
mnist1d has no 25% to cut at <= 1 point within 150 rounds either; and there `progress` stops
too soon: mnist1d's slow tail lowers L by less than a tenth of its early fall per 20 rounds
yet adds several points.

At 300 rounds (seeds 1-3: `--rounds 300 --seeds 1,2,3 --datasets mnist1d --rules progress`,
bench/results/early_stopping_300.json; 9 baselines and 9 runs, about 16 minutes):

    rule        dataset  strategy   cut %               change, points            met
    progress    mnist1d  fedspu     78 (78..79)         -8.72 (-10.79..-6.91)     no
    progress    mnist1d  fedavg-ft  77 (76..77)         -15.49 (-17.43..-12.60)   no
    progress    mnist1d  dadpfl     82 (81..82)         -13.15 (-14.79..-12.21)   no

Even at 300 rounds there is little to cut: the baselines' mean accuracy (5-round mean) rose
from round 200 to 300 by 0.7/3.8/2.0 (fedspu, seeds 1-3), 3.4/5.9/6.1 (fedavg-ft) and
0.3/0.7/2.7 points (dadpfl), and stopping every agent at round 225 (a 25% cut) changes it by
-0.69/+1.00/-3.55, -1.36/-4.26/-1.80 and +0.81/+0.78/-1.41 points: an oracle stopping the
whole fleet at once stays within a point in 4 of 9 runs. Yet `progress` stops every agent
between rounds 25 and 139, as at 150 rounds: on mnist1d an agent's own L stalls for 20
rounds and then falls again as the fleet's models improve. From an agent's stop to round
300 of the baseline, its best L still fell by a median 0.24-0.63 of what it had fallen
before the stop, and its accuracy rose by a median 3.2-15.2 points (per run). No replayed
candidate met the target (the closest, `paper` with patience 5: cut 7-10% at -1.9 to -3.1;
`best20`, no new best L in 20 rounds: 25-48% at -2.9 to -8.0): a rule on the agent's own L
cannot tell a stall from convergence here.

Claim "early stopping cuts 25-71% of the rounds while keeping accuracy" (FedSPU paper):

* With the paper's rule: NOT shown. It cuts 69-94% but costs 16-63 points: an agent's L
  rises by noise within a few rounds (validation splits of a few to a few dozen samples)
  while the fleet is still learning, and the agent keeps that early model. Patience 3
  (rises in a row) costs 0.4-21 points and cuts 1-44%.
* With `progress` (the default): shown for fedspu and fedavg-ft on digits (cut 30-34%,
  -0.27 and -0.45 points; every seed cut >= 25% at <= 0.62 points). NOT shown on mnist1d:
  the fleet is still learning at round 60 (stopping every agent at round 45, a 25% cut,
  costs 0.7-5.9 points, from the baselines), so the rule stops few agents (cut 5-7%); and
  there the run-to-run noise is above the 1-point bar: `progress25` runs that skipped 20-40
  of 1,200 agent-rounds changed the final mean accuracy by -3.3 to +1.1 points. At 150
  rounds it stops every agent, cuts 53-62% and costs 5-11 points: mnist1d is still learning
  there too (a 25% cut costs about 3 points even for an oracle stopping all at once). At
  300 rounds (3 seeds), where an oracle stopping all agents at round 225 stays within a
  point in 4 of 9 runs, it stops every agent by round 139 and costs 9-16 points: an
  agent's own L stalls for 20 rounds long before the fleet has converged.
* DA-DPFL with `progress`: shown on digits once a stopped neighbour is left out (below):
  cut 32% (28..36) at -0.97 points (-3.77..-0.07) over 10 seeds, against -1.34 while its
  last model stood in. Before that, the pruning restart had taken the loss from -1.80 to
  -1.18 points on seeds 1-3.

Stopped neighbours left out (`agent.learning.rounds.live`; seeds 1-10 on digits, 1-3 on
mnist1d, `--resume` onto the baselines above, bench/results/early_stopping_left_out.json;
fedspu and fedavg-ft are centralized, unchanged by it, and run for seeds 4-10 to check the
3-seed figures). A DA-DPFL agent that stopped used to stand in with its last model in every
later aggregate of its neighbours; the agents that trained on lost more than the stopped
ones (digits, 10 seeds: -1.66 against -1.34), as if the stale models pulled them back. Left
out, as if the stopped agent had left:

    rule      dataset  strategy   seeds  cut %          change, points          met
    progress  digits   fedspu     1-10   33 (27..36)    -0.23 (-0.90..+0.49)    yes
    progress  digits   fedavg-ft  1-10   30 (23..35)    -0.21 (-0.99..+0.54)    yes
    progress  digits   dadpfl     1-10   32 (28..36)    -0.97 (-3.77..-0.07)    yes
      (its last model standing in:       33 (29..37)    -1.34 (-3.51..+0.24)    no)
    progress  mnist1d  dadpfl     1-3    4 (3..4)       -0.64 (-0.72..-0.53)    no
      (its last model standing in:       5 (5..6)       -2.67 (-3.35..-1.80)    no)

On digits the agents that trained on now lose 0.30 points (-1.76..+0.36; 1.66 before), the
stopped ones 1.03. DA-DPFL's per-seed spread is wide (seed 8: -3.77 left out, -3.51 standing
in; sd 1.10 over the 10 seeds), so its mean is within a point by a small margin.

Chosen default: `progress`, window 20, delta 0.1 (progress20d0.1 above;
agent/learning/early_stop.py): the replay's best, and of the real runs the only rule that
met the target (fedspu and fedavg-ft on digits) while costing no more than about a point
where it stopped little (mnist1d fedspu, fedavg-ft); with stopped neighbours left out it
meets it for DA-DPFL on digits too (10 seeds). The paper's 25-71% came from T = 500
rounds, long after convergence; here only a converged task (digits at 60 rounds) leaves
rounds to save. On mnist1d the rule takes an agent's temporary stall for a plateau, at 60,
150 and 300 rounds alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from agent.learning import EarlyStop, StopWatch  # noqa: E402
from bench.support import environment, write_json  # noqa: E402

if TYPE_CHECKING:
    from agent.learning import Learner, LocalData, State

STRATEGIES = ("fedspu", "fedavg-ft", "dadpfl")
RUNS: dict[str, dict[str, Any]] = {
    "paper": {"stop_rule": "paper"},
    "paper3": {"stop_rule": "paper", "stop_patience": 3},
    "progress": {},
    "progress25": {"stop_patience": 25},
}
"""The real early-stopping runs: the paper's rule as printed, with patience 3, the default,
and the default with a longer window (the more cautious runner-up of the replay)."""
CANDIDATES = {
    **{f"paper{p}": ("paper", p, 0.0) for p in (1, 2, 3, 5)},
    **{f"best{p}": ("progress", p, 0.0) for p in (5, 10, 15, 20)},
    **{
        f"progress{w}d{d}": ("progress", w, d)
        for w in (10, 15, 20, 25, 30)
        for d in (0.05, 0.1, 0.2)
    },
}
"""Rules replayed offline: (rule, patience, delta); best = progress with delta 0."""
MAX_ACCURACY_LOSS = 1.0
MIN_ROUNDS_CUT = 0.25


@dataclasses.dataclass
class Recorder(EarlyStop):
    """Early stopping that never stops and records every L (the baseline runs)."""

    losses: list[float] = dataclasses.field(default_factory=list)
    pruned: list[bool] = dataclasses.field(default_factory=list)

    def after(
        self,
        learner: Learner,
        weights: State,
        train_loss: float,
        data: LocalData,
        restart: bool = False,
    ) -> bool:
        self.losses.append(learner.stopping_loss(weights, train_loss, data))
        self.pruned.append(restart)
        return False


def simulate_one(
    strategy: str, dataset: str, seed: int, args: Any, over: dict[str, Any] | None
) -> dict:
    """One simulation; with `over` None, the baseline that records each agent's L."""
    from agent.experiment import ExperimentConfig
    from agent.learning import preset
    from coordinator.simulate import Simulation

    learning = preset(strategy, rounds=args.rounds, epochs=args.epochs, neighbours=5)
    if over is not None:
        learning = dataclasses.replace(learning, early_stop=True, **over)
    config = ExperimentConfig(
        dataset=dataset, agents=args.agents, partition="dirichlet:0.3", seed=seed, threads=1
    )
    sim = Simulation(dataclasses.replace(config, learning=learning))
    recorders = {k: Recorder(False, sim.early_stops[k].rule) for k in sim.roster}
    if over is None:
        sim.early_stops.update(recorders)
    started = time.perf_counter()
    report = sim.run()
    rounds = report["rounds"]
    out = {
        "accuracy": report["summary"]["mean_accuracy"],
        "agent_rounds": sum(1 for r in rounds for a in r["agents"].values() if a["train_flops"]),
        "rounds": len(rounds),
        "seconds": time.perf_counter() - started,
        "final": {k: rounds[-1]["agents"][k]["accuracy"] for k in sim.roster},
        "stopped": dict(sim.stopped),
    }
    if over is None:
        out["losses"] = {k: r.losses for k, r in recorders.items()}
        out["pruned"] = {k: r.pruned for k, r in recorders.items()}
        out["agent_accuracy"] = {
            k: [r["agents"][k]["accuracy"] for r in rounds] for k in sim.roster
        }
    return out


def replay(base: dict, rule: str, patience: int, delta: float) -> tuple[float, float]:
    """(cut, accuracy change in points) of a rule replayed on a baseline's L sequences."""
    trained, accuracy = 0, 0.0
    for k, losses in base["losses"].items():
        watch, stop = StopWatch(), len(losses)
        pruned = base.get("pruned", {}).get(k, [False] * len(losses))
        for t, loss in enumerate(losses, start=1):
            watch, stops = watch.after(loss, patience, rule, delta, pruned[t - 1])
            if stops:
                stop = t
                break
        trained += stop
        accuracy += base["agent_accuracy"][k][stop - 1]
    n = len(base["losses"])
    return 1 - trained / base["agent_rounds"], (accuracy / n - base["accuracy"]) * 100


def spread(values: list[float], fmt: str) -> str:
    """Mean (min..max), each formatted with `fmt`."""
    low, high = format(min(values), fmt), format(max(values), fmt)
    return f"{format(statistics.mean(values), fmt)} ({low}..{high})"


def cells(args: Any) -> list[tuple[str, str]]:
    return [(d, s) for d in args.datasets for s in args.strategies]


def shortlist(bases: dict, args: Any) -> list[dict]:
    """Every candidate replayed on every baseline: per cell the mean cut and change."""
    out = []
    for name, (rule, patience, delta) in CANDIDATES.items():
        per_cell = {}
        for d, s in cells(args):
            got = [replay(bases[(d, s, seed)], rule, patience, delta) for seed in args.seeds]
            per_cell[f"{d}/{s}"] = (
                statistics.mean(g[0] for g in got),
                statistics.mean(g[1] for g in got),
            )
        met = sum(c >= MIN_ROUNDS_CUT and -a <= MAX_ACCURACY_LOSS for c, a in per_cell.values())
        out.append({"candidate": name, "cells": per_cell, "met": met})
    return sorted(out, key=lambda r: (-r["met"], -min(a for _, a in r["cells"].values())))


def measured(bases: dict, runs: dict, args: Any) -> list[dict]:
    """Per rule and cell: cut and change over the seeds, against the same seed's baseline."""
    rows = []
    for rule in dict.fromkeys([*RUNS, *(k[0] for k in runs)]):  # RUNS first, then older ones
        for d, s in cells(args):
            keys = [(d, s, seed) for seed in args.seeds if (rule, d, s, seed) in runs]
            if not keys:
                continue
            cut = [1 - runs[(rule, *k)]["agent_rounds"] / bases[k]["agent_rounds"] for k in keys]
            change = [(runs[(rule, *k)]["accuracy"] - bases[k]["accuracy"]) * 100 for k in keys]
            met = statistics.mean(cut) >= MIN_ROUNDS_CUT and -statistics.mean(change) <= 1
            rows.append(
                {
                    "rule": rule,
                    "dataset": d,
                    "strategy": s,
                    "cut": cut,
                    "change": change,
                    "seeds": [k[2] for k in keys],
                    "met": met,
                }
            )
    return rows


def split_change(base: dict, run: dict) -> tuple[float | None, float | None]:
    """Final accuracy change in points of the agents that trained to the end, and of those
    that stopped (None for an empty group), each against the same agents in the baseline:
    the first is what stopped neighbours cost the others (and run-to-run noise)."""
    final = {k: accuracy[-1] for k, accuracy in base["agent_accuracy"].items()}
    groups: dict[bool, list[float]] = {True: [], False: []}
    for k, accuracy in run["final"].items():
        groups[k in run["stopped"]].append((accuracy - final[k]) * 100)
    on, stopped = (statistics.mean(groups[g]) if groups[g] else None for g in (False, True))
    return on, stopped


def bystanders(bases: dict, runs: dict, args: Any) -> list[dict]:
    """Per rule and cell (runs that record each agent): `split_change` over the seeds."""
    rows = []
    for rule in RUNS:
        for d, s in cells(args):
            keys = [
                (d, s, seed) for seed in args.seeds if "final" in runs.get((rule, d, s, seed), {})
            ]
            if not keys:
                continue
            split = [split_change(bases[k], runs[(rule, *k)]) for k in keys]
            rows.append(
                {
                    "rule": rule,
                    "dataset": d,
                    "strategy": s,
                    "stopped_agents": [len(runs[(rule, *k)]["stopped"]) for k in keys],
                    "others_change": [o for o, _ in split if o is not None],
                    "stopped_change": [x for _, x in split if x is not None],
                }
            )
    return rows


def print_bystanders(console: Console, rows: list[dict]) -> None:
    table = Table(title="final accuracy change (points): agents that trained on vs stopped")
    for column in ("rule", "dataset", "strategy", "agents stopped", "trained on", "stopped"):
        table.add_column(column)
    for r in rows:
        table.add_row(
            r["rule"],
            r["dataset"],
            r["strategy"],
            spread(r["stopped_agents"], ".0f"),
            spread(r["others_change"], "+.2f") if r["others_change"] else "-",
            spread(r["stopped_change"], "+.2f") if r["stopped_change"] else "-",
        )
    console.print(table)


def print_tables(console: Console, rows: list[dict], short: list[dict]) -> None:
    table = Table(title="early stopping: agent-rounds cut and accuracy change (points)")
    for column in ("rule", "dataset", "strategy", "cut", "change", "target met"):
        table.add_column(column)
    for r in rows:
        table.add_row(
            r["rule"],
            r["dataset"],
            r["strategy"],
            spread(r["cut"], ".0%"),
            spread(r["change"], "+.2f"),
            "yes" if r["met"] else "no",
        )
    console.print(table)
    cands = Table(title="offline replay (mean over seeds per cell: cut / change)")
    cands.add_column("candidate")
    cands.add_column("cells met")
    for cell in short[0]["cells"] if short else []:
        cands.add_column(cell)
    for r in short[:12]:
        cands.add_row(
            r["candidate"],
            str(r["met"]),
            *(f"{c:.0%} / {a:+.1f}" for c, a in r["cells"].values()),
        )
    console.print(cands)


def resumed(args: Any) -> tuple[dict, dict]:
    """The baselines and runs of an earlier result file with the same settings."""
    import json

    saved = json.loads(args.out.read_text())
    same = all(saved["args"].get(k) == getattr(args, k) for k in ("agents", "rounds", "epochs"))
    if not same:
        return {}, {}
    bases = {(b.pop("dataset"), b.pop("strategy"), b.pop("seed")): b for b in saved["baselines"]}
    runs = {
        (r.pop("rule"), r.pop("dataset"), r.pop("strategy"), r.pop("seed")): r
        for r in saved["runs"]
    }
    return bases, runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--datasets", default="mnist1d,digits")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--agents", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--rules", default=",".join(RUNS), help="the RUNS to run for real")
    parser.add_argument(
        "--out", type=pathlib.Path, default=ROOT / "bench/results/early_stopping.json"
    )
    parser.add_argument(
        "--resume", action="store_true", help="keep the runs already in --out, run the rest"
    )
    args = parser.parse_args(argv)
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    args.datasets = [d for d in args.datasets.split(",") if d]
    args.strategies = [s for s in args.strategies.split(",") if s]
    args.rules = [r for r in args.rules.split(",") if r in RUNS]
    console = Console(width=None if sys.stdout.isatty() else 160)
    started = time.perf_counter()
    bases, runs = resumed(args) if args.resume and args.out.exists() else ({}, {})

    def save() -> tuple[list[dict], list[dict]]:
        short = shortlist(bases, args) if len(bases) == len(cells(args)) * len(args.seeds) else []
        rows = measured(bases, runs, args)
        write_json(
            args.out,
            {
                "args": {k: v for k, v in vars(args).items() if k != "out"},
                "wall_seconds": time.perf_counter() - started,
                "baselines": [
                    {"dataset": k[0], "strategy": k[1], "seed": k[2], **v} for k, v in bases.items()
                ],
                "runs": [
                    {"rule": k[0], "dataset": k[1], "strategy": k[2], "seed": k[3], **v}
                    for k, v in runs.items()
                ],
                "table": rows,
                "bystanders": bystanders(bases, runs, args),
                "shortlist": short,
                "machine": environment(),
            },
        )
        return rows, short

    for seed in args.seeds:
        for d, s in cells(args):
            if (d, s, seed) in bases:
                continue
            bases[(d, s, seed)] = simulate_one(s, d, seed, args, None)
            console.log(f"baseline {d} {s} seed {seed}: {bases[(d, s, seed)]['accuracy']:.4f}")
            save()
    for seed in args.seeds:
        for d, s in cells(args):
            for rule in args.rules:
                if (rule, d, s, seed) in runs:
                    continue
                runs[(rule, d, s, seed)] = simulate_one(s, d, seed, args, RUNS[rule])
                console.log(
                    f"{rule} {d} {s} seed {seed}: {runs[(rule, d, s, seed)]['accuracy']:.4f}"
                )
                save()
    rows, short = save()
    print_tables(console, rows, short)
    print_bystanders(console, bystanders(bases, runs, args))
    console.print(f"wall time {time.perf_counter() - started:.0f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
