"""When each round of a synchronous simulated run would end on a fleet that comes and goes.

`simulate` computes a synchronous run's numbers without a clock: they do not depend on
when anything happens. A run with availability (`--availability`, a profile's
`[availability]`) also wants its timing, for time-to-accuracy; this places every agent's
rounds on the virtual clock (`coordinator.virtual_clock`) from what the report already holds
(each round's FLOPs and bytes), the way the synchronous agents wait in `emulate`:

- decentralized: an agent's round starts once it has finished its previous round and has
  every model it needs (its prior neighbours' of this round, its posterior ones' of the
  last: `RoundTopology.needs`, stopped agents left out); its work then takes the clock's
  seconds, progressing only while it is online;
- centralized: a round starts when the last one's last upload arrived (aggregation and
  downloads take no time of their own); each participant's work starts then.

Not modelled (emulate's waits with timeouts): a synchronous agent in `emulate` waits for a
neighbour or a participant at most `--round-timeout` and goes on without it (a straggler);
here every agent waits for every model it needs however long its sender sleeps, so a run
whose devices sleep longer than the timeout is slower here than in emulate, and its
numbers (which the stragglers change) are emulate's only when no one straggles.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from agent.experiment import ExperimentConfig
from agent.learning import RoundTopology, live, running
from agent.learning.central.server import participants
from agent.learning.strategies import strategy
from coordinator.virtual_clock import VirtualClock


class SynchronousRun(Protocol):
    """What this reads of a simulated run (`coordinator.simulate.Simulation`)."""

    config: ExperimentConfig

    @property
    def stopped(self) -> Mapping[str, int]:
        """Agent -> the round after which it stopped."""

    @property
    def centralized(self) -> bool: ...


def on_virtual_clock(report: dict[str, Any], run: SynchronousRun) -> dict[str, Any]:
    """`report` of `run`, its rounds placed on the virtual clock when some device of the
    synchronous run comes and goes (`stamp_virtual_times`); as it is otherwise (an
    asynchronous run's rounds were placed on it as they ran: `coordinator.async_rounds`,
    FedBuff's `coordinator.buffered_sim`)."""
    clock = VirtualClock.of(run.config, report["config"]["roster"])
    learning = run.config.learning
    asynchronous = learning.asynchronous or strategy(learning.strategy).buffered
    if clock.comes_and_goes and not asynchronous:
        stamp_virtual_times(report, run.config, run.stopped, clock, run.centralized)
    return report


def stamp_virtual_times(
    report: dict[str, Any],
    config: ExperimentConfig,
    stopped: Mapping[str, int],
    clock: VirtualClock,
    centralized: bool,
) -> None:
    """Fill each agent's `finished_at` in `report`'s rounds with virtual seconds since the
    run began, and the summary's `virtual_s` with the last; an agent that did not train in
    a round keeps the time it last finished."""
    roster = report["config"]["roster"]
    rounds = report["rounds"]
    if centralized:
        ends = _centralized(rounds, roster, stopped, clock)
    else:
        ends = _decentralized(rounds, config, roster, stopped, clock)
    for record in rounds:
        for agent, entry in record["agents"].items():
            entry["finished_at"] = round(ends[record["round"], agent], 6)
    report["summary"]["virtual_s"] = round(max(ends.values()), 6)


def _seconds(clock: VirtualClock, agent: str, entry: Mapping[str, Any]) -> float:
    """The modelled seconds of an agent's round from its report entry."""
    flops = entry["train_flops"] + (entry.get("fallback_flops") or 0)
    return clock.seconds(agent, flops, entry["bytes_sent"] + entry["bytes_received"])


def _decentralized(
    rounds: list[dict[str, Any]],
    config: ExperimentConfig,
    roster: list[str],
    stopped: Mapping[str, int],
    clock: VirtualClock,
) -> dict[tuple[int, str], float]:
    ends = {(0, agent): 0.0 for agent in roster}
    for record in rounds:
        t = record["round"]
        topology = RoundTopology(config.seed, t, roster, config.learning)
        for agent in topology.order:
            if not running(agent, t, stopped):
                ends[t, agent] = ends[t - 1, agent]
                continue
            needs = live(topology.needs(agent), stopped)
            start = max([ends[t - 1, agent], *(ends[need] for need in needs)])
            seconds = _seconds(clock, agent, record["agents"][agent])
            ends[t, agent] = clock.finish(agent, start, seconds)
    return ends


def _centralized(
    rounds: list[dict[str, Any]],
    roster: list[str],
    stopped: Mapping[str, int],
    clock: VirtualClock,
) -> dict[tuple[int, str], float]:
    ends = {(0, agent): 0.0 for agent in roster}
    begins = 0.0
    for record in rounds:
        t = record["round"]
        taking_part = set(participants(roster, t, stopped))
        for agent in roster:
            if agent in taking_part:
                seconds = _seconds(clock, agent, record["agents"][agent])
                ends[t, agent] = clock.finish(agent, begins, seconds)
            else:
                ends[t, agent] = ends[t - 1, agent]
        begins = max([begins, *(ends[t, agent] for agent in taking_part)])
    return ends
