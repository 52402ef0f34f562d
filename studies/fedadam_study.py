"""FedAdam-SSM against FedAdam-Top and dense FedAdam (issue 17, point 2): uplink to a target
accuracy in two accountings, why the shared mask learns slower here, and the paper's setting.

    python -m studies.fedadam_study [--seeds 1,2,3] [--datasets mnist1d,digits] [--rounds 60]
        [--epochs 2] [--variants fedadam,fedadam-ssm,...] [--out bench/results/fedadam_study.json]

Every run: 20 agents, Dirichlet 0.3, lr 1e-3, alpha = 0.05, `coordinator simulate` with one
torch thread, one run at a time (the default, every variant: about 45 min on a loaded
2-core machine); runs already in --out with the same settings are reused. Variants (VARIANTS):
the three presets at bench/strategies.py's 60 rounds x 2 epochs (2 local steps per round on
digits, 3.4 on mnist1d); the same at about the paper's L = 30 local steps per round (@L30,
30 rounds); and three diagnostics sent in Top's layout (accuracy only): ssm+dense-moments
(dW under its top-k mask, dM and dV whole) and the paper's own baselines ssm-v / ssm-m (one
mask from |dV| / |dM|). A probe around local Adam records, per round: the share of the
global V that is exactly 0, the share of the weights never moved from their initial values,
the share of each agent's top-k |dW| mask on V = 0 coordinates, the mean move per local step
(in lr) there and elsewhere, and the median log10 |dW|, |dM|, |dV|.

Accountings of the uplink (agents' bytes sent, summed up to the first round whose mean
accuracy reaches the target): ours, the simulator's encoded messages; the paper's cost model
(section VII-A): per agent and round min{3kq + d, k(3q + log2 d)} bits for SSM, min{3(kq +
d), 3k(q + log2 d)} for Top, 3dq dense, q = 32 (a d-bit mask or log2(d)-bit indices,
whichever is smaller); and the same with a 32-bit index per kept value.
Targets, per seed: common = 95% of the lowest best accuracy of the three (bench/strategies.py's
rule: all three reach it); dense90 = 90% of dense FedAdam's best (inf: never reached).

Results, dated, with the commit, the machine and the command: studies/results/fedadam_study.md.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import pathlib
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.support import environment, write_json

ROOT = pathlib.Path(__file__).resolve().parents[1]

ADAMS = ("fedadam", "fedadam-top", "fedadam-ssm")
VALUE_BITS = 32
"""q, the paper's floating-point precision."""


class Probe:
    """Per-round figures of local Adam behind the V = 0 hypothesis: recorded around
    `adam.train_adam` (one call per participant) and closed at each aggregation."""

    def __init__(self, fraction: float) -> None:
        self.fraction = fraction
        self.rounds: list[dict[str, float]] = []
        self.current: list[dict[str, float]] = []
        self.steps = 0
        self.params = 0
        self.initial: Any = None

    def fit(self, m: dict, v: dict, start: dict, result: Any, lr: float) -> None:
        """One participant's round: where the global V it started from is 0, how large its
        per-step moves were there and elsewhere, where its top-k |dW| mask fell, and the
        median magnitudes of dW, dM and dV (the paper's eq. 28 assumes |dW| >> |dM| >> |dV|)."""
        import torch

        from agent.learning import adam

        names = list(v)

        def median_log10(new: dict, old: dict) -> float:
            flat = torch.cat([(new[n] - old[n]).abs().reshape(-1) for n in names])
            return float(torch.log10(flat.double().median() + 1e-30))

        zero = torch.cat([(v[n] == 0).reshape(-1) for n in names])
        flat_start = torch.cat([start[n].reshape(-1) for n in names])
        if self.initial is None:
            self.initial = flat_start.clone()
        dw = {n: result.weights[n] - start[n] for n in names}
        mask = adam.top_k_mask(dw, self.fraction)
        flat_mask = torch.cat([mask[n].reshape(-1) for n in names])
        step = torch.cat([dw[n].abs().reshape(-1) for n in names]) / (lr * max(self.steps, 1))
        self.params = zero.numel()
        self.current.append(
            {
                "v_zero": float(zero.double().mean()),
                "w_untouched": float((flat_start == self.initial).double().mean()),
                "mask_on_v_zero": float((flat_mask & zero).sum() / flat_mask.sum()),
                "step_v_zero": float(step[zero].mean()) if zero.any() else math.nan,
                "step_v_set": float(step[~zero].mean()) if (~zero).any() else math.nan,
                "steps": float(self.steps),
                "log10_dw": median_log10(result.weights, start),
                "log10_dm": median_log10(result.m, m),
                "log10_dv": median_log10(result.v, v),
            }
        )
        self.steps = 0

    def close_round(self) -> None:
        if self.current:
            keys = self.current[0]
            self.rounds.append({k: statistics.fmean(r[k] for r in self.current) for k in keys})
        self.current = []


@contextlib.contextmanager
def mask_rule(rule: str | None) -> Iterator[None]:
    """Diagnostic upload rules, run in FedAdam-Top's layout (one mask per delta, so any
    masks travel): `dense-moments` sparsifies dW with its top-k and sends dM and dV whole;
    `ssm-v` and `ssm-m` share one top-k mask of |dV| or |dM| (the paper's FedAdam-SSM_V and
    FedAdam-SSM_M baselines). Their bytes are not theirs: only accuracy is compared."""
    import torch

    from agent.learning import adam

    compress = adam.compress
    if rule is None:
        yield
        return

    def patched(dW: Any, dM: Any, dV: Any, fraction: float, mode: str) -> Any:
        ones = {n: torch.ones_like(t, dtype=torch.bool) for n, t in dW.items()}
        if rule == "dense-moments":
            masks = (adam.top_k_mask(dW, fraction), ones, ones)
        else:
            masks = (adam.top_k_mask(dV if rule == "ssm-v" else dM, fraction),) * 3
        return tuple(
            adam.SparseDelta(adam.sparsify(d, m), m)
            for d, m in zip((dW, dM, dV), masks, strict=True)
        )

    adam.compress = patched
    try:
        yield
    finally:
        adam.compress = compress


@contextlib.contextmanager
def probing(probe: Probe) -> Iterator[None]:
    """Wrap local Adam and the aggregation to feed `probe`; restored on exit."""
    from agent.learning import adam
    from agent.learning.central import fedadam

    train, step, aggregate = adam.train_adam, adam._adam_step_, fedadam.FedAdam.aggregate

    def counted_step(*a: Any, **k: Any) -> None:
        probe.steps += 1
        step(*a, **k)

    def train_probed(
        model: Any, weights: Any, m: Any, v: Any, x: Any, y: Any, config: Any, generator: Any
    ) -> Any:
        result = train(model, weights, m, v, x, y, config, generator)
        probe.fit(m, v, weights, result, config.lr)
        return result

    def aggregate_probed(self: Any, *a: Any, **k: Any) -> Any:
        probe.close_round()
        return aggregate(self, *a, **k)

    adam.train_adam, adam._adam_step_ = train_probed, counted_step
    fedadam.FedAdam.aggregate = aggregate_probed  # type: ignore[method-assign]
    try:
        yield
    finally:
        adam.train_adam, adam._adam_step_ = train, step
        fedadam.FedAdam.aggregate = aggregate  # type: ignore[method-assign]


def paper_bits(strategy: str, d: int, fraction: float) -> dict[str, float]:
    """One agent's uplink per round in the paper's cost model (section VII-A): q-bit values,
    positions as a d-bit mask or log2(d)-bit indices, whichever is smaller; and the same
    with 32-bit indices (no bitmap alternative)."""
    k = max(1, round(fraction * d))
    q, log_d = VALUE_BITS, math.ceil(math.log2(d))
    if strategy == "fedadam":
        dense = 3 * d * q
        return {"paper": dense, "index32": dense}
    if strategy == "fedadam-ssm":
        return {"paper": min(3 * k * q + d, k * (3 * q + log_d)), "index32": k * (3 * q + 32)}
    return {"paper": min(3 * (k * q + d), 3 * k * (q + log_d)), "index32": 3 * k * (q + 32)}


def run(
    dataset: str,
    strategy: str,
    seed: int,
    args: argparse.Namespace,
    over: dict,
    rule: str | None = None,
) -> dict:
    """One simulation with the probe on: accuracy and uplink per round, probe figures."""
    import torch

    from agent.experiment import ExperimentConfig
    from agent.learning import preset
    from coordinator.simulate import simulate

    torch.set_num_threads(1)
    learning = preset(strategy, **({"rounds": args.rounds, "epochs": args.epochs} | over))
    config = ExperimentConfig(
        dataset=dataset,
        agents=args.agents,
        partition=f"dirichlet:{args.dirichlet}",
        seed=seed,
        learning=learning,
    )
    probe = Probe(learning.ssm_fraction)
    started = time.perf_counter()
    with probing(probe), mask_rule(rule):
        report = simulate(config)
    rounds = report["rounds"]
    return {
        "dataset": dataset,
        "strategy": strategy,
        "seed": seed,
        "overrides": over,
        "seconds": time.perf_counter() - started,
        "params": probe.params,
        "accuracy_per_round": [
            statistics.fmean(a["accuracy"] for a in r["agents"].values()) for r in rounds
        ],
        "uplink_per_round": [sum(a["bytes_sent"] for a in r["agents"].values()) for r in rounds],
        "agents_per_round": [len(r["agents"]) for r in rounds],
        "probe": probe.rounds,
    }


L30 = {"mnist1d": {"epochs": 15, "rounds": 30}, "digits": {"epochs": 30, "rounds": 30}}
VARIANTS: dict[str, tuple[str, dict[str, dict[str, Any]], str | None]] = {
    "fedadam": ("fedadam", {}, None),
    "fedadam-top": ("fedadam-top", {}, None),
    "fedadam-ssm": ("fedadam-ssm", {}, None),
    "ssm+dense-moments": ("fedadam-top", {}, "dense-moments"),
    "ssm-v": ("fedadam-top", {}, "ssm-v"),
    "ssm-m": ("fedadam-top", {}, "ssm-m"),
    "fedadam@L30": ("fedadam", L30, None),
    "fedadam-top@L30": ("fedadam-top", L30, None),
    "fedadam-ssm@L30": ("fedadam-ssm", L30, None),
}
"""name: (preset, per-dataset overrides). @L30: about the paper's L = 30 local steps per
round (its "local epoch" is one mini-batch step, eq. 3): a digits agent holds one batch of
128 or fewer samples, a mnist1d agent about two; 30 rounds (900 steps), to bound the cost."""


def spread(values: list[float], fmt: str = "{:.3f}") -> str:
    """mean (min..max); inf where any seed never got there."""
    if not values:
        return "-"
    if any(math.isinf(v) for v in values):
        reached = sum(not math.isinf(v) for v in values)
        return f"inf ({reached}/{len(values)} reached)"
    lo, hi = min(values), max(values)
    return f"{fmt.format(statistics.fmean(values))} ({fmt.format(lo)}..{fmt.format(hi)})"


def to_target(res: dict, target: float, fraction: float) -> dict[str, float]:
    """Rounds and uplink summed up to the first round whose mean accuracy is >= target:
    encoded bytes as sent, and the paper's cost model (bits / 8) with its two index codes."""
    hit = next((i for i, a in enumerate(res["accuracy_per_round"]) if a >= target), None)
    if hit is None:
        return {"rounds": math.inf, "bytes": math.inf, "paper": math.inf, "index32": math.inf}
    bits = paper_bits(res["strategy"], res["params"], fraction)
    agents = sum(res["agents_per_round"][: hit + 1])
    return {
        "rounds": hit + 1,
        "bytes": sum(res["uplink_per_round"][: hit + 1]),
        "paper": agents * bits["paper"] / 8,
        "index32": agents * bits["index32"] / 8,
    }


def summarize(runs: list[dict], fraction: float) -> dict[str, Any]:
    """Per dataset and variant: accuracy, probe figures and, per seed, rounds and uplink to
    two targets: `common` (95% of the lowest best accuracy of the three, bench/strategies.py's
    rule, so all three reach it) and `dense90` (90% of dense FedAdam's best)."""
    out: dict[str, Any] = {}
    by = {(r["dataset"], r["name"], r["seed"]): r for r in runs}
    for dataset in sorted({r["dataset"] for r in runs}):
        seeds = sorted({s for d, _, s in by if d == dataset})
        targets: dict[str, dict[int, dict[str, float]]] = {}
        for suffix in dict.fromkeys(n.partition("@")[2] for d, n, _ in by if d == dataset):
            trio = {a: a + "@" + suffix if suffix else a for a in ADAMS}
            targets[suffix] = {}
            for seed in seeds:
                best = {
                    a: max(by[(dataset, n, seed)]["accuracy_per_round"])
                    for a, n in trio.items()
                    if (dataset, n, seed) in by
                }
                if len(best) == len(ADAMS):
                    targets[suffix][seed] = {
                        "common": 0.95 * min(best.values()),
                        "dense90": 0.9 * best["fedadam"],
                    }
        rows = {}
        for name in (n for n in VARIANTS if any(k[:2] == (dataset, n) for k in by)):
            mine = [by[(dataset, name, s)] for s in seeds if (dataset, name, s) in by]
            row: dict[str, Any] = {
                "diagnostic": VARIANTS[name][2] is not None,
                "seeds": [r["seed"] for r in mine],
                "final": [r["accuracy_per_round"][-1] for r in mine],
                "best": [max(r["accuracy_per_round"]) for r in mine],
                "uplink_per_round": [statistics.fmean(r["uplink_per_round"]) for r in mine],
            }
            goals = targets[name.partition("@")[2]]
            for goal in ("common", "dense90"):
                row[goal] = [
                    to_target(r, goals[r["seed"]][goal], fraction)
                    for r in mine
                    if r["seed"] in goals
                ]
            probes = [r["probe"] for r in mine if r["probe"]]
            if probes:
                row["probe"] = {
                    key: [
                        statistics.fmean(p[i][key] for p in probes) for i in range(len(probes[0]))
                    ]
                    for key in probes[0][0]
                }
            rows[name] = row
        out[dataset] = {"targets": targets, "rows": rows}
    return out


def _mean(values: list[float]) -> float:
    """The mean of the values that are numbers (a probe figure is nan where undefined)."""
    numbers = [v for v in values if not math.isnan(v)]
    return statistics.fmean(numbers) if numbers else math.nan


def _ratio(top: float, ssm: float) -> float:
    """top / ssm, where a target never reached costs infinitely much (nan: neither did)."""
    if math.isinf(top) and math.isinf(ssm):
        return math.nan
    return math.inf if math.isinf(top) else top / ssm


def claim(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The paper's claim per dataset, setting and target: FedAdam-Top's uplink to the
    target over FedAdam-SSM's, per seed, in our bytes and in the paper's cost model (the
    paper: 1.1x to 5.6x); shown, per accounting, where SSM needs less in every seed."""
    out = []
    for dataset, found in summary.items():
        rows = found["rows"]
        for ssm in (n for n in rows if n.startswith("fedadam-ssm")):
            top = ssm.replace("fedadam-ssm", "fedadam-top")
            if top not in rows:
                continue
            for goal in ("common", "dense90"):
                pairs = list(zip(rows[top][goal], rows[ssm][goal], strict=True))
                ratio = {k: [_ratio(t[k], s[k]) for t, s in pairs] for k in ("bytes", "paper")}
                known = {k: [r for r in ratio[k] if not math.isnan(r)] for k in ratio}
                out.append(
                    {
                        "dataset": dataset,
                        "setting": ssm.partition("@")[2] or "bench",
                        "target": goal,
                        "top_over_ssm": ratio,
                        "shown": {k: bool(v) and all(r > 1 for r in v) for k, v in known.items()},
                    }
                )
    return out


def finite(data: Any) -> Any:
    """`data` with every infinity (a target never reached) as None, for strict JSON."""
    if isinstance(data, dict):
        return {k: finite(v) for k, v in data.items()}
    if isinstance(data, list):
        return [finite(v) for v in data]
    return None if isinstance(data, float) and math.isinf(data) else data


def tables(summary: dict[str, Any], console: Console) -> None:
    """Print what `summarize` found: accuracy and uplink to target, then the probe."""
    for dataset, found in summary.items():
        table = Table(
            title=f"{dataset}: accuracy and uplink to target (mean (min..max) over seeds)"
        )
        for column in (
            "variant",
            "final acc",
            "best acc",
            "uplink/round KB",
            "target",
            "rounds",
            "our MB",
            "paper-model MB",
            "32-bit-index MB",
        ):
            table.add_column(column, justify="left" if column == "variant" else "right")
        for name, row in found["rows"].items():
            # a diagnostic rule travels in Top's layout: its bytes are not its own
            mb = "-" if row["diagnostic"] else "{:.2f}"
            for goal in ("common", "dense90"):
                hits = row[goal]
                first = goal == "common"
                table.add_row(
                    name if first else "",
                    spread(row["final"]) if first else "",
                    spread(row["best"]) if first else "",
                    spread([u / 1e3 for u in row["uplink_per_round"]], "{:.1f}")
                    if first and not row["diagnostic"]
                    else "",
                    goal,
                    spread([h["rounds"] for h in hits], "{:.1f}"),
                    *(
                        spread([h[k] / 1e6 for h in hits], mb) if mb != "-" else "-"
                        for k in ("bytes", "paper", "index32")
                    ),
                )
        console.print(table)
        probe = Table(title=f"{dataset}: where the global V is 0 (seed mean; r = after round r)")
        for column in (
            "variant",
            "V=0 r1",
            "r5",
            "last",
            "W never moved",
            "mask on V=0",
            "step/lr V=0",
            "step/lr V>0",
            "log10 |dW|,|dM|,|dV|",
            "local steps",
        ):
            probe.add_column(column, justify="left" if column == "variant" else "right")
        for name, row in found["rows"].items():
            p = row.get("probe")
            if not p:
                continue
            late = slice(5, None)  # rounds 6 on: past the first rounds' transient
            last = len(p["v_zero"]) - 1
            probe.add_row(
                name,
                *(f"{p['v_zero'][min(i, last)]:.3f}" for i in (1, 5, last)),
                f"{p['w_untouched'][last]:.3f}" if "w_untouched" in p else "-",
                *(
                    f"{_mean(p[k][late]):.3f}"
                    for k in ("mask_on_v_zero", "step_v_zero", "step_v_set")
                ),
                ", ".join(
                    f"{_mean(p.get(k, [math.nan])[late]):.1f}"
                    for k in ("log10_dw", "log10_dm", "log10_dv")
                ),
                f"{statistics.fmean(p['steps']):.1f}",
            )
        console.print(probe)
    print_claim(summary, console)


def print_claim(summary: dict[str, Any], console: Console) -> None:
    """The claim table: Top's uplink to target over SSM's, per seed, both accountings."""
    verdict = Table(
        title="the paper's claim: Top's uplink to target / SSM's, per seed (>1: SSM less)"
    )
    for column in (
        "dataset",
        "setting",
        "target",
        "our bytes",
        "paper model",
        "shown (ours, paper)",
    ):
        verdict.add_column(column)
    for c in claim(summary):
        verdict.add_row(
            c["dataset"],
            c["setting"],
            c["target"],
            *(
                ", ".join("-" if math.isnan(r) else f"{r:.2f}" for r in c["top_over_ssm"][k])
                for k in ("bytes", "paper")
            ),
            ", ".join("yes" if c["shown"][k] else "NO" for k in ("bytes", "paper")),
        )
    console.print(verdict)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--datasets", default="mnist1d,digits")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--agents", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--dirichlet", type=float, default=0.3)
    parser.add_argument(
        "--out", type=pathlib.Path, default=ROOT / "bench/results/fedadam_study.json"
    )
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    datasets = [d for d in args.datasets.split(",") if d]
    variants = [v for v in args.variants.split(",") if v]
    console = Console(width=None if sys.stdout.isatty() else 160)
    done = {}
    if args.out.exists():  # resume: keep the runs of the same settings already measured
        import json

        old = json.loads(args.out.read_text())
        same = ("agents", "rounds", "epochs", "dirichlet")
        if all(old["args"].get(k) == getattr(args, k) for k in same):
            done = {(r["dataset"], r["name"], r["seed"]): r for r in old.get("runs", [])}
    started = time.perf_counter()
    for dataset in datasets:
        for name in variants:
            strategy, per_dataset, rule = VARIANTS[name]
            for seed in seeds:
                if (dataset, name, seed) in done:
                    continue
                res = run(dataset, strategy, seed, args, per_dataset.get(dataset, {}), rule)
                res["name"] = name
                done[(dataset, name, seed)] = res
                console.print(
                    f"{dataset} {name} seed {seed}: accuracy {res['accuracy_per_round'][-1]:.4f} "
                    f"({res['seconds']:.0f} s)"
                )
                write_json(
                    args.out,
                    {
                        "args": {k: v for k, v in vars(args).items() if k != "out"},
                        "runs": list(done.values()),
                        "machine": environment(),
                    },
                )
    summary = summarize(list(done.values()), 0.05)
    tables(summary, console)
    write_json(
        args.out,
        {
            "args": {k: v for k, v in vars(args).items() if k != "out"},
            "runs": list(done.values()),
            "summary": finite(summary),
            "claim": finite(claim(summary)),
            "machine": environment(),
        },
    )
    console.print(f"wall time {time.perf_counter() - started:.0f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
