"""Time to target accuracy: when, in seconds since a run's start, its fleet first got there.

What an asynchronous round buys is time, not rounds (a fleet that never waits for its slow
or sleeping members runs more rounds in the same seconds), so a report says when the fleet's
mean kept-model accuracy first reached a target. The fleet's accuracy at a moment is the
mean of every agent's latest round finished by then (`AgentRound.finished_at`), once every
agent of the run has finished one: before that it is no fleet's figure. An entry without a
time stamp in a report that has them is an agent that had finished nothing yet (FedBuff's
device that has not delivered an update: its entry is the model it started with), so it
counts from the start. The target is
`--target-accuracy` when given; without it, the run's own final fleet accuracy less
`TOLERANCE` (half a point): how long the run took to get, in effect, where it ended.

Seconds are on the clock of the records' `finished_at`, from `started_at` on the same
clock: Unix seconds from the run's start in `coordinator emulate` and `coordinator run`,
virtual seconds from 0 in `simulate` (where its virtual clock stamps its records). A report
whose records have no `finished_at` has no time (None). For a metric where lower is better
(mae, reconstruction_error), "reaches" is "falls to" and the tolerance is added. Plain data
and no torch: `coordinator run` applies a target after the run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

TOLERANCE = 0.005
"""Without a target: how far (in the metric's units; half a point of accuracy) below the
run's final fleet accuracy counts as there."""


def stamped(rounds: Sequence[Mapping[str, Any]]) -> bool:
    """Whether the records of `rounds` say when they finished (some do)."""
    return any(a.get("finished_at") is not None for r in rounds for a in r["agents"].values())


def reached_at(
    rounds: Sequence[Mapping[str, Any]],
    target: float,
    higher_is_better: bool = True,
    started_at: float = 0.0,
) -> tuple[float, int] | None:
    """(the `finished_at`, round) of the first record after which the fleet's mean metric
    reached `target`; None if it never did, or if the records are not `stamped` (one
    without a stamp in a stamped report: at `started_at`, module docstring)."""
    if not stamped(rounds):
        return None
    events = [
        (
            started_at if a.get("finished_at") is None else a["finished_at"],
            r["round"],
            k,
            a["accuracy"],
        )
        for r in rounds
        for k, a in r["agents"].items()
    ]
    fleet = {k for *_, k, _ in events}
    latest: dict[str, float] = {}
    for at, round_, agent, accuracy in sorted(events):
        latest[agent] = accuracy
        if len(latest) < len(fleet):
            continue
        mean = sum(latest.values()) / len(latest)
        if mean >= target if higher_is_better else mean <= target:
            return at, round_
    return None


def time_to_target(
    rounds: Sequence[Mapping[str, Any]],
    started_at: float | None,
    target: float | None = None,
    higher_is_better: bool = True,
) -> dict[str, Any]:
    """The summary's `time_to_target`: the target, whether it was given or is the run's
    final fleet accuracy's (`TOLERANCE`), whether the records have the time stamps to say
    (`timed`: `stamped`, and a start), and the seconds from `started_at` and the round
    at which the fleet first reached it (None: never, or not `timed`)."""
    given = target is not None
    if target is None and rounds:
        final = rounds[-1]["agents"].values()
        mean = sum(a["accuracy"] for a in final) / len(final)
        target = mean - TOLERANCE if higher_is_better else mean + TOLERANCE
    reached = None
    if target is not None and started_at is not None:
        reached = reached_at(rounds, target, higher_is_better, started_at)
    seconds = None if reached is None or started_at is None else reached[0] - started_at
    return {
        "target": target,
        "given": given,
        "timed": started_at is not None and stamped(rounds),
        "seconds": seconds,
        "round": None if reached is None else reached[1],
        "started_at": started_at,
    }


def with_time_to_target(
    report: dict[str, Any],
    target: float | None,
    started_at: float | None = None,
    clock: str | None = None,
) -> dict[str, Any]:
    """`report` with its summary's `time_to_target` for `target` (None: the run's final
    accuracy's), from `started_at` on `clock` ("wall", or "virtual": simulate's seconds on
    its boards, `coordinator.virtual_clock`), each else the one a previous call recorded;
    the direction is the report's metric's (`summary.metric`, accuracy's without one)."""
    summary = report["summary"]
    before = summary.get("time_to_target") or {}
    if started_at is None:
        started_at = before.get("started_at")
    clock = clock or before.get("clock", "wall")
    metric = summary.get("metric") or {}
    higher = bool(metric.get("higher_is_better", True))
    name = str(metric.get("name", "accuracy"))
    rounds = [
        {**r, "agents": {k: {**a, "accuracy": a[name]} for k, a in r["agents"].items()}}
        for r in report["rounds"]
    ]
    summary["time_to_target"] = time_to_target(rounds, started_at, target, higher)
    summary["time_to_target"]["clock"] = clock
    return report
