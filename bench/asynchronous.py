"""Synchronous against asynchronous rounds on a duty-cycled, mixed-speed fleet (issue 49
point 5): how much sooner in wall time an asynchronous fleet gets where the synchronous one
ends, and where the asynchronous one ends.

    python -m bench.asynchronous [--datasets digits,mnist1d] [--agents 12] [--rounds 20]
        [--factor 3] [--seeds 1,2,3] [--pairs dadpfl,fedavg] [--availability 0.3:0.33:0.1]
        [--no-emulate] [--quick] [--out bench/results/asynchronous.json]

The fleet: every bundled board in turn (`--profiles mixed`), 30% of the devices online a
third of every period (`--availability`). Each pair runs the same fleet, data and seed
synchronously and asynchronously in `simulate`, whose virtual clock (`coordinator
.virtual_clock`) gives the wall time a real fleet would take: DA-DPFL against DA-DPFL with
`--asynchronous`, FedAvg against FedBuff.

The period is chosen against the modelled round: on digits and mnist1d a board's round takes
from a thousandth of a second of virtual time (a laptop, a Jetson) to about a hundredth (a
Raspberry Pi 4), so in a 0.1 s period a sleeper is awake for about three of a Pi 4's rounds
and asleep for six. A synchronous round that needs a sleeper waits until it wakes; an
asynchronous fleet goes on, and the sleepers fall behind (their models come stale). A period
of seconds would hold a hundred rounds in one awake span: a sleeper would run all its rounds
in one go and the asynchronous fleet would hardly see it sleep.

Measures, the same for both sides, from the round records' `finished_at` (virtual seconds):
the fleet accuracy at a moment is the mean of every agent's latest kept model's accuracy
finished by then (`agent.time_to_target`). The target is the synchronous run's final fleet
accuracy; each side's time is when its fleet first reached it (the synchronous side's can
be before its end). Fairness: the asynchronous side gets `--factor` times the synchronous
side's local rounds (DA-DPFL: rounds; FedBuff: versions x K updates), since its rounds are
cheaper in wall time; its accuracy is given at the synchronous run's wall time (the same
wall-time budget: its end when it ended sooner), at the synchronous side's local rounds (the
same work) and at its own end. Per seed: the ratio of the times; the table gives
mean ± sd and min-max over seeds.

Simulate against emulate (`--no-emulate` leaves it out): a small asynchronous DA-DPFL run
(digits, `--emulate-agents`, a period of seconds as `bench.availability`'s, since emulate's
rounds take host time) in simulate and as real agent processes over the embedded broker:
the accuracies per round and agent, the final fleet accuracy, the mean staleness and the
seconds after round 1. Where they cannot agree: docs/asynchronous.md, "Measured".
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from agent.experiment import ExperimentConfig
from agent.learning import preset
from agent.time_to_target import reached_at
from bench.support import environment, seeds, write_json
from coordinator.simulate import simulate

ROOT = pathlib.Path(__file__).resolve().parents[1]

PAIRS: dict[str, tuple[str, dict[str, Any], str, dict[str, Any]]] = {
    "dadpfl": ("dadpfl", {"neighbours": 2}, "dadpfl", {"neighbours": 2, "asynchronous": True}),
    "fedavg": ("fedavg", {}, "fedbuff", {}),
}
"""Pair -> (synchronous strategy, its options, asynchronous strategy, its options)."""


def config(
    args: argparse.Namespace, dataset: str, seed: int, strategy: str, options: dict[str, Any]
) -> ExperimentConfig:
    """The fleet every run of the bench shares; `options` of the strategy's preset."""
    rounds = options.pop("rounds", args.rounds)
    return ExperimentConfig(
        dataset=dataset,
        agents=args.agents,
        partition="dirichlet:0.5",
        seed=seed,
        profiles="mixed",
        availability=args.availability,
        learning=preset(strategy, rounds=rounds, epochs=1, **options),
    )


def asynchronous_rounds(pair: str, args: argparse.Namespace) -> int:
    """The asynchronous side's rounds: `--factor` times the synchronous side's local rounds
    (FedBuff: versions of K updates each)."""
    if pair != "fedavg":
        return args.factor * args.rounds
    from agent.learning.buffering import buffer_size

    return args.factor * args.rounds * args.agents // buffer_size(0, args.agents)


def events(rounds: Sequence[Mapping[str, Any]]) -> list[tuple[float, str, float]]:
    """(finished_at, agent, accuracy) of every record, in time order; one without a time
    (a FedBuff device that has delivered nothing yet) at the start, as `agent.time_to_target`
    counts it."""
    return sorted(
        (a.get("finished_at") or 0.0, agent, a["accuracy"])
        for r in rounds
        for agent, a in r["agents"].items()
    )


def fleet_accuracy_at(rounds: Sequence[Mapping[str, Any]], at: float | None = None) -> float:
    """The mean of every agent's latest accuracy finished by `at` (None: the run's end)."""
    latest: dict[str, float] = {}
    for finished, agent, accuracy in events(rounds):
        if at is None or finished <= at:
            latest[agent] = accuracy
    return statistics.fmean(latest.values())


def measures(report: dict[str, Any], target: float | None = None) -> dict[str, Any]:
    """A run's final accuracy, wall (virtual) seconds, time to `target` (None: its own final
    accuracy) and mean staleness of what it aggregated."""
    rounds = report["rounds"]
    final = fleet_accuracy_at(rounds)
    reached = reached_at(rounds, final if target is None else target)
    stale = [
        a["staleness"]
        for r in rounds
        for a in r["agents"].values()
        if a.get("staleness") is not None
    ]
    stale += [e["staleness"] for r in rounds for e in r.get("applied", [])]
    return {
        "rounds": len(rounds),
        "accuracy": final,
        "seconds": max(f for f, _, _ in events(rounds)),
        "seconds_to_target": None if reached is None else reached[0],
        "mean_staleness": statistics.fmean(stale) if stale else None,
    }


def one_pair(args: argparse.Namespace, pair: str, dataset: str, seed: int) -> dict[str, Any]:
    """The synchronous and the asynchronous run of `pair` on one dataset and seed."""
    sync_name, sync_options, async_name, async_options = PAIRS[pair]
    sync_report = simulate(config(args, dataset, seed, sync_name, dict(sync_options)))
    sync = measures(sync_report)
    rounds = asynchronous_rounds(pair, args)
    async_report = simulate(
        config(args, dataset, seed, async_name, {**async_options, "rounds": rounds})
    )
    asyn = measures(async_report, target=sync["accuracy"])
    asyn["accuracy_at_sync_seconds"] = fleet_accuracy_at(async_report["rounds"], sync["seconds"])
    same_work = async_report["rounds"][rounds // args.factor - 1]
    asyn["accuracy_at_sync_rounds"] = statistics.fmean(
        a["accuracy"] for a in same_work["agents"].values()
    )
    reached = asyn["seconds_to_target"]
    return {
        "pair": pair,
        "dataset": dataset,
        "seed": seed,
        "synchronous": {"strategy": sync_name, **sync},
        "asynchronous": {"strategy": async_name, **asyn},
        "time_ratio": None if reached is None else reached / sync["seconds_to_target"],
        "accuracy_gap_points": 100 * (asyn["accuracy_at_sync_seconds"] - sync["accuracy"]),
    }


def emulated(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """Asynchronous DA-DPFL on a small duty-cycled fleet in simulate and as real agent
    processes over the embedded broker: accuracies, staleness, and the seconds from the end
    of round 1 to the end of the run (virtual against wall; round 1 left out as in
    `bench.availability`: emulate's agents start their pattern's clock after start-up)."""
    from agent.experiment import agent_availability
    from bench.support import broker, fleet_round_ends
    from coordinator.emulate import Emulation, EmulationOptions

    small = argparse.Namespace(**{**vars(args), "agents": args.emulate_agents,
                                  "availability": args.emulate_availability})  # fmt: skip
    options = {"neighbours": 2, "asynchronous": True, "rounds": args.emulate_rounds}
    cfg = config(small, "digits", seed, "dadpfl", options)
    simulated = simulate(cfg)
    with tempfile.TemporaryDirectory() as tmp, broker("embedded", pathlib.Path(tmp)) as address:
        emulation = Emulation(cfg, address, EmulationOptions(workdir=pathlib.Path(tmp) / "fleet"))
        real = emulation.run()
        wall = fleet_round_ends(pathlib.Path(tmp) / "fleet", emulation.roster)
    virtual = {
        r["round"]: max(a["finished_at"] for a in r["agents"].values()) for r in simulated["rounds"]
    }
    got, want = by_round_and_agent(real), by_round_and_agent(simulated)
    return {
        "seed": seed,
        "sleepers": sorted(agent_availability(cfg, emulation.roster)),
        "accuracy_max_diff": max(abs(got[key] - want[key]) for key in want),
        "simulate": measures(simulated),
        "emulate": {k: v for k, v in measures(real).items() if "seconds" not in k},
        "stragglers": real["summary"].get("stragglers"),
        "simulate_virtual_s": virtual[max(virtual)] - virtual[1],
        "emulate_wall_s": wall[max(wall)] - wall[1],
    }


def by_round_and_agent(report: dict[str, Any]) -> dict[tuple[int, str], float]:
    """(round, agent) -> the accuracy of its kept model."""
    return {
        (r["round"], k): a["accuracy"] for r in report["rounds"] for k, a in r["agents"].items()
    }


def spread(values: Sequence[float], digits: int = 3) -> str:
    """Mean ± sd (min-max) over seeds."""
    if not values:
        return "-"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    mean = statistics.fmean(values)
    return (
        f"{mean:.{digits}f} ± {sd:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"
    )


def show(rows: list[dict[str, Any]], emulations: list[dict[str, Any]]) -> None:
    """The bench's tables: per pair and dataset over seeds, and simulate against emulate."""
    table = Table(title="synchronous against asynchronous, virtual seconds (mean ± sd, min-max)")
    for column in ("pair", "dataset", "sync final acc", "sync s to it", "async s to it",
                   "async / sync s [per seed]", "async acc at sync s", "async acc at sync rounds",
                   "async final acc", "async staleness"):  # fmt: skip
        table.add_column(column)
    for pair, dataset in dict.fromkeys((r["pair"], r["dataset"]) for r in rows):
        mine = [r for r in rows if (r["pair"], r["dataset"]) == (pair, dataset)]
        ratios = [r["time_ratio"] for r in mine if r["time_ratio"] is not None]
        sides = [(r["synchronous"], r["asynchronous"]) for r in mine]
        reached = [a["seconds_to_target"] for _, a in sides if a["seconds_to_target"] is not None]
        table.add_row(
            f"{sides[0][0]['strategy']} / {sides[0][1]['strategy']}", dataset,
            spread([s["accuracy"] for s, _ in sides]),
            spread([s["seconds_to_target"] for s, _ in sides], 2),
            spread(reached, 2),
            f"{spread(ratios, 2)} [{', '.join(f'{x:.2f}' for x in ratios)}] "
            f"{len(ratios)}/{len(mine)} reached",
            spread([a["accuracy_at_sync_seconds"] for _, a in sides]),
            spread([a["accuracy_at_sync_rounds"] for _, a in sides]),
            spread([a["accuracy"] for _, a in sides]),
            spread([a["mean_staleness"] or 0.0 for _, a in sides], 2),
        )  # fmt: skip
    Console(width=240).print(table)
    if emulations:
        show_emulations(emulations)


def show_emulations(emulations: list[dict[str, Any]]) -> None:
    table = Table(title="asynchronous DA-DPFL, simulate against emulate (mean ± sd, min-max)")
    table.add_column("figure")
    table.add_column("simulate")
    table.add_column("emulate")
    for name, key in (("final fleet accuracy", "accuracy"), ("mean staleness", "mean_staleness")):
        table.add_row(
            name,
            spread([e["simulate"][key] or 0.0 for e in emulations]),
            spread([e["emulate"][key] or 0.0 for e in emulations]),
        )
    table.add_row(
        "seconds after round 1 (virtual, wall)",
        spread([e["simulate_virtual_s"] for e in emulations], 2),
        spread([e["emulate_wall_s"] for e in emulations], 2),
    )
    diffs = [e["accuracy_max_diff"] for e in emulations]
    table.add_row("largest accuracy difference, any round and agent", spread(diffs), "")
    Console(width=240).print(table)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", default="digits,mnist1d")
    parser.add_argument("--agents", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=20, help="the synchronous side's")
    parser.add_argument("--factor", type=int, default=3, help="async rounds / sync rounds")
    parser.add_argument("--seeds", type=seeds, default=[1, 2, 3])
    parser.add_argument("--pairs", default="dadpfl,fedavg")
    parser.add_argument("--availability", default="0.3:0.33:0.1")
    parser.add_argument("--emulate-agents", type=int, default=4)
    parser.add_argument("--emulate-rounds", type=int, default=8)
    parser.add_argument("--emulate-availability", default="0.3:0.33:6")
    parser.add_argument("--no-emulate", action="store_true", help="simulate only")
    parser.add_argument("--quick", action="store_true", help="smoke: digits, 6 agents, seed 1")
    parser.add_argument(
        "--out", type=pathlib.Path, default=ROOT / "bench/results/asynchronous.json"
    )
    args = parser.parse_args()
    if args.quick:
        args.datasets, args.agents, args.rounds, args.seeds = "digits", 6, 4, [1]
        args.factor, args.no_emulate = 2, True
    return args


def main() -> None:
    args = parse()
    rows = [
        one_pair(args, pair, dataset, seed)
        for pair in args.pairs.split(",")
        for dataset in args.datasets.split(",")
        for seed in args.seeds
    ]
    emulations = [] if args.no_emulate else [emulated(args, seed) for seed in args.seeds]
    show(rows, emulations)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    write_json(
        args.out,
        {"settings": settings, "environment": environment(), "rows": rows,
         "emulate": emulations},
    )  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
