"""One agent's round as a typed record, and the run summary.

The same `AgentRound` is what the simulator reports, what an agent writes to its round log
(`STATE_DIR/rounds.jsonl`) and publishes a digest of, and what `coordinator emulate` reads
back into the report; `summarize` and `stopped_summary` turn a run's rounds into the report's
`summary`. A report's per-agent entry is `AgentRound.report_entry()`: the figures simulate and
emulate share (emulate adds what only a network has: stragglers and waiting time).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agent.learning import Masks, Reduction, RoundResult, sparse

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
)
"""The per-agent figures of a report's round, simulate's and emulate's alike."""
NETWORKED = ("stragglers", "wait_s")
"""The figures only a networked run has, added to emulate's report."""


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
    p_k: float = 1.0
    vote: bool | None = None
    score: float | None = None
    pruned: bool = False
    stopped: bool = False
    """The agent stopped early after this round or before it."""
    limited_by: str = "none"
    """What set p_k on a device (time, energy, battery, memory), or none."""
    density_cap: float | None = None
    active_fraction: float | None = None
    throttled_s: float = 0.0
    """Seconds an emulated device slept to run at its profile's speed."""
    stragglers: list[str] = field(default_factory=list)
    wait_s: float = 0.0
    t_star: int | None = None
    finished_at: float | None = None

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
        device's alike; `figures`: what only the caller knows (traffic, waiting, t*...)."""
        return cls(
            round=round_,
            agent=agent,
            accuracy=result.accuracy,
            loss=result.loss,
            train_loss=result.train_loss,
            sparsity=reported_sparsity(result.state.masks),
            train_flops=result.train_flops,
            p_k=1.0 if p_k is None else p_k,
            vote=result.vote,
            score=result.score,
            pruned=result.pruned,
            density_cap=reduction.density_cap,
            active_fraction=reduction.active_fraction,
            **figures,
        )

    def report_entry(self, networked: bool = False) -> dict[str, Any]:
        """The agent's entry in a report's round (with `networked`, stragglers and wait)."""
        names = REPORTED + NETWORKED if networked else REPORTED
        return {name: getattr(self, name) for name in names}

    def idle(self, round_: int) -> AgentRound:
        """This agent's record in a later round after it stopped: its figures stay, it spends
        nothing."""
        return dataclasses.replace(
            self,
            round=round_,
            bytes_sent=0,
            bytes_received=0,
            nonzeros_sent=0,
            train_flops=0,
            vote=None,
            score=None,
            pruned=False,
            stragglers=[],
            wait_s=0.0,
            throttled_s=0.0,
            stopped=True,
        )

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
) -> dict[str, int]:
    """What an agent that stopped after `stop_round` saved against training to round `limit`:
    the rounds not run, and its mean training FLOPs and link bytes per round run (from its
    round `records`) times those rounds."""
    saved_rounds = limit - stop_round
    ran = max(len(records), 1)
    flops = sum(r["train_flops"] for r in records) / ran
    traffic = sum(r["bytes_sent"] + r["bytes_received"] for r in records) / ran
    return {
        "round": stop_round,
        "saved_rounds": saved_rounds,
        "saved_flops": round(flops * saved_rounds),
        "saved_bytes": round(traffic * saved_rounds),
    }


def stopped_summary(
    rounds: list[dict[str, Any]], stopped: Mapping[str, int], limit: int
) -> dict[str, dict[str, int]]:
    """Per agent stopped early: when, and what it saved (`early_stop_savings`)."""
    return {
        agent_id: early_stop_savings(
            [r["agents"][agent_id] for r in rounds[:round_]], round_, limit
        )
        for agent_id, round_ in sorted(stopped.items())
    }


def summarize(rounds: list[dict[str, Any]], t_star: int | None, wall: float) -> dict[str, Any]:
    """Run-level figures; traffic counts every byte on a device link (uploads + downloads)."""
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
    return {
        "mean_accuracy": sum(a["accuracy"] for a in final.values()) / len(final),
        "mean_sparsity": sum(a["sparsity"] for a in final.values()) / len(final),
        "busiest_agent_bytes": per_node[busiest],
        "busiest_agent": busiest,
        "total_bytes": sum(per_node.values()),
        "total_train_flops": flops,
        "wall_seconds": wall,
        "rounds": len(rounds),
        "t_star": t_star,
    }
