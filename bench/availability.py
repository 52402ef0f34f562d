"""Simulate against emulate on a duty-cycled fleet (issue 49 point 3): the same run, a share
of its devices asleep most of the time, in one process on the virtual clock and as real
agent processes over MQTT.

    python -m bench.availability [--agents 6] [--rounds 8] [--seeds 1,2,3]
        [--strategies dadpfl,fedavg] [--availability 0.3:0.33:6] [--dataset digits]
        [--out bench/results/availability.json]

Every bundled board in turn (`--profiles mixed`). Figures per run:

* learning: the largest difference of any agent's accuracy in any round between the two
  (a synchronous run's numbers do not depend on time: 0 unless an agent straggled in
  emulate, which simulate does not model);
* timing: the run's length after its first round, from the end of round 1 (its last agent)
  to the end of the last round: simulate's virtual seconds (`finished_at`, the virtual clock)
  against emulate's wall seconds (the agents' round logs). Round 1 is left out: emulate's
  agents start the pattern's clock each at its own first round, after process start-up.
  Emulate's host time (training on this machine, messages, waits) adds to the modelled time
  (its figure per round: emulate's seconds less simulate's, over the rounds after the
  first); simulate leaves out round timeouts (none expires here) and aggregation time. The
  period is short, so that the sleepers' rounds run into their sleep: digits' rounds take
  hundredths of a second on the boards, and a fleet whose rounds all fit one awake span
  measures only the host's time.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import tempfile
from typing import Any

from rich.console import Console
from rich.table import Table

from agent.experiment import ExperimentConfig, agent_availability
from agent.learning import preset
from bench.support import broker, environment, fleet_round_ends, seeds, write_json
from coordinator.emulate import Emulation, EmulationOptions
from coordinator.simulate import simulate

ROOT = pathlib.Path(__file__).resolve().parents[1]


def config_of(args: argparse.Namespace, strategy: str, seed: int) -> ExperimentConfig:
    neighbours = {"neighbours": 2} if strategy != "fedavg" else {}
    return ExperimentConfig(
        dataset=args.dataset,
        agents=args.agents,
        partition="dirichlet:0.5",
        seed=seed,
        profiles="mixed",
        availability=args.availability,
        learning=preset(strategy, rounds=args.rounds, epochs=1, **neighbours),
    )


def accuracies(report: dict[str, Any]) -> dict[tuple[int, str], float]:
    return {
        (r["round"], agent): entry["accuracy"]
        for r in report["rounds"]
        for agent, entry in r["agents"].items()
    }


def after_round_1(ends: dict[int, float]) -> float:
    """Seconds from the end of round 1 to the end of the last round."""
    return ends[max(ends)] - ends[1]


def one_run(config: ExperimentConfig, workdir: pathlib.Path) -> dict[str, Any]:
    simulated = simulate(config)
    virtual: dict[int, float] = {}
    for record in simulated["rounds"]:
        virtual[record["round"]] = max(a["finished_at"] for a in record["agents"].values())
    with broker("embedded", workdir) as address:
        emulation = Emulation(config, address, EmulationOptions(workdir=workdir / "fleet"))
        emulated = emulation.run()
    wall = fleet_round_ends(workdir / "fleet", emulation.roster)
    got, want = accuracies(emulated), accuracies(simulated)
    return {
        "sleepers": sorted(agent_availability(config, emulation.roster)),
        "accuracy_max_diff": max(abs(got[key] - want[key]) for key in want),
        "stragglers": emulated["summary"]["stragglers"],
        "simulate_virtual_s": after_round_1(virtual),
        "emulate_wall_s": after_round_1(wall),
        "simulate_virtual_whole_s": simulated["summary"]["virtual_s"],
        "host_s_per_round": (after_round_1(wall) - after_round_1(virtual)) / (max(wall) - 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seeds", type=seeds, default=[1, 2, 3])
    parser.add_argument("--strategies", default="dadpfl,fedavg")
    parser.add_argument("--availability", default="0.3:0.33:6")
    parser.add_argument("--dataset", default="digits")
    parser.add_argument(
        "--out", type=pathlib.Path, default=ROOT / "bench/results/availability.json"
    )
    args = parser.parse_args()
    runs = []
    for strategy in args.strategies.split(","):
        for seed in args.seeds:
            with tempfile.TemporaryDirectory() as tmp:
                run = one_run(config_of(args, strategy, seed), pathlib.Path(tmp))
            runs.append({"strategy": strategy, "seed": seed, **run})
    show(runs)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    write_json(args.out, {"settings": settings, "environment": environment(), "runs": runs})


def show(runs: list[dict[str, Any]]) -> None:
    table = Table(title="simulate (virtual clock) against emulate, after round 1")
    for column in ("strategy", "seed", "sleepers", "max acc diff", "stragglers",
                   "simulate s", "emulate s", "emulate / simulate", "host s/round"):  # fmt: skip
        table.add_column(column)
    for run in runs:
        ratio = run["emulate_wall_s"] / run["simulate_virtual_s"]
        table.add_row(
            run["strategy"], str(run["seed"]), ", ".join(run["sleepers"]),
            f"{run['accuracy_max_diff']:.2g}", str(len(run["stragglers"])),
            f"{run['simulate_virtual_s']:.1f}", f"{run['emulate_wall_s']:.1f}", f"{ratio:.2f}",
            f"{run['host_s_per_round']:.2f}",
        )  # fmt: skip
    for strategy in sorted({run["strategy"] for run in runs}):
        mine = [run for run in runs if run["strategy"] == strategy]
        ratios = [run["emulate_wall_s"] / run["simulate_virtual_s"] for run in mine]
        host = [run["host_s_per_round"] for run in mine]
        table.add_row(strategy, "mean ± sd", "", "", "", "", "", spread(ratios), spread(host))
    Console(width=140).print(table)


def spread(values: list[float]) -> str:
    """Mean ± standard deviation over seeds."""
    deviation = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.2f} ± {deviation:.2f}"


if __name__ == "__main__":
    main()
