"""Agent memory: resident memory (RSS) of one edge-agent process during its rounds, against what
`import torch` alone costs. Target: <= 60 MB above torch after import, model and data excluded.

    python -m bench.agent_memory [--agents 4] [--rounds 10] [--dataset mnist1d] [--model NAME]
        [--broker embedded|mosquitto|HOST:PORT] [--out bench/results/agent_memory.json]

Measured:

* torch baseline: RSS of `python -c "import torch"` once imported (best of 3).
* torch training: RSS of a plain loop that imports torch and the model builder and takes
  three SGD steps of the same model on a random batch of the run's batch size: what torch
  itself costs once it has trained (its kernels, autograd, allocator), for reference. The
  steps are written out: a `torch.optim` optimizer imports torch._dynamo, about 70 MB more
  (the agent's own SGD step avoids it too).
* imports: RSS of a process that has imported the agent's modules (what `edge-agent` loads
  before it connects).
* during rounds: the agents of a real emulated fleet (real processes, real broker) are sampled
  every 20 ms with psutil; an agent's figure is its highest RSS between the end of its first
  round and the end of its last (steady rounds: receiving, aggregating, training, evaluating,
  encoding, publishing, checkpointing). The table gives the largest over the agents, and the
  peak over the agent's whole life (start-up and the ONNX export at the end included).
* model and data: bytes of the agent's own tensors, counted generously: the whole dataset
  (each agent loads it before keeping its share) plus its share, and the model's weights
  times the copies an agent can hold at once (the module, its gradients, momentum buffers,
  the initial weights, its state, the training result, the aggregate, every neighbour model
  in its inbox for two rounds, and its recent encoded messages).

Agent overhead = during rounds - torch baseline - model and data; the target is on it.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import subprocess
import sys
import tempfile
import threading
import time

import psutil
from rich.console import Console
from rich.table import Table

from agent.data import load_dataset
from agent.experiment import ExperimentConfig
from agent.learning import default_model, preset
from agent.runtime.decentralized import KEEP_OWN_ROUNDS
from agent.workload import build_workload
from bench.support import broker, environment, fleet_round_ends, write_json
from coordinator.emulate import Emulation, EmulationOptions

ROOT = pathlib.Path(__file__).resolve().parents[1]

TARGET_MB = 60.0
MB = 2**20
RSS = "import psutil; print(psutil.Process().memory_info().rss)"
TRAIN_SNIPPET = """
import torch
from agent.learning import build_model
torch.set_num_threads(1)
model = build_model({model!r}, {shape!r}, {classes}, seed=0)
x, y = torch.randn({batch}, *{shape!r}), torch.randint(0, {classes}, ({batch},))
for _ in range(3):
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(p.grad, alpha=-0.1)
"""


def rss_of(snippet: str, repeat: int = 3) -> int:
    """RSS (bytes) of a fresh interpreter after running `snippet`; best of `repeat`."""
    return min(
        int(
            subprocess.run(
                [sys.executable, "-c", f"{snippet}\n{RSS}"],
                check=True,
                capture_output=True,
                text=True,
                cwd=ROOT,
            ).stdout
        )
        for _ in range(repeat)
    )


class Sampler(threading.Thread):
    """RSS of every agent process of an emulation, every `period_s`, until stopped."""

    def __init__(self, emulation: Emulation, period_s: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.emulation, self.period_s = emulation, period_s
        self.samples: dict[str, list[tuple[float, int]]] = {}
        self.done = threading.Event()

    def run(self) -> None:
        handles: dict[str, psutil.Process] = {}
        while not self.done.is_set():
            for agent_id, popen in list(self.emulation.processes.items()):
                try:
                    handle = handles.setdefault(agent_id, psutil.Process(popen.pid))
                    rss = handle.memory_info().rss
                except psutil.Error:
                    continue
                self.samples.setdefault(agent_id, []).append((time.time(), rss))
            time.sleep(self.period_s)


def model_and_data_bytes(config: ExperimentConfig, roster: list[str]) -> dict[str, int]:
    dataset = load_dataset(config.dataset, seed=config.seed)
    workload = build_workload(config, roster, agents=roster[:1])
    share = workload.data[roster[0]]
    weights = sum(t.nbytes for t in workload.learner.facts.initial.values())
    neighbours = config.learning.neighbours
    copies = 7 + 2 * neighbours + KEEP_OWN_ROUNDS
    return {
        "dataset_bytes": dataset.x.nbytes + dataset.y.nbytes,
        "share_bytes": sum(t.nbytes for t in dataclasses.astuple(share)),
        "model_weight_bytes": weights,
        "model_copies": copies,
        "model_bytes": weights * copies,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--dataset", default="mnist1d")
    parser.add_argument("--model", default="", help="default: the dataset's")
    parser.add_argument("--strategy", default="dadpfl")
    parser.add_argument("--broker", default="embedded", help="embedded, mosquitto or HOST:PORT")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--out", type=pathlib.Path, default=ROOT / "bench/results/agent_memory.json"
    )
    args = parser.parse_args(argv)
    if args.agents < 2 or args.rounds < 2:
        parser.error("need --agents >= 2 and --rounds >= 2")
    config = ExperimentConfig(
        dataset=args.dataset,
        model=args.model,
        agents=args.agents,
        seed=args.seed,
        learning=preset(args.strategy, rounds=args.rounds, neighbours=min(5, args.agents - 1)),
    )
    console = Console()
    console.print("RSS after imports ...")
    torch_rss = rss_of("import torch")
    agent_rss = rss_of("import agent.cli")
    dataset = load_dataset(config.dataset, seed=config.seed)
    train_rss = rss_of(
        TRAIN_SNIPPET.format(
            model=config.model or default_model(config.dataset),
            shape=dataset.input_shape,
            classes=dataset.num_classes,
            batch=config.learning.batch_size,
        )
    )
    console.print(f"emulating {args.agents} agents x {args.rounds} rounds, sampling RSS ...")
    with tempfile.TemporaryDirectory(prefix="agent-memory-") as folder:
        workdir = pathlib.Path(folder)
        with broker(args.broker, workdir) as address:
            emulation = Emulation(config, address, EmulationOptions(workdir=workdir / "fleet"))
            sampler = Sampler(emulation)
            sampler.start()
            report = emulation.run()
            sampler.done.set()
            sampler.join()
        if report["summary"]["failed_agents"]:
            raise RuntimeError(f"agents failed: {report['summary']['failed_agents']}")
        per_agent = {}
        for agent_id in emulation.roster:
            ends = fleet_round_ends(workdir / "fleet", [agent_id])
            window = (ends[min(ends)], ends[max(ends)])
            samples = sampler.samples[agent_id]
            in_rounds = [rss for t, rss in samples if window[0] <= t <= window[1]]
            per_agent[agent_id] = {
                "rounds_peak": max(in_rounds),
                "life_peak": max(rss for _, rss in samples),
                "samples_in_rounds": len(in_rounds),
            }
    sizes = model_and_data_bytes(config, emulation.roster)
    heaviest = max(per_agent.values(), key=lambda a: a["rounds_peak"])
    model_data = sizes["dataset_bytes"] + sizes["share_bytes"] + sizes["model_bytes"]
    overhead = heaviest["rounds_peak"] - torch_rss - model_data
    met = overhead / MB <= TARGET_MB
    table = Table(title=f"agent RSS ({config.dataset}, {report['config']['learning']['strategy']})")
    table.add_column("figure")
    table.add_column("MB", justify="right")
    table.add_column("above torch, MB", justify="right")
    for label, value in (
        ("python + import torch", torch_rss),
        ("python + torch training the same model (plain loop)", train_rss),
        ("python + agent imports", agent_rss),
        ("agent during rounds (peak, heaviest agent)", heaviest["rounds_peak"]),
        ("agent whole life (peak, export included)", heaviest["life_peak"]),
    ):
        table.add_row(label, f"{value / MB:.1f}", f"{(value - torch_rss) / MB:+.1f}")
    table.add_row("model and data (generous count)", f"{model_data / MB:.2f}", "")
    table.add_row("agent overhead (rounds - torch - model and data)", "", f"{overhead / MB:.1f}")
    console.print(table)
    console.print(
        f"agent overhead {overhead / MB:.1f} MB (target <= {TARGET_MB:.0f} MB: "
        f"{'met' if met else 'NOT met'})"
    )
    write_json(
        args.out,
        {
            "config": dataclasses.asdict(config),
            "torch_import_rss": torch_rss,
            "agent_import_rss": agent_rss,
            "torch_training_rss": train_rss,
            "agents": per_agent,
            "sizes": sizes,
            "overhead_bytes": overhead,
            "target_mb": TARGET_MB,
            "target_met": met,
            "machine": environment(),
        },
    )
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
