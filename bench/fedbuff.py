"""FedBuff against FedAvg on a mixed-speed fleet, in simulate's virtual seconds.

    python -m bench.fedbuff [--datasets digits,mnist1d] [--agents 12] [--rounds 10]
        [--seeds 1,2,3] [--pair fedavg,fedbuff] [--epochs 1] [--out bench/results/fedbuff.json]
    python -m bench.fedbuff --secure [--emulate VERSIONS] [--broker embedded] ...

`--pair fedadam-ssm,fedbuff-ssm` measures FedBuff-SSM against synchronous FedAdam-SSM the
same way (give the FedAdam family its ~30 local steps: 12 devices on digits hold about one
batch each, so `--epochs 30`).

`--secure` measures FedBuff under secure aggregation (cohorts of K devices, each version one
secure sum: `agent.learning.central.secure_buffer`) against plain FedBuff instead, both with
the versions that make twice FedAvg's updates, on the same fleet: each one's final accuracy,
the secure run's virtual seconds to the plain run's final accuracy against the plain run's,
bytes a device sent per update the versions took (keys, shares, masked vector, signature and
reveal against one upload) and the mean staleness. `--emulate N` adds, for the first seed,
one emulated run of each with N versions over an embedded broker (`--broker`): seconds per
version after the first (the round logs), the wall seconds after version 1 until the fleet
first reached the plain run's final accuracy, bytes per update, final accuracy, and the
load average once it ended.

The fleet is every bundled board in turn (`--profiles mixed`: from a Raspberry Pi 4 to an x86
laptop), always online. FedAvg runs `--rounds` synchronous rounds; a round lasts as long as
its slowest participant's modelled seconds (`VirtualClock.seconds` of its FLOPs and bytes),
so its run takes the sum of those. FedBuff (default K: a third of the fleet) runs as many
versions as make twice FedAvg's updates (2 x rounds x agents / K) on the event-driven virtual
clock (`coordinator.buffered_sim`). Measured per seed: FedAvg's final mean accuracy and
virtual seconds; FedBuff's mean accuracy (each agent's latest update judged on its data: a
measure that lags the newest version) at the first version out once FedAvg's run would have
ended (or at its end, if it ended before), its virtual seconds until that accuracy first
reaches FedAvg's final one, and its final accuracy. The table gives the mean and the spread
(min-max) over seeds.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from agent.experiment import ExperimentConfig, agent_profiles
from agent.learning import preset
from agent.learning.buffering import buffer_size
from bench.support import environment, seeds, write_json
from coordinator.simulate import simulate
from coordinator.virtual_clock import VirtualClock

ROOT = pathlib.Path(__file__).resolve().parents[1]


def config(
    dataset: str,
    agents: int,
    seed: int,
    strategy: str,
    rounds: int,
    epochs: int,
    secure: bool = False,
) -> ExperimentConfig:
    return ExperimentConfig(
        dataset=dataset,
        agents=agents,
        seed=seed,
        partition="dirichlet:0.5",
        profiles="mixed",
        learning=preset(strategy, rounds=rounds, epochs=epochs, secure_aggregation=secure),
    )


def mean_accuracy(record: dict[str, Any]) -> float:
    agents = record["agents"].values()
    return statistics.fmean(a["accuracy"] for a in agents)


def synchronous(run: Run, seed: int) -> dict[str, float]:
    """The synchronous strategy's (FedAvg's) final accuracy and its virtual seconds: each
    round its slowest board's."""
    cfg = config(run.dataset, run.agents, seed, run.sync, run.rounds, run.epochs)
    report = simulate(cfg)
    clock = VirtualClock(agent_profiles(cfg, report["config"]["roster"]))
    seconds = sum(
        max(
            clock.seconds(k, a["train_flops"], a["bytes_sent"] + a["bytes_received"])
            for k, a in record["agents"].items()
        )
        for record in report["rounds"]
    )
    return {"accuracy": mean_accuracy(report["rounds"][-1]), "seconds": seconds}


def buffered(run: Run, seed: int, target: float, seconds: float) -> dict[str, Any]:
    """The buffered strategy (FedBuff) with twice the updates: accuracy at the synchronous
    run's `seconds`, seconds to `target` (its final accuracy), final accuracy."""
    versions = 2 * run.rounds * run.agents // buffer_size(0, run.agents)
    cfg = config(run.dataset, run.agents, seed, run.buffered, versions, run.epochs)
    report = simulate(cfg)
    records = report["rounds"]
    reached = next((r["finished_at"] for r in records if mean_accuracy(r) >= target), None)
    at_sync = next((r for r in records if r["finished_at"] >= seconds), records[-1])
    stale = [e["staleness"] for r in records for e in r["applied"]]
    return {
        "versions": versions,
        "accuracy": mean_accuracy(records[-1]),
        "accuracy_at_fedavg_seconds": mean_accuracy(at_sync),
        "seconds": records[-1]["finished_at"],
        "seconds_to_target": reached,
        "mean_staleness": statistics.fmean(stale),
    }


@dataclass(frozen=True)
class Run:
    """One dataset's comparison: the synchronous and buffered strategies and their sizes."""

    dataset: str
    agents: int
    rounds: int
    epochs: int
    sync: str
    buffered: str


def spread(values: list[float]) -> str:
    return f"{statistics.fmean(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def table(rows: list[dict[str, Any]], args: argparse.Namespace, sync: str, buf: str) -> Table:
    """The comparison per dataset: mean and min-max over seeds."""
    out = Table(title=f"{buf} vs {sync}, {args.agents} mixed boards (mean, min-max)")
    for column in (
        "dataset",
        f"{sync} acc",
        f"{sync} s",
        f"{buf} acc at {sync} s (or at its end)",
        f"{buf} s (2x updates)",
        f"{buf} s to {sync} acc / {sync} s",
        f"{buf} final acc (2x updates)",
        "staleness",
    ):
        out.add_column(column)
    for dataset in args.datasets.split(","):
        mine = [r for r in rows if r["dataset"] == dataset]
        reached = [r for r in mine if r[buf]["seconds_to_target"] is not None]
        ratios = [r[buf]["seconds_to_target"] / r[sync]["seconds"] for r in reached]
        out.add_row(
            dataset,
            spread([r[sync]["accuracy"] for r in mine]),
            spread([r[sync]["seconds"] for r in mine]),
            spread([r[buf]["accuracy_at_fedavg_seconds"] for r in mine]),
            spread([r[buf]["seconds"] for r in mine]),
            f"{spread(ratios)}, {len(reached)}/{len(mine)} reached" if ratios else "never",
            spread([r[buf]["accuracy"] for r in mine]),
            spread([r[buf]["mean_staleness"] for r in mine]),
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", default="digits,mnist1d")
    parser.add_argument("--agents", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--pair", default="fedavg,fedbuff", help="SYNCHRONOUS,BUFFERED")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--out", type=pathlib.Path, default=None)
    parser.add_argument("--secure", action="store_true", help="secure against plain fedbuff")
    parser.add_argument("--emulate", type=int, default=0, help="--secure: VERSIONS emulated")
    parser.add_argument("--broker", default="embedded", help="embedded, mosquitto or HOST:PORT")
    args = parser.parse_args()
    name = "fedbuff-secure.json" if args.secure else "fedbuff.json"
    args.out = args.out or ROOT / "bench/results" / name
    if args.secure:
        from bench.fedbuff_secure import compare  # it imports this module

        compare(args)
        return
    sync_name, buffered_name = args.pair.split(",")
    rows = []
    for dataset in args.datasets.split(","):
        run = Run(dataset, args.agents, args.rounds, args.epochs, sync_name, buffered_name)
        for seed in seeds(args.seeds):
            sync = synchronous(run, seed)
            measured = buffered(run, seed, sync["accuracy"], sync["seconds"])
            rows.append(
                {"dataset": dataset, "seed": seed, sync_name: sync, buffered_name: measured}
            )
    Console(width=200).print(table(rows, args, sync_name, buffered_name))
    write_json(
        args.out,
        {"environment": environment(), "args": vars(args) | {"out": str(args.out)}, "rows": rows},
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
