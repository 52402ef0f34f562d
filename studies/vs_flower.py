"""Flower's FedAvg against `coordinator simulate` and `coordinator emulate` on exactly our task.

    python -m studies.vs_flower [--agents 8] [--rounds 10] [--epochs 1] [--seed 1]
        [--main-rounds 10] [--main-epochs 5] [--skip-main] [--repeats 1]
        [--out bench/results/vs_flower.json]

Needs Flower's simulation engine (Ray), installed after the project: `pip install
'flwr[simulation]'` (1.41.0 here). pip cannot resolve it together with our amqtt pin (flwr
1.20-1.42 want typer < 0.21, amqtt 0.12.1 typer >= 0.24), so it is no extra of ours: pip
installs it with a warning, and the embedded broker (`amqtt.broker`, which never imports
typer) runs as before.

The task is ours in every run: mnist1d, Dirichlet 0.3 over the agents, seed 1, our model
(`build_workload`), our local SGD (`full_model_fit`, what our fedavg agents run, with the same
per-agent, per-round generator) and the same rounds and epochs. Flower only replaces the
orchestration and the aggregation: `flwr.simulation.run_simulation` (Ray, one CPU per client
actor, so two clients train at once on two cores), a ClientApp that trains on the partition
whose index is its `partition-id`, and Flower's own `flwr.serverapp.strategy.FedAvg`
(sample-weighted mean, every client every round). Its accuracy is measured as our fedavg
report measures it: the new global model on each agent's test split, the mean over agents,
in Flower's `evaluate_fn` (server side, so Flower runs no second round trip to evaluate).

Runs: Flower fedavg, simulate fedavg (one process, and `--workers 2`: `simulate/2`), emulate
fedavg (real agents over the embedded broker, `--agents-per-process` 4 by default, as the
README's main job: 0 is emulate's automatic rule, 2 x cores processes, so 2 to a process
for 8 agents on 2 cores), simulate dadpfl and emulate dadpfl (5 neighbours); then the
README's main job, `coordinator emulate --agents 8 --agents-per-process 4 --rounds 10`
(dadpfl, 5 epochs, the CLI's defaults), against Flower's whole run of the same rounds and epochs.

* s / round: steady rounds, (end of the last round - end of the first) / rounds between,
  and the median round (less moved by a burst of other work). A round ends when its last
  agent finished it (emulate: the agents' round logs), when the simulator's last participant
  finished training in it, when Flower's `evaluate_fn` returned for it. Start-up (Ray,
  processes, imports) lands in round 1, not here.
* CPU s: user + system seconds of this process and every process it started (Ray's
  processes and actors, the agent processes), sampled every 0.1 s: per steady round (the
  same window) and for the whole run. On a shared machine wall time says how the scheduler
  shared the cores; CPU seconds say what the work cost.
* whole run: from the call to its return, start-up and shutdown included (Ray's start and
  stop; emulate's agent processes and their ONNX export); start-up = end of round 1 - start
  - one steady round, after = return - end of the last round.
* bytes / round: every transfer counted once, at its receiver: ours, the report's
  `bytes_received` of every agent plus what the coordinator received (real encoded
  messages: emulate counts every MQTT message, statuses and votes included); Flower's, the
  tensors' serialized bytes (`Array.data`) of each message to a client and each reply, the
  message framing left out (it favours Flower slightly).
* accuracy: the report's final mean accuracy. Ours is deterministic (simulate = emulate);
  Flower's varies from run to run in the 3rd decimal (0.3084-0.3161 over five runs, ours
  0.3121): its FedAvg sums float32 arrays in the order replies arrive, ours sums in float64
  in a fixed order. After 2 rounds both give exactly 0.11855.

Targets (issue 16): simulate <= 0.4x Flower's steady s / round, emulate <= 0.5x, and the
README main job's whole run no slower than Flower's.

Results, dated, with the commit, the machine and the command: studies/results/vs_flower.md.
"""

from __future__ import annotations

import argparse
import bisect
import functools
import logging
import os
import pathlib
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil
from rich.console import Console
from rich.table import Table

from agent.experiment import ExperimentConfig
from agent.learning import preset
from bench.support import (
    broker,
    environment,
    fleet_round_ends,
    steady_round_s,
    write_json,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]

SIMULATE_TARGET = 0.4
"""Target: simulate's steady s / round at most this fraction of Flower's."""
SIMULATE_WORKERS = "simulate/2"
"""`coordinator simulate --workers 2`: fits on both cores, as Flower's two client actors."""
EMULATE_TARGET = 0.5
NEIGHBOURS = 5
MAIN_JOB = "coordinator emulate, dadpfl"
README_AGENTS_PER_PROCESS = 4
"""The README's main job runs its 8 agents 4 to a process."""
Ends = dict[int, float]
"""Round -> when it ended (epoch seconds)."""


def task(strategy: str, agents: int, rounds: int, epochs: int, seed: int) -> ExperimentConfig:
    """The one task every run learns: mnist1d, Dirichlet 0.3 (the defaults), `strategy`."""
    extra = {"neighbours": min(NEIGHBOURS, agents - 1)} if strategy == "dadpfl" else {}
    return ExperimentConfig(
        agents=agents,
        seed=seed,
        learning=preset(strategy, rounds=rounds, epochs=epochs, **extra),
    )


def round_times(ends: Ends) -> dict[str, float | None]:
    """Steady seconds per round (mean, `steady_round_s`) and the median of the steady rounds'
    lengths, which a burst of other work on the machine moves less."""
    spans = sorted(ends[t] - ends[t - 1] for t in sorted(ends)[1:] if t - 1 in ends)
    return {
        "steady_round_s": steady_round_s(ends),
        "median_round_s": statistics.median(spans) if spans else None,
    }


def report_figures(report: dict[str, Any]) -> dict[str, Any]:
    """Bytes per round (each transfer once, at its receiver) and final accuracy of a report."""
    delivered = [
        sum(a["bytes_received"] for a in r["agents"].values())
        + r.get("coordinator", {}).get("received", 0)
        for r in report["rounds"]
    ]
    summary = report["summary"]
    return {
        "bytes_per_round": sum(delivered) / len(delivered) if delivered else None,
        "accuracy": summary.get("mean_accuracy") if delivered else None,
        "rounds_done": len(report["rounds"]),
        "failed": summary.get("failed_agents") or summary.get("stragglers") or None,
    }


class CpuWatch(threading.Thread):
    """CPU seconds spent by this process and every process it started (Ray's, the agents'),
    sampled with the time: on a busy machine a round's wall time says how the scheduler shared
    the cores; its CPU seconds say what the round cost. A process that ended keeps its last
    sample (up to `period_s` of its CPU is missed)."""

    def __init__(self, period_s: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.period_s = period_s
        self.me = psutil.Process()
        self.seen: dict[int, float] = {}
        self.samples: list[tuple[float, float]] = []
        self.done = threading.Event()

    def total(self) -> float:
        for process in [self.me, *self.me.children(recursive=True)]:
            try:
                times = process.cpu_times()
            except psutil.Error:
                continue
            self.seen[process.pid] = times.user + times.system
        return sum(self.seen.values())

    def run(self) -> None:
        while not self.done.is_set():
            self.samples.append((time.time(), self.total()))
            self.done.wait(self.period_s)
        self.samples.append((time.time(), self.total()))

    def at(self, when: float) -> float:
        """CPU seconds used by `when`, interpolated between the samples around it."""
        index = bisect.bisect_left(self.samples, (when, -1.0))
        if index == 0 or index == len(self.samples):
            return self.samples[min(index, len(self.samples) - 1)][1]
        (t0, c0), (t1, c1) = self.samples[index - 1], self.samples[index]
        return c0 + (c1 - c0) * (when - t0) / (t1 - t0) if t1 > t0 else c1

    def figures(self, ends: Ends) -> dict[str, float | None]:
        """CPU seconds of the whole run and per steady round (as `steady_round_s`)."""
        whole = self.samples[-1][1] - self.samples[0][1]
        steady = None
        if len(ends) >= 2:
            first, last = min(ends), max(ends)
            steady = (self.at(ends[last]) - self.at(ends[first])) / (last - first)
        return {"cpu_s": whole, "steady_cpu_round_s": steady}


def run_simulate(config: ExperimentConfig, workers: int = 1) -> tuple[Ends, dict[str, Any]]:
    """`coordinator simulate` (`--workers`): round ends from its progress callback (the last
    participant of a round)."""
    from coordinator.simulate import simulate

    ends: Ends = {}

    def progress(round_: int, _agent: str) -> None:
        ends[round_] = time.time()

    clock = time.perf_counter()
    report = simulate(config, progress, workers)
    return ends, {"wall_s": time.perf_counter() - clock, **report_figures(report)}


AGENTS_PER_PROCESS = [README_AGENTS_PER_PROCESS]
"""What `run_emulate` passes as `--agents-per-process` (`main` sets it from its option)."""


def run_emulate(config: ExperimentConfig) -> tuple[Ends, dict[str, Any]]:
    """`coordinator emulate` on the embedded broker, as the CLI runs it."""
    from coordinator.emulate import Emulation, EmulationOptions, auto_agents_per_process

    shared = AGENTS_PER_PROCESS[0] or auto_agents_per_process(config.agents)
    with tempfile.TemporaryDirectory(prefix="vs-flower-") as folder:
        workdir = pathlib.Path(folder)
        with broker("embedded", workdir) as address:
            options = EmulationOptions(workdir=workdir / "fleet", agents_per_process=shared)
            emulation = Emulation(config, address, options)
            clock = time.perf_counter()
            report = emulation.run()
            wall = time.perf_counter() - clock
        ends = fleet_round_ends(workdir / "fleet", emulation.roster)
    return ends, {"wall_s": wall, **report_figures(report)}


# ----------------------------------------------------------------------------------- Flower


@functools.cache
def _workload(config: ExperimentConfig) -> tuple[Any, dict[str, Any], list[str]]:
    """Our learner, every agent's data and the sorted roster, once per process (Ray actor)."""
    from agent.workload import build_workload

    roster = [f"agent-{k:03d}" for k in range(config.agents)]
    workload = build_workload(config, roster)
    return workload.learner, workload.data, roster


def flower_client(config: ExperimentConfig) -> Any:
    """A ClientApp whose train step is our fedavg participant's: local SGD from the global
    model on partition `partition-id` of our split, with our per-agent, per-round seed."""
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    from agent.learning.central.base import FitContext, ServerState
    from agent.learning.central.fedavg import full_model_fit

    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        learner, data, roster = _workload(config)
        k = roster[int(context.node_config["partition-id"])]
        start = dict(msg.content.array_records["arrays"].to_torch_state_dict())
        round_ = int(str(msg.content.config_records["config"]["server-round"]))
        ctx = FitContext(learner.init_agent(k), data[k], ServerState(start), round_, 1.0)
        fit = full_model_fit(learner.facts, ctx)
        content = RecordDict(
            {
                "arrays": ArrayRecord(fit.upload.weights),
                "metrics": MetricRecord({"num-examples": fit.num_samples}),
            }
        )
        return Message(content=content, reply_to=msg)

    return app


def tensor_bytes(record: Any) -> int:
    """Serialized bytes of the tensors an ArrayRecord carries."""
    return sum(len(array.data) for array in record.values())


def counting_fedavg(agents: int, transfers: list[int]) -> Any:
    """Flower's FedAvg, every client every round, adding each message's tensor bytes to
    `transfers[round - 1]` (what goes down to the clients and what comes back)."""
    from flwr.serverapp.strategy import FedAvg

    class CountingFedAvg(FedAvg):
        def configure_train(self, server_round: int, *args: Any) -> Any:
            messages = list(super().configure_train(server_round, *args))
            transfers.append(sum(tensor_bytes(m.content["arrays"]) for m in messages))
            return messages

        def aggregate_train(self, server_round: int, replies: Any) -> Any:
            replies = list(replies)
            transfers[-1] += sum(tensor_bytes(m.content["arrays"]) for m in replies)
            return super().aggregate_train(server_round, replies)

    return CountingFedAvg(
        fraction_train=1.0,
        fraction_evaluate=0.0,
        min_train_nodes=agents,
        min_available_nodes=agents,
    )


def flower_server(config: ExperimentConfig, ends: Ends, out: dict[str, Any]) -> Any:
    """A ServerApp running Flower's FedAvg; `evaluate_fn` measures the global model as our
    fedavg does and stamps each round's end in `ends`."""
    from flwr.app import ArrayRecord, Context, MetricRecord
    from flwr.serverapp import Grid, ServerApp

    learner, data, roster = _workload(config)
    app = ServerApp()
    transfers: list[int] = []

    def evaluate(round_: int, arrays: ArrayRecord) -> MetricRecord:
        weights = dict(arrays.to_torch_state_dict())
        accuracy = sum(learner.facts.evaluate_on(weights, data[k])[1] for k in roster) / len(roster)
        if round_ > 0:
            ends[round_] = time.time()
            out["accuracy"] = accuracy
        return MetricRecord({"accuracy": accuracy})

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = counting_fedavg(config.agents, transfers)
        strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(dict(learner.facts.initial)),
            num_rounds=config.learning.rounds,
            evaluate_fn=evaluate,
        )
        out["transfers"] = transfers

    return app


def run_flower(config: ExperimentConfig) -> tuple[Ends, dict[str, Any]]:
    """Flower's simulation engine (Ray) on our task: one client per agent, one CPU each."""
    from flwr.simulation import run_simulation

    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
    )  # Ray's workers import our packages
    logging.getLogger("flwr").setLevel(logging.WARNING)
    ends: Ends = {}
    out: dict[str, Any] = {}
    clock = time.perf_counter()
    run_simulation(
        server_app=flower_server(config, ends, out),
        client_app=flower_client(config),
        num_supernodes=config.agents,
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {"include_dashboard": False},
        },
    )
    wall = time.perf_counter() - clock
    transfers = out.get("transfers") or [0]
    return ends, {
        "wall_s": wall,
        "bytes_per_round": sum(transfers) / len(transfers),
        "accuracy": out.get("accuracy"),
        "rounds_done": len(ends),
        "failed": None if len(ends) == config.learning.rounds else "rounds missing",
    }


# ------------------------------------------------------------------------------------ runs

RUNNERS: dict[str, Callable[[ExperimentConfig], tuple[Ends, dict[str, Any]]]] = {
    "flower": run_flower,
    "simulate": run_simulate,
    SIMULATE_WORKERS: functools.partial(run_simulate, workers=2),
    "emulate": run_emulate,
}
RUNS = (
    ("flower", "fedavg"),
    ("simulate", "fedavg"),
    (SIMULATE_WORKERS, "fedavg"),
    ("emulate", "fedavg"),
)
RUNS_DADPFL = (("simulate", "dadpfl"), ("emulate", "dadpfl"))


def measure(
    console: Console,
    engine: str,
    strategy: str,
    config: ExperimentConfig,
    job: str,
    repeat: int = 1,
) -> dict[str, Any]:
    """One run of `engine` on `config`, with what it was (`repeat`: which pass of the plan)."""
    cfg = config.learning
    console.print(
        f"{job} #{repeat}: {engine} {strategy}, {cfg.rounds} rounds x {cfg.epochs} epochs ..."
    )
    row: dict[str, Any] = {
        "job": job,
        "repeat": repeat,
        "engine": engine,
        "strategy": strategy,
        "epochs": cfg.epochs,
    }
    watch = CpuWatch()
    watch.start()
    started = time.time()
    try:
        ends, figures = RUNNERS[engine](config)
    finally:
        watch.done.set()
        watch.join()
    row |= {"rounds": cfg.rounds, **figures, **round_times(ends), **watch.figures(ends)}
    if ends and row["steady_round_s"] is not None:  # where the whole run's time went
        row["startup_s"] = max(0.0, ends[min(ends)] - started - row["steady_round_s"])
        row["shutdown_s"] = max(0.0, started + row["wall_s"] - ends[max(ends)])
    if not complete(row):
        console.print(f"  [red]failed[/] after {row['rounds_done']} rounds: {row['failed']}")
    else:
        console.print(f"  {row['wall_s']:.1f} s, accuracy {row['accuracy']:.4f}")
    return row


def complete(row: dict[str, Any]) -> bool:
    """Whether a run did every round with nobody failing: only those count for a target."""
    return not row["failed"] and row["rounds_done"] == row["rounds"]


def cpu_ratio(ours: dict[str, Any], flower: dict[str, Any], key: str) -> float | None:
    """The same comparison in CPU seconds, which the machine's other work moves less."""
    return ours[key] / flower[key] if ours.get(key) and flower.get(key) else None


def verdicts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets against Flower, each with its measured ratio. With several
    passes of the plan (`--repeats`) each pass gives a ratio against the Flower run of the
    same pass, minutes apart at most, and the median of them decides: a noisy machine moves
    one pass's ratio by a quarter either way."""

    def find(job: str, engine: str, strategy: str, repeat: int) -> dict[str, Any] | None:
        wanted = (job, engine, strategy, repeat)
        match = (r for r in rows if (r["job"], r["engine"], r["strategy"], r["repeat"]) == wanted)
        return next(match, None)

    repeats = sorted({r["repeat"] for r in rows if r["job"] == "task"})
    checks = []
    targets = (
        ("simulate", SIMULATE_TARGET),
        (SIMULATE_WORKERS, SIMULATE_TARGET),
        ("emulate", EMULATE_TARGET),
    )
    for engine, limit in targets:
        ratios, cpu = [], []
        for repeat in repeats:
            flower = find("task", "flower", "fedavg", repeat)
            ours = find("task", engine, "fedavg", repeat)
            timed = [r for r in (flower, ours) if r and complete(r) and r["steady_round_s"]]
            if flower and ours and len(timed) == 2:
                ratios.append(ours["steady_round_s"] / flower["steady_round_s"])
                cpu.append(cpu_ratio(ours, flower, "steady_cpu_round_s"))
        known = [c for c in cpu if c is not None]
        median = statistics.median(ratios) if ratios else None  # None: no complete run
        checks.append(
            {
                "target": f"{engine} fedavg steady s / round <= {limit}x Flower's",
                "ratio": median,
                "ratios": ratios,
                "met": median is not None and median <= limit,
                "cpu_ratio": statistics.median(known) if known else None,
            }
        )
    main_job, main_flower = (
        find("main", "emulate", "dadpfl", 1),
        find("main", "flower", "fedavg", 1),
    )
    if main_job and main_flower:
        ratio = main_job["wall_s"] / main_flower["wall_s"]
        checks.append(
            {
                "target": f"README main job ({MAIN_JOB}, {main_job['rounds']} rounds x "
                f"{main_job['epochs']} epochs): whole run <= Flower's",
                "ratio": ratio,
                "ratios": [ratio],
                "met": complete(main_job) and ratio <= 1.0,
                "cpu_ratio": cpu_ratio(main_job, main_flower, "cpu_s"),
            }
        )
    return checks


def cell(row: dict[str, Any], flower: dict[str, Any], key: str, digits: int) -> str:
    """A figure of `row` and, where `flower` is given, its multiple of Flower's."""
    value, base = row.get(key), flower.get(key)
    if value is None:
        return "-"
    return f"{value:.{digits}f}" + (f" {value / base:.2f}x" if base else "")


def table(rows: list[dict[str, Any]], checks: list[dict[str, Any]]) -> tuple[Table, Table]:
    """The runs side by side (with multiples of Flower's run of the same job), the targets."""
    runs = Table(title="Flower (Ray) vs coordinator simulate / emulate, same task")
    figures = {  # column -> (row key, digits)
        "s / round": ("steady_round_s", 3),
        "median s": ("median_round_s", 3),
        "CPU s / round": ("steady_cpu_round_s", 3),
        "whole run s": ("wall_s", 1),
        "CPU s": ("cpu_s", 1),
    }
    parts = {"start-up s": "startup_s", "after s": "shutdown_s"}  # of the whole run
    columns = ("job", "#", "engine", "strategy", "E", *figures, *parts, "bytes / round", "accuracy")
    for column in columns:
        runs.add_column(column, justify="left" if column in ("job", "engine") else "right")
    base = {(r["job"], r["repeat"]): r for r in rows if r["engine"] == "flower"}
    for r in sorted(rows, key=lambda r: (r["job"] != "task", r["strategy"], r["repeat"])):
        flower = base.get((r["job"], r["repeat"]), {})
        runs.add_row(
            r["job"],
            str(r["repeat"]),
            r["engine"],
            r["strategy"],
            str(r["epochs"]),
            *(cell(r, flower, key, digits) for key, digits in figures.values()),
            *(cell(r, {}, key, 1) for key in parts.values()),
            f"{r['bytes_per_round'] / 1e3:,.0f} kB" if r["bytes_per_round"] is not None else "-",
            f"{r['accuracy']:.4f}" if r["accuracy"] is not None else "-",
        )
    targets = Table(title="targets (issue 16)")
    for column in ("target", "measured", "met"):
        targets.add_column(column)
    for c in checks:
        cpu = f" (CPU s: {c['cpu_ratio']:.2f}x)" if c["cpu_ratio"] is not None else ""
        each = ", ".join(f"{r:.2f}" for r in c["ratios"])
        measured = (
            "no complete run"
            if c["ratio"] is None
            else f"{c['ratio']:.2f}x{cpu}"
            + (f" (median of {each})" if len(c["ratios"]) > 1 else "")
        )
        targets.add_row(c["target"], measured, "yes" if c["met"] else "NO")
    return runs, targets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--main-rounds", type=int, default=10, help="the README main job's")
    parser.add_argument("--main-epochs", type=int, default=5, help="the CLI's default epochs")
    parser.add_argument("--skip-main", action="store_true", help="leave the main job out")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="passes of the task's runs, one after the other (the targets take the median "
        "of the passes' ratios)",
    )
    parser.add_argument(
        "--agents-per-process",
        type=int,
        default=README_AGENTS_PER_PROCESS,
        help="emulate's agents per process (0: its automatic rule; default: the README's)",
    )
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench/results/vs_flower.json")
    args = parser.parse_args(argv)
    if args.agents < 2 or min(args.rounds, args.main_rounds) < 2 or args.epochs < 1:
        parser.error("need --agents >= 2, rounds >= 2 and --epochs >= 1")
    if args.repeats < 1:
        parser.error("need --repeats >= 1")
    try:
        import flwr  # noqa: F401
        import ray  # noqa: F401
    except ImportError:
        print("Flower's simulation engine is not installed: pip install 'flwr[simulation]'")
        return 2
    import studies.vs_flower as study  # Ray's workers unpickle the client app from this module

    study.AGENTS_PER_PROCESS[0] = args.agents_per_process

    console = Console(width=None if sys.stdout.isatty() else 160)
    plan = [
        ("task", e, s, args.rounds, args.epochs, repeat)
        for repeat in range(1, args.repeats + 1)
        for e, s in RUNS + RUNS_DADPFL
    ]
    if not args.skip_main:
        plan += [("main", e, s, args.main_rounds, args.main_epochs, 1) for e, s in RUNS[:1]]
        plan += [("main", "emulate", "dadpfl", args.main_rounds, args.main_epochs, 1)]
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    for job, engine, strategy, rounds, epochs, repeat in plan:
        config = task(strategy, args.agents, rounds, epochs, args.seed)
        rows.append(study.measure(console, engine, strategy, config, job, repeat))
        write_json(args.out, {"rows": rows, "machine": environment()})
    checks = verdicts(rows)
    for printed in table(rows, checks):
        console.print(printed)
    write_json(
        args.out,
        {
            "config": {k: v for k, v in vars(args).items() if k != "out"},
            "rows": rows,
            "targets": checks,
            "wall_s": time.perf_counter() - started,
            "flwr": sys.modules["flwr"].__version__,
            "ray": sys.modules["ray"].__version__,
            "machine": environment(),
        },
    )
    console.print(f"wall time {time.perf_counter() - started:.0f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
