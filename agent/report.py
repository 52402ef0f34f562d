"""One agent's round as a typed record, and the run summary.

The same `AgentRound` is what the simulator reports, what an agent writes to its round log
(`STATE_DIR/rounds.jsonl`) and publishes a digest of, and what `coordinator emulate` reads
back into the report; `summarize` and `stopped_summary` turn a run's rounds into the report's
`summary`. A report's per-agent entry is `AgentRound.report_entry()`: the figures simulate and
emulate share (emulate adds what only a network has: stragglers and waiting time).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from agent.device.throttle import ENERGY_SOURCE
from agent.learning import Fit, Judged, Masks, Reduction, RoundResult, sparse
from agent.learning.central.participant import Turn
from agent.learning.tasks import Task

COORDINATOR = "coordinator"
"""The coordinator's name in the traffic figures of centralized runs."""

REPORTED = (
    "accuracy",
    "loss",
    "train_loss",
    "sparsity",
    "bytes_sent",
    "bytes_received",
    "nonzeros_sent",
    "train_flops",
    "p_k",
    "vote",
    "score",
    "pruned",
    "stopped",
    "energy_j",
    "radio_energy_j",
    "kept",
    "strategy_accuracy",
    "fallback_flops",
    "epsilon",
    "stop_reason",
    "staleness",
    "finished_at",
    "screened",
    "clipped",
)
"""The per-agent figures of a report's round, simulate's and emulate's alike (`finished_at`:
emulate's Unix seconds, None in simulate until its virtual clock stamps it)."""
NETWORKED = (
    "stragglers",
    "quarantined",
    "wait_s",
    "reduction",
    "reduction_why",
    "train_s",
    "predicted_s",
    "peak_memory_mb",
)
"""The figures only a networked run has, added to emulate's report."""


def reported_p_k(p_k: float | None, budgets: bool) -> float | None:
    """The p_k a round's record carries: under a strategy that `budgets` (its table's trait),
    the budget its round was cut to (1.0 without a measured one); under one that trains the
    full model whatever the device affords (FedAvg, FedAdam, DFedAvgM...), None: FedSPU's
    static tiers or a device's budget there would be a figure the round never followed."""
    if not budgets:
        return None
    return 1.0 if p_k is None else p_k


@dataclass
class Traffic:
    """Bytes and nonzeros one node put on, and took off, its link in one round."""

    sent: int = 0
    received: int = 0
    nonzeros_sent: int = 0


@dataclass
class AgentRound:
    """One agent's round: what it learned, what it spent, what it decided."""

    round: int
    agent: str
    accuracy: float
    loss: float
    train_loss: float | None
    sparsity: float
    bytes_sent: int = 0
    bytes_received: int = 0
    nonzeros_sent: int = 0
    train_flops: int = 0
    p_k: float | None = 1.0
    """The budget the round was cut to (1: none, it trained whole); None under a strategy
    that budgets nothing (`reported_p_k`)."""
    vote: bool | None = None
    score: float | None = None
    pruned: bool = False
    stopped: bool = False
    """The agent stopped early after this round or before it."""
    limited_by: str = "none"
    """What set p_k on a device (time, energy, battery, memory), or none."""
    density_cap: float | None = None
    """The density a pruned round was capped to (`ReductionKind.figures`: prune's)."""
    active_fraction: float | None = None
    """The fraction of the neurons a frozen round trained (freeze's)."""
    throttled_s: float = 0.0
    """Seconds an emulated device slept to run at its profile's speed."""
    stragglers: list[str] = field(default_factory=list)
    quarantined: list[str] = field(default_factory=list)
    """Senders this agent stopped listening to for the run after their invalid models
    (agent/runtime/quarantine.py)."""
    screened: list[str] = field(default_factory=list)
    """Senders whose models this agent's defence (`--clip`) screened out this round: a
    stand-in took their place in its aggregate (`agent.learning.screening`). A centralized
    round's uploads the aggregator screened are the round's own `screened`."""
    clipped: list[str] = field(default_factory=list)
    """Senders whose models it clipped (pulled in to its bound) this round."""
    wait_s: float = 0.0
    staleness: float | None = None
    """Asynchronous rounds: how many rounds stale what this round took in was, on average
    (the neighbours' models it aggregated; under FedBuff its own update when the aggregator
    applied it); None in a synchronous round (`agent.learning.staleness`)."""
    t_star: int | None = None
    finished_at: float | None = None
    energy_j: float | None = None
    """Training energy above idle [J] on the agent's profile; None without a profile
    (`agent.device.throttle`: equal in simulate and emulate)."""
    radio_energy_j: float | None = None
    """Energy [J] of the round's bytes on the profile's radio; None without a profile."""
    energy_source: str | None = None
    """How the energy figures were obtained ("modelled" from the profile), None without."""
    reduction: str = "none"
    """What the budget made the round do (`agent.learning.reduction.Reduction.label`)."""
    reduction_why: str = ""
    """The choice of a measured reduction and why (empty under the FLOP rules)."""
    train_s: float | None = None
    """Seconds the round's computation took by the device's clock (an emulated board's:
    the host's time and the throttle's sleep); None in the simulator."""
    predicted_s: float | None = None
    """What the measured cost table predicted for it; None without a table."""
    peak_memory_mb: float | None = None
    """The round's peak training memory [MiB]: the first step's saved activations and the
    trained model's weights, gradients and momentum (`agent.device.calibration`)."""
    kept: str = ""
    """The model the agent keeps and serves after the round (`agent.learning.fallback`):
    personal, fleet or local; `accuracy` and `loss` are its figures."""
    kept_why: str = ""
    """Why: each candidate's validation metric."""
    strategy_accuracy: float | None = None
    """The metric of the strategy's own model (before the agent's choice)."""
    fallback_flops: int = 0
    """Training FLOPs of the agent's local-only model this round (`--fallback local`),
    apart from `train_flops`, the strategy's."""
    epsilon: float | None = None
    """The agent's epsilon at `--dp-delta` over every DP step of the run so far (`--dp
    sample`: its DP-SGD steps; `--dp client`: the rounds it uploaded in, each a noised
    release; `agent.learning.privacy`); None without DP."""
    stop_reason: str = ""
    """Why the agent stopped after this round, when not early stopping's rule: its privacy
    budget spent (`--max-epsilon`)."""

    def judged_as(self, judged: Judged | None) -> AgentRound:
        """This record with what the agent kept (`fallback.judge`): the kept model's figures
        and the strategy's model's metric beside them; unchanged without a judgement."""
        if judged is None:
            return self
        return dataclasses.replace(
            self,
            accuracy=judged.metric,
            loss=judged.loss,
            kept=judged.kept.name,
            kept_why=judged.kept.reason,
            strategy_accuracy=judged.strategy_metric,
            fallback_flops=judged.fallback_flops,
        )

    @classmethod
    def of_result(
        cls,
        round_: int,
        agent: str,
        result: RoundResult,
        reduction: Reduction,
        p_k: float | None,
        **figures: Any,
    ) -> AgentRound:
        """The record of a decentralized round from what it computed, the simulator's and a
        device's alike (`p_k`: as `reported_p_k` gives it); `figures`: what only the caller
        knows (traffic, waiting, t*...)."""
        return cls(
            round=round_,
            agent=agent,
            accuracy=result.accuracy,
            loss=result.loss,
            train_loss=result.train_loss,
            sparsity=reported_sparsity(result.state.masks),
            train_flops=result.train_flops,
            p_k=p_k,
            vote=result.vote,
            score=result.score,
            pruned=result.pruned,
            epsilon=result.epsilon,
            screened=list(result.screening.screened),
            clipped=list(result.screening.clipped),
            reduction=reduction.label,
            reduction_why=reduction.why,
            **reduction.figures(),
            **figures,
        ).judged_as(result.judged)

    def report_entry(self, networked: bool = False) -> dict[str, Any]:
        """The agent's entry in a report's round (with `networked`, stragglers and wait)."""
        names = REPORTED + NETWORKED if networked else REPORTED
        return {name: getattr(self, name) for name in names}

    def idle(self, round_: int) -> AgentRound:
        """This agent's record in a later round after it stopped: its figures stay, it spends
        nothing and takes nothing in (no staleness)."""
        return dataclasses.replace(
            self,
            round=round_,
            bytes_sent=0,
            bytes_received=0,
            nonzeros_sent=0,
            train_flops=0,
            fallback_flops=0,
            vote=None,
            score=None,
            pruned=False,
            stragglers=[],
            quarantined=[],
            screened=[],
            clipped=[],
            wait_s=0.0,
            throttled_s=0.0,
            stopped=True,
            staleness=None,
            energy_j=None if self.energy_j is None else 0.0,
            radio_energy_j=None if self.radio_energy_j is None else 0.0,
        )

    @classmethod
    def of_fit(
        cls, turn: Turn, fit: Fit, judged: Judged, budgets: bool, **figures: Any
    ) -> AgentRound:
        """The record of a centralized participant's round, the simulator's and a device's
        alike: the figures of the model it keeps (`judged`), its fit's training, the p_k of
        its `turn` as `reported_p_k` gives it under a strategy that `budgets`; `figures`: what
        only the caller knows (traffic, waiting, stragglers...)."""
        return cls(
            round=turn.round,
            agent=turn.agent,
            accuracy=judged.metric,
            loss=judged.loss,
            train_loss=fit.train_loss,
            sparsity=reported_sparsity(fit.state.masks),
            train_flops=fit.train_flops,
            p_k=reported_p_k(turn.p_k, budgets),
            epsilon=fit.epsilon,
            **figures,
        ).judged_as(judged)

    def as_dict(self) -> dict[str, Any]:
        """The record as the round log stores it."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AgentRound:
        """A record read back from a round log (fields it does not know are left out)."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def reported_sparsity(masks: Masks | None) -> float:
    """A model's sparsity as reports give it: 0 for a dense model (no masks)."""
    return sparse.sparsity(masks) if masks else 0.0


def early_stop_savings(
    records: list[Mapping[str, Any]], stop_round: int, limit: int
) -> dict[str, Any]:
    """What an agent that stopped after `stop_round` saved against training to round `limit`:
    the rounds not run, and its mean training FLOPs, link bytes and training energy per round
    run (from its round `records`) times those rounds; energy is None without a profile."""
    saved_rounds = limit - stop_round
    ran = max(len(records), 1)
    flops = sum(r["train_flops"] for r in records) / ran
    traffic = sum(r["bytes_sent"] + r["bytes_received"] for r in records) / ran
    energy = _total(r.get("energy_j") for r in records)
    return {
        "round": stop_round,
        "saved_rounds": saved_rounds,
        "saved_flops": round(flops * saved_rounds),
        "saved_bytes": round(traffic * saved_rounds),
        "saved_energy_j": None if energy is None else energy / ran * saved_rounds,
    }


def _mean(figures: Iterable[float | None]) -> float | None:
    """The mean of the figures that exist; None when none does."""
    known = [f for f in figures if f is not None]
    return sum(known) / len(known) if known else None


def _total(figures: Iterable[float | None]) -> float | None:
    """The sum of the figures that exist; None when none does (no profile, no energy)."""
    known = [f for f in figures if f is not None]
    return sum(known) if known else None


def stopped_summary(
    rounds: list[dict[str, Any]], stopped: Mapping[str, int], limit: int
) -> dict[str, dict[str, Any]]:
    """Per agent stopped early: when, what it saved (`early_stop_savings`), and why when not
    by early stopping's rule (its privacy budget spent)."""
    summary = {}
    for agent_id, round_ in sorted(stopped.items()):
        records = [r["agents"][agent_id] for r in rounds[:round_]]
        summary[agent_id] = early_stop_savings(records, round_, limit)
        if records and records[-1].get("stop_reason"):
            summary[agent_id]["reason"] = records[-1]["stop_reason"]
    return summary


def summarize(rounds: list[dict[str, Any]], t_star: int | None, wall: float) -> dict[str, Any]:
    """Run-level figures; traffic counts every byte on a device link (uploads + downloads).
    The final figures are over the agents in the last round (`agents_reported`): an agent
    that died before it is not there, and a mean over the rest must say so."""
    final = rounds[-1]["agents"]
    per_node: dict[str, int] = {}
    flops = 0
    for record in rounds:
        for k, a in record["agents"].items():
            per_node[k] = per_node.get(k, 0) + a["bytes_sent"] + a["bytes_received"]
            flops += a["train_flops"]
        if "coordinator" in record:
            c = record["coordinator"]
            per_node[COORDINATOR] = per_node.get(COORDINATOR, 0) + c["sent"] + c["received"]
    busiest = max(per_node, key=per_node.__getitem__)
    kept: dict[str, int] = {}
    for entry in final.values():
        if entry.get("kept"):
            kept[entry["kept"]] = kept.get(entry["kept"], 0) + 1
    return {
        "mean_accuracy": sum(a["accuracy"] for a in final.values()) / len(final),
        "mean_strategy_accuracy": _mean(a.get("strategy_accuracy") for a in final.values()),
        "mean_sparsity": sum(a["sparsity"] for a in final.values()) / len(final),
        "busiest_agent_bytes": per_node[busiest],
        "busiest_agent": busiest,
        "total_bytes": sum(per_node.values()),
        "total_train_flops": flops,
        "total_fallback_flops": sum(
            a.get("fallback_flops", 0) for r in rounds for a in r["agents"].values()
        ),
        "kept": kept,
        "wall_seconds": wall,
        "rounds": len(rounds),
        "agents_reported": len(final),
        "t_star": t_star,
        **energy_summary(rounds),
        **privacy_summary(rounds),
        **staleness_summary(rounds),
        **defence_summary(rounds),
    }


def screened_uploads(screened: Iterable[str], clipped: Iterable[str]) -> dict[str, list[str]]:
    """A centralized round's own figures of the aggregator's defence (`--clip`): the uploads
    it screened out and those it clipped, simulate's and emulate's alike."""
    return {"screened": sorted(screened), "clipped": sorted(clipped)}


def defence_summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """How many received models the defence (`--clip`) screened out and clipped over the run
    (a centralized round's uploads, the models each agent received in a decentralized one),
    in all and per sender; nothing when it touched none, so such a run's summary is
    unchanged."""
    verdicts = [r for r in rounds if "screened" in r]
    verdicts += [a for r in rounds for a in r["agents"].values()]
    by_sender: dict[str, dict[str, int]] = {}
    for verdict in verdicts:
        for kind in ("screened", "clipped"):
            for sender in verdict.get(kind, []):
                counts = by_sender.setdefault(sender, {"screened": 0, "clipped": 0})
                counts[kind] += 1
    if not by_sender:
        return {}
    return {
        "defence": {
            "screened": sum(c["screened"] for c in by_sender.values()),
            "clipped": sum(c["clipped"] for c in by_sender.values()),
            "by_sender": dict(sorted(by_sender.items())),
        }
    }


def staleness_summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Under asynchronous rounds: how stale what the agents took in was, over the run and
    per agent (mean and max of its rounds' `staleness`); nothing when no round has one, so a
    synchronous run's summary is unchanged."""
    by_agent: dict[str, list[float]] = {}
    for record in rounds:
        for k, a in record["agents"].items():
            if a.get("staleness") is not None:
                by_agent.setdefault(k, []).append(a["staleness"])
    if not by_agent:
        return {}
    every = [s for figures in by_agent.values() for s in figures]
    return {
        "staleness": {
            "mean": sum(every) / len(every),
            "max": max(every),
            "by_agent": {
                k: {"mean": sum(figures) / len(figures), "max": max(figures)}
                for k, figures in sorted(by_agent.items())
            },
        }
    }


def privacy_summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Under `--dp`: the largest epsilon any agent reached (under `--dp sample` the fleet's
    guarantee is its weakest member's; under `--dp client` it is the run's) and each agent's
    latest; nothing without DP, so a plain run's summary is unchanged."""
    latest: dict[str, float] = {}
    for record in rounds:
        for k, a in record["agents"].items():
            if a.get("epsilon") is not None:
                latest[k] = a["epsilon"]
    if not latest:
        return {}
    return {"max_epsilon": max(latest.values()), "epsilon_by_agent": latest}


def energy_summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's energy: training energy in total and per agent, radio energy in total, and
    where the figures come from; None (and no agents) when no agent has a profile."""
    by_agent: dict[str, float] = {}
    for record in rounds:
        for k, a in record["agents"].items():
            if a.get("energy_j") is not None:
                by_agent[k] = by_agent.get(k, 0.0) + a["energy_j"]
    radio = _total(a.get("radio_energy_j") for r in rounds for a in r["agents"].values())
    return {
        "total_energy_j": sum(by_agent.values()) if by_agent else None,
        "total_radio_energy_j": radio,
        "energy_by_agent": by_agent or None,
        "energy_source": ENERGY_SOURCE if by_agent else None,
    }


def honest_summary(rounds: list[dict[str, Any]], attackers: Iterable[str]) -> dict[str, Any]:
    """Under attack (`--attackers`): the attackers, and the final mean accuracy over the
    honest agents alone (an attacker's own model says nothing of what the fleet learned);
    empty without attackers, so a clean run's summary is unchanged."""
    bad = sorted(attackers)
    if not bad or not rounds:
        return {}
    final = rounds[-1]["agents"]
    honest = [a["accuracy"] for k, a in final.items() if k not in bad]
    return {
        "attackers": bad,
        "honest_mean_accuracy": sum(honest) / len(honest) if honest else None,
    }


def named_for_task(report: dict[str, Any], task: Task) -> dict[str, Any]:
    """The report with its metric named for the run's task: a run whose metric is not
    accuracy (regression's mae, reconstruction_error, a custom metric) reports each agent's
    figure under that name, the summary's means as mean_NAME, and says which name and
    direction in summary.metric. A classification run's report is left as it was."""
    name = task.metric_name
    if name == "accuracy" and task.higher_is_better:
        return report
    keys = {"accuracy": name, "strategy_accuracy": f"strategy_{name}"}
    for record in report["rounds"]:
        record["agents"] = {
            agent: {keys.get(key, key): value for key, value in entry.items()}
            for agent, entry in record["agents"].items()
        }
    summary = report["summary"]
    renamed = {
        "mean_accuracy": f"mean_{name}",
        "mean_strategy_accuracy": f"mean_strategy_{name}",
        "honest_mean_accuracy": f"honest_mean_{name}",
    }
    report["summary"] = {renamed.get(key, key): value for key, value in summary.items()}
    report["summary"]["metric"] = {"name": name, "higher_is_better": task.higher_is_better}
    return report


def metric_of(report: Mapping[str, Any]) -> tuple[str, bool]:
    """(name, higher is better) of a report's metric: accuracy unless `named_for_task` said
    otherwise."""
    metric = report.get("summary", {}).get("metric") or {}
    return str(metric.get("name", "accuracy")), bool(metric.get("higher_is_better", True))
