"""PNG plots of a run report: what a researcher looks at first."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from agent.report import metric_of  # noqa: E402


def _mean(record: dict[str, Any], key: str) -> float:
    agents = record["agents"].values()
    return sum(a[key] for a in agents) / len(agents)


def write_plots(report: dict[str, Any], folder: str | Path) -> list[Path]:
    """Accuracy and sparsity per round, accuracy against cumulative bytes on the wire, and,
    when the agents have profiles, each agent's cumulative energy (`energy.png`)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rounds = report["rounds"]
    t = [r["round"] for r in rounds]
    metric, _ = metric_of(report)
    accuracy = [_mean(r, metric) for r in rounds]
    sparsity = [_mean(r, "sparsity") for r in rounds]
    cumulative, total = [], 0
    for r in rounds:
        total += sum(a["bytes_sent"] + a["bytes_received"] for a in r["agents"].values())
        total += sum(r.get("coordinator", {}).get(k, 0) for k in ("sent", "received"))
        cumulative.append(total / 1e6)
    name = report["config"]["learning"]["strategy"]
    written = []
    for filename, x, y, xlabel, ylabel in (
        (f"{metric}.png", t, accuracy, "round", f"mean personalized test {metric}"),
        ("sparsity.png", t, sparsity, "round", "mean sparsity"),
        (f"{metric}_vs_bytes.png", cumulative, accuracy, "cumulative traffic (MB)", metric),
    ):
        figure, axes = plt.subplots(figsize=(6, 4))
        axes.plot(x, y, marker="." if len(x) < 60 else None, label=name)
        axes.set_xlabel(xlabel)
        axes.set_ylabel(ylabel)
        axes.grid(alpha=0.3)
        axes.legend()
        figure.tight_layout()
        path = folder / filename
        figure.savefig(path, dpi=120)
        plt.close(figure)
        written.append(path)
    if any(a.get("energy_j") is not None for r in rounds for a in r["agents"].values()):
        written.append(_energy_plot(rounds, folder / "energy.png"))
    return written


def _energy_plot(rounds: list[dict[str, Any]], path: Path) -> Path:
    """Each agent's cumulative training energy over rounds (solid) and with its radio's
    (dashed): a weak board climbs steeply, an agent that stopped early levels off."""
    figure, axes = plt.subplots(figsize=(6, 4))
    agents = sorted({k for r in rounds for k in r["agents"]})
    for k in agents:
        t, training, total = [], [], []
        spent = radio = 0.0
        for r in rounds:
            a = r["agents"].get(k)
            if a is None or a.get("energy_j") is None:
                continue
            spent += a["energy_j"]
            radio += a.get("radio_energy_j") or 0.0
            t.append(r["round"])
            training.append(spent)
            total.append(spent + radio)
        (line,) = axes.plot(t, training, marker="." if len(t) < 60 else None, label=k)
        axes.plot(t, total, linestyle="--", color=line.get_color())
    axes.set_xlabel("round")
    axes.set_ylabel("cumulative energy above idle (J, modelled)")
    axes.set_title("training (solid), with radio (dashed)")
    axes.grid(alpha=0.3)
    if len(agents) <= 12:
        axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
