"""Simulator overhead: wall time per round of `coordinator simulate` against the bare training
it contains. Target: simulator / bare <= 1.2.

    python bench/sim_overhead.py [--agents 20] [--rounds 5] [--dataset mnist1d]
        [--strategy dadpfl] [--repeat 3] [--threads 1] [--out bench/results/sim_overhead.json]

What "bare training" is (the denominator). For every round and every agent of the run, in the
round's reuse order, exactly the local SGD steps the simulator's `train_local` takes, as a
plain PyTorch loop and nothing else:

* the same model class and initial weights (one persistent model and one persistent
  `torch.optim.SGD` per agent, built before timing: no per-round construction, no
  load_state_dict, no state-dict copies), the same lr (lr_at(round)), momentum and weight
  decay;
* the same local data and the same batches: the same `_batches` order drawn from the same
  derived generator, so the number of steps and every batch size are identical;
* per step: zero_grad, forward, cross-entropy, backward, optimizer step. That is all.

Left out, and therefore counted as simulator overhead: aggregation, the per-step mask
re-application and the final masking, `loss.item()`, loading and copying state dicts, the
vote and PQI pruning, the RigL dense-gradient pass and drop/regrow, evaluation on the test
split, encoding each published model to count its bytes, FLOP counting, and the loop's own
bookkeeping (topology, inboxes, traffic, round records). The bare loop trains dense models, so
its numbers differ from the simulator's; its compute does not (PyTorch runs masked layers with
dense kernels).

Both sides run in the same process, with the same number of torch threads, after a warm-up
that pays the one-off costs (lazy imports: the first `torch.optim` optimizer imports
torch._dynamo, about a second; the first-run cost is reported separately as `cold_start_s`).
Dataset loading and partitioning are excluded from both. Each repeat runs the bare loop and
then the simulator on a fresh `Simulation`; the figures are the best of `--repeat`.

The breakdown comes from a separate, instrumented run of the simulator: the functions it calls
are wrapped with timers (a few microseconds per call) and `torch.no_grad` blocks opened directly
by `train_local` (the per-step mask re-application) are timed, so every row is measured in
place, not estimated. "other" is the run's time that no row covers.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import os
import pathlib
import platform
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from agent import pruning, sparse, strategies, training  # noqa: E402
from agent.strategies import preset  # noqa: E402
from coordinator import simulate as simulator  # noqa: E402
from coordinator.simulate import ExperimentConfig, Simulation  # noqa: E402

TARGET = 1.2

# Breakdown rows, in report order: (key, label). "training steps" is the part of `train_local`
# the bare loop also does; every other row is overhead.
ROWS = (
    ("train_steps", "training steps (what bare does, + loss.item)"),
    ("train_mask", "mask re-apply (per step) + final mask"),
    ("train_setup", "training setup: load weights, optimizer, state copy"),
    ("aggregation", "aggregation"),
    ("vote_prune", "vote + PQI pruning"),
    ("rigl_gradient", "RigL dense gradient"),
    ("rigl_update", "RigL drop/regrow + re-mask"),
    ("evaluation", "evaluation"),
    ("encoding", "encoding for byte counts"),
    ("flops", "FLOP counting"),
    ("other", "other (topology, inboxes, records, ...)"),
)


# ------------------------------------------------------------------------------ configuration


def experiment(args: argparse.Namespace) -> ExperimentConfig:
    learning = preset(
        args.strategy,
        rounds=args.rounds,
        neighbours=min(args.neighbours, args.agents - 1),
        max_wait=args.max_wait,
    )
    return ExperimentConfig(
        dataset=args.dataset,
        agents=args.agents,
        partition=args.partition,
        seed=args.seed,
        threads=args.threads,
        learning=learning,
    )


# --------------------------------------------------------------------------------- simulator


def time_simulator(config: ExperimentConfig) -> tuple[float, list[float], dict[str, Any]]:
    """(run seconds, seconds per round, report) of one simulation; construction not timed."""
    simulation = Simulation(config)
    roster = simulation.roster
    stamps: list[float] = []
    seen: dict[int, int] = defaultdict(int)

    def progress(t: int, _agent: str) -> None:
        seen[t] += 1
        if seen[t] == len(roster):  # the round's last agent has run
            stamps.append(time.perf_counter())

    start = time.perf_counter()
    report = simulation.run(progress)
    total = time.perf_counter() - start
    # A round's time runs from the previous round's last agent to its own last agent; the tail
    # after the last agent (votes, the round record, the summary) is added to the final round.
    edges = [start, *stamps[:-1], start + total]
    return total, [b - a for a, b in zip(edges[:-1], edges[1:], strict=True)], report


# --------------------------------------------------------------------------------- bare loop


class BareFleet:
    """One persistent model and SGD optimizer per agent, initialized like the simulator's."""

    def __init__(self, config: ExperimentConfig) -> None:
        simulation = Simulation(config)  # the same data, model and initial weights
        self.config = config
        self.learner = simulation.learner
        self.data = simulation.data
        self.roster = simulation.roster
        sgd = config.learning.sgd
        self.sgd = sgd
        self.models: dict[str, torch.nn.Module] = {}
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        for agent_id in self.roster:
            model = copy.deepcopy(self.learner.model)
            model.load_state_dict(simulation.states[agent_id].weights)
            model.train()
            self.models[agent_id] = model
            self.optimizers[agent_id] = torch.optim.SGD(
                model.parameters(),
                lr=sgd.lr,
                momentum=sgd.momentum,
                weight_decay=sgd.weight_decay,
            )

    def run(self) -> tuple[float, list[float], int]:
        """(seconds, seconds per round, SGD steps) of the plain loop over every round."""
        from agent import topology

        seed, cfg = self.config.seed, self.config.learning
        per_round: list[float] = []
        steps = 0
        start = time.perf_counter()
        for t in range(1, cfg.rounds + 1):
            round_start = time.perf_counter()
            order = (
                topology.reuse_order(seed, t, self.roster)
                if cfg.strategy in ("dadpfl", "dispfl", "dfedavgm", "local")
                else self.roster
            )
            lr = self.sgd.lr_at(t)
            for agent_id in order:
                model, optimizer = self.models[agent_id], self.optimizers[agent_id]
                for group in optimizer.param_groups:
                    group["lr"] = lr
                x, y = self.data[agent_id].x_train, self.data[agent_id].y_train
                generator = self.learner.generator("train", agent_id, t)
                for _ in range(self.sgd.epochs):
                    for batch in training._batches(len(y), self.sgd.batch_size, generator):
                        optimizer.zero_grad(set_to_none=True)
                        loss = F.cross_entropy(model(x[batch]), y[batch])
                        loss.backward()
                        optimizer.step()
                        steps += 1
            per_round.append(time.perf_counter() - round_start)
        return time.perf_counter() - start, per_round, steps


# ------------------------------------------------------------------------------- breakdown


class Recorder:
    """Inclusive seconds per label for calls made at the top level of a round (not nested in
    another timed call), and per (parent, label) for calls nested one level down."""

    def __init__(self) -> None:
        self.top: dict[str, float] = defaultdict(float)
        self.nested: dict[tuple[str, str], float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.stack: list[str] = []

    @contextlib.contextmanager
    def span(self, label: str) -> Iterator[None]:
        parent = self.stack[-1] if self.stack else None
        self.stack.append(label)
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            self.stack.pop()
            if parent is None:
                self.top[label] += elapsed
                self.calls[label] += 1
            else:
                self.nested[(parent, label)] += elapsed
                self.calls[f"{parent}/{label}"] += 1

    def wrap(self, function: Callable[..., Any], label: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.span(label):
                return function(*args, **kwargs)

        timed.__wrapped__ = function  # type: ignore[attr-defined]
        return timed


@contextlib.contextmanager
def instrumented(recorder: Recorder, simulation: Simulation) -> Iterator[None]:
    """Wrap what a round calls with timers; restore everything on exit."""
    patches: list[tuple[object, str, object]] = []

    def patch(owner: object, name: str, label: str) -> None:
        original = getattr(owner, name)
        patches.append((owner, name, original))
        setattr(owner, name, recorder.wrap(original, label))

    patch(strategies.Learner, "aggregate", "aggregation")
    patch(strategies, "train_local", "training")
    patch(strategies, "dense_gradients", "rigl_gradient")
    patch(strategies, "evaluate", "evaluation")
    patch(strategies.Learner, "train_flops", "flops")
    patch(pruning, "distance_from_init", "vote_prune")
    patch(pruning, "detection_score", "vote_prune")
    patch(pruning, "vote", "vote_prune")
    patch(sparse, "pqi_prune", "vote_prune")
    patch(sparse, "rigl_update", "rigl_update")
    patch(sparse, "rigl_alpha", "rigl_update")
    patch(sparse, "apply_masks", "rigl_update")  # after RigL (and after the rare PQI prune)
    patch(training, "apply_masks_", "train_final_mask")
    patch(simulator.Simulation, "_message_size", "encoding")
    patch(simulator.Simulation, "_round_record", "records")
    model = simulation.learner.model
    model.load_state_dict = recorder.wrap(model.load_state_dict, "load_state_dict")

    base_sgd, base_no_grad = torch.optim.SGD, torch.no_grad

    class TimedSGD(base_sgd):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            with recorder.span("optimizer_setup"):
                super().__init__(*args, **kwargs)

    class TimedNoGrad(base_no_grad):  # type: ignore[misc, valid-type]
        """The per-step mask re-application is the only no_grad block train_local opens."""

        def __enter__(self) -> None:
            self._span = None
            if recorder.stack and recorder.stack[-1] == "training":
                self._span = recorder.span("train_reapply")
                self._span.__enter__()
            super().__enter__()

        def __exit__(self, *exc: object) -> None:
            super().__exit__(*exc)
            if self._span is not None:
                self._span.__exit__(None, None, None)

    torch.optim.SGD, torch.no_grad = TimedSGD, TimedNoGrad
    try:
        yield
    finally:
        torch.optim.SGD, torch.no_grad = base_sgd, base_no_grad
        del model.load_state_dict
        for owner, name, original in reversed(patches):
            setattr(owner, name, original)


def breakdown(config: ExperimentConfig) -> dict[str, Any]:
    """Seconds per round of each row of ROWS, from one instrumented run."""
    simulation = Simulation(config)
    recorder = Recorder()
    with instrumented(recorder, simulation):
        start = time.perf_counter()
        simulation.run()
        total = time.perf_counter() - start
    top, nested = recorder.top, recorder.nested
    training_total = top["training"]
    train_mask = nested[("training", "train_reapply")] + nested[("training", "train_final_mask")]
    train_setup = nested[("training", "load_state_dict")] + nested[("training", "optimizer_setup")]
    rows = {
        "train_mask": train_mask,
        "train_setup": train_setup,
        "aggregation": top["aggregation"],
        "vote_prune": top["vote_prune"],
        "rigl_gradient": top["rigl_gradient"],
        "rigl_update": top["rigl_update"],
        "evaluation": top["evaluation"],
        "encoding": top["encoding"],
        "flops": top["flops"],
    }
    # The state-dict copy at the end of train_local is not a call we can wrap: it stays in
    # "train_steps" (it is small: a clone of every tensor once per round).
    rows["train_steps"] = training_total - train_mask - train_setup
    rows["other"] = total - training_total - sum(
        v for k, v in rows.items() if k not in ("train_steps", "train_mask", "train_setup")
    )
    rounds = config.learning.rounds
    return {
        "total_s": total,
        "per_round_s": {key: rows[key] / rounds for key, _ in ROWS},
        "nested_s": {f"{p}/{c}": v for (p, c), v in sorted(nested.items())},
        "calls": dict(sorted(recorder.calls.items())),
    }


# ------------------------------------------------------------------------------------ report


def print_report(result: dict[str, Any]) -> None:
    sim_rounds, bare_rounds = result["simulator"]["per_round_s"], result["bare"]["per_round_s"]
    round_rows = [
        [str(t), f"{s * 1e3:.1f}", f"{b * 1e3:.1f}", f"{s / b:.2f}"]
        for t, (s, b) in enumerate(zip(sim_rounds, bare_rounds, strict=True), start=1)
    ]
    round_rows.append(
        [
            "mean",
            f"{result['simulator']['seconds_per_round'] * 1e3:.1f}",
            f"{result['bare']['seconds_per_round'] * 1e3:.1f}",
            f"{result['ratio']:.2f}",
        ]
    )
    parts = result["breakdown"]["per_round_s"]
    total = sum(parts.values())
    extra = total - parts["train_steps"]
    part_rows = [
        [
            label,
            f"{parts[key] * 1e3:.1f}",
            f"{100 * parts[key] / total:.1f}%",
            "" if key == "train_steps" else f"{100 * parts[key] / extra:.1f}%",
        ]
        for key, label in ROWS
    ]
    part_rows.append(["total (instrumented run)", f"{total * 1e3:.1f}", "100%", "100%"])
    verdict = "met" if result["target_met"] else "NOT met"
    title = (
        f"simulator vs bare training, {result['config']['dataset']} {result['config']['strategy']}"
        f" {result['config']['agents']} agents, {result['config']['threads']} thread(s)"
    )
    footer = (
        f"ratio {result['ratio']:.2f} (target <= {TARGET}: {verdict}); "
        f"{result['bare']['steps_per_round']:.0f} SGD steps per round; "
        f"cold start (first run in a process) +{result['cold_start_s']:.2f} s"
    )
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        for line in [["round", "simulator ms", "bare ms", "ratio"], *round_rows]:
            print("  ".join(cell.rjust(14) for cell in line))
        print()
        for line in [["where the time goes", "ms/round", "of sim", "of extra"], *part_rows]:
            print(line[0].ljust(54) + "  ".join(cell.rjust(10) for cell in line[1:]))
        print(footer)
        return
    console = Console(width=None if sys.stdout.isatty() else 120)
    table = Table(title=title)
    for header in ("round", "simulator ms", "bare ms", "ratio"):
        table.add_column(header, justify="right")
    for line in round_rows:
        table.add_row(*line)
    console.print(table)
    table = Table(title="where the simulator's time goes (instrumented run)")
    table.add_column("part", justify="left")
    for header in ("ms/round", "of simulator", "of extra over steps"):
        table.add_column(header, justify="right")
    for line in part_rows:
        table.add_row(*line)
    console.print(table)
    console.print(footer)


# -------------------------------------------------------------------------------------- main


def measure(args: argparse.Namespace) -> dict[str, Any]:
    config = experiment(args)
    torch.set_num_threads(args.threads)

    # Warm-up: lazy imports and first-call costs, paid once per process by either side.
    warm = dataclasses.replace(
        config, learning=dataclasses.replace(config.learning, rounds=1)
    )
    cold = time_simulator(warm)[0]
    warm_again = time_simulator(warm)[0]
    BareFleet(warm).run()

    sim_best: tuple[float, list[float]] | None = None
    bare_best: tuple[float, list[float], int] | None = None
    sim_all, bare_all = [], []
    report: dict[str, Any] = {}
    for _ in range(args.repeat):
        fleet = BareFleet(config)
        bare = fleet.run()
        del fleet
        bare_all.append(bare[0])
        if bare_best is None or bare[0] < bare_best[0]:
            bare_best = bare
        total, per_round, report = time_simulator(config)
        sim_all.append(total)
        if sim_best is None or total < sim_best[0]:
            sim_best = (total, per_round)
    assert sim_best is not None and bare_best is not None
    parts = breakdown(config)
    rounds = config.learning.rounds
    ratio = sim_best[0] / bare_best[0]
    summary = dict(report["summary"])
    summary.pop("wall_seconds", None)
    return {
        "config": {
            "dataset": args.dataset,
            "strategy": args.strategy,
            "agents": args.agents,
            "rounds": rounds,
            "partition": args.partition,
            "seed": args.seed,
            "threads": args.threads,
            "neighbours": config.learning.neighbours,
            "max_wait": config.learning.max_wait,
            "repeat": args.repeat,
        },
        "bare_definition": (
            "per agent per round, the same SGD steps train_local takes (same batches from the "
            "same derived generator, same lr/momentum/weight decay): zero_grad, forward, "
            "cross-entropy, backward, step on a persistent per-agent model and optimizer; "
            "nothing else (no aggregation, masking, loss.item, state-dict loads or copies, "
            "RigL, vote, evaluation, encoding or FLOP counting)"
        ),
        "simulator": {
            "seconds": sim_best[0],
            "seconds_per_round": sim_best[0] / rounds,
            "per_round_s": sim_best[1],
            "all_runs_s": sim_all,
        },
        "bare": {
            "seconds": bare_best[0],
            "seconds_per_round": bare_best[0] / rounds,
            "per_round_s": bare_best[1],
            "all_runs_s": bare_all,
            "steps_per_round": bare_best[2] / rounds,
        },
        "ratio": ratio,
        "target": TARGET,
        "target_met": ratio <= TARGET,
        "cold_start_s": max(0.0, cold - warm_again),
        "breakdown": parts,
        "report_summary": summary,
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dataset", default="mnist1d")
    parser.add_argument("--strategy", default="dadpfl", choices=strategies.PRESETS)
    parser.add_argument("--partition", default="dirichlet:0.3")
    parser.add_argument("--neighbours", type=int, default=5)
    parser.add_argument("--max-wait", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--out", type=pathlib.Path, default=ROOT / "bench/results/sim_overhead.json"
    )
    args = parser.parse_args()
    if args.repeat < 1 or args.rounds < 1 or args.threads < 1:
        parser.error("--repeat, --rounds and --threads must be at least 1")
    if hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, set(cores[: args.threads]))
    result = measure(args)
    print_report(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
