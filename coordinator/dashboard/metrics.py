"""`/metrics`: the fleet in the Prometheus exposition format.

A custom collector reads `FleetState` at scrape time, so there are no global gauges to keep
in step with the fleet: an agent that is forgotten (its retained messages cleared) simply
stops appearing. Each app has its own registry, so two dashboards in one process (tests,
or one per fleet) do not share series.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from coordinator.dashboard.state import FleetState

AGENT_GAUGES = (
    ("round", "round", "Latest round the agent reported."),
    ("accuracy", "accuracy", "Validation accuracy after the agent's latest round."),
    ("loss", "loss", "Validation loss after the agent's latest round."),
    ("sparsity", "sparsity", "Sparsity of the agent's model (fraction of zeros)."),
    ("p_k", "p_k", "The agent's compute budget p_k in its latest round."),
    ("stopped", "stopped", "1 if the agent stopped early."),
    ("online", "online", "1 if the agent's presence says it is online."),
)
"""(row field, metric name after edgefl_agent_, help) of the per-agent gauges."""
AGENT_COUNTERS = (
    ("bytes_sent", "bytes_sent", "Bytes the agent sent, summed over the rounds received."),
    ("bytes_received", "bytes_received", "Bytes the agent received, over the rounds received."),
    ("train_flops", "train_flops", "Training FLOPs of the agent, over the rounds received."),
    (
        "energy_total_j",
        "training_energy_joules",
        "Modelled training energy above idle [J] of an agent with a device profile.",
    ),
)
SAVED = (
    ("rounds", "saved_rounds", "Rounds an early-stopped agent did not run."),
    ("flops", "saved_flops", "Training FLOPs early stopping saved the agent."),
    ("bytes", "saved_bytes", "Bytes early stopping saved the agent."),
    ("energy_j", "saved_energy_joules", "Training energy [J] early stopping saved the agent."),
)


def peak_memory_bytes(row: Mapping[str, Any]) -> float | None:
    """The round's peak training memory in bytes (agents report MiB)."""
    mib = row.get("peak_memory_mb")
    return None if mib is None else mib * 2**20


def prediction_error(row: Mapping[str, Any]) -> float | None:
    """(measured - predicted) / predicted training seconds: how far the agent's cost table
    was off, positive when the round took longer than predicted."""
    measured, predicted = row.get("train_s"), row.get("predicted_s")
    if measured is None or predicted is None or predicted <= 0:
        return None
    return float((measured - predicted) / predicted)


ROUND_COST_GAUGES: tuple[tuple[str, str, Callable[[Mapping[str, Any]], float | None]], ...] = (
    (
        "train_seconds",
        "Seconds the agent's latest local training took by its device's clock.",
        lambda row: row.get("train_s"),
    ),
    (
        "predicted_train_seconds",
        "Seconds the agent's measured cost table predicted for its latest local training.",
        lambda row: row.get("predicted_s"),
    ),
    (
        "peak_training_memory_bytes",
        "Peak training memory of the agent's latest round [bytes].",
        peak_memory_bytes,
    ),
    (
        "epsilon",
        "The agent's privacy loss epsilon so far at the run's delta (--dp sample or client).",
        lambda row: row.get("epsilon"),
    ),
    (
        "staleness_rounds",
        "Rounds stale, on average, what the agent's latest asynchronous round took in was.",
        lambda row: row.get("staleness"),
    ),
    (
        "prediction_error_ratio",
        "(measured - predicted) / predicted seconds of the agent's latest local training.",
        prediction_error,
    ),
)
"""(metric name after edgefl_agent_, help, value of a row or None) of the latest round's
gauges (its cost, privacy loss and staleness), each given only for agents whose latest
status has its figures (`.get`: a row of an older dashboard state may lack them)."""
FLEET_GAUGES = (
    ("agents", "agents", "Agents the dashboard knows in the fleet."),
    ("online", "agents_online", "Agents online."),
    ("stopped", "agents_stopped", "Agents that stopped early."),
    ("round", "round", "The furthest round any agent reported."),
    ("mean_accuracy", "mean_accuracy", "Mean accuracy over the agents that reported one."),
)


class FleetCollector(Collector):
    """Per-agent (labels fleet, agent) and fleet-wide (label fleet) series from a
    FleetState, read at each scrape."""

    def __init__(self, state: FleetState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        snapshot = self.state.snapshot(series=False)
        agents: list[dict[str, Any]] = snapshot["agents"]
        labels = ["fleet", "agent"]
        for field, name, doc in AGENT_GAUGES:
            gauge = GaugeMetricFamily(f"edgefl_agent_{name}", doc, labels=labels)
            for row in agents:
                if field == "accuracy" and row["metric"] != "accuracy":
                    continue  # another task's metric: edgefl_agent_metric has it, named
                if (value := row[field]) is not None:
                    gauge.add_metric([row["fleet"], row["agent"]], float(value))
            yield gauge
        yield task_metric(agents)
        for field, name, doc in AGENT_COUNTERS:
            counter = CounterMetricFamily(f"edgefl_agent_{name}", doc, labels=labels)
            for row in agents:
                if row[field] is not None:
                    counter.add_metric([row["fleet"], row["agent"]], row[field])
            yield counter
        for field, name, doc in SAVED:
            gauge = GaugeMetricFamily(f"edgefl_agent_{name}", doc, labels=labels)
            for row in agents:
                if row["saved"] is not None and (value := row["saved"][field]) is not None:
                    gauge.add_metric([row["fleet"], row["agent"]], value)
            yield gauge
        yield from round_cost_metrics(agents)
        yield from fleet_metrics(snapshot["fleets"])
        rejected = CounterMetricFamily(
            "edgefl_dashboard_rejected_messages", "Messages that failed to decode or verify."
        )
        rejected.add_metric([], self.state.rejected)
        yield rejected


def task_metric(agents: list[dict[str, Any]]) -> Metric:
    """Each agent's task metric labelled by its name: accuracy for classification, mae for
    regression, reconstruction_error for an autoencoder, or a run's own metric (the
    accuracy gauge carries classification runs only)."""
    gauge = GaugeMetricFamily(
        "edgefl_agent_metric",
        "The run task's metric after the agent's latest round (label metric names it).",
        labels=["fleet", "agent", "metric"],
    )
    for row in agents:
        if row["accuracy"] is not None:
            gauge.add_metric([row["fleet"], row["agent"], row["metric"]], float(row["accuracy"]))
    return gauge


def round_cost_metrics(agents: list[dict[str, Any]]) -> Iterator[Metric]:
    """The latest round's measured and predicted cost per agent, and what its budget made
    it do as an info-style gauge (value 1, the reduction in a label; the one-line reason
    stays out of the labels, which would make a series per wording)."""
    for name, doc, value_of in ROUND_COST_GAUGES:
        gauge = GaugeMetricFamily(f"edgefl_agent_{name}", doc, labels=["fleet", "agent"])
        for row in agents:
            if (value := value_of(row)) is not None:
                gauge.add_metric([row["fleet"], row["agent"]], value)
        yield gauge
    yield info_gauge(
        agents,
        "reduction",
        "What the budget made the agent's latest round do (label reduction: none, prune, "
        "freeze, prefix, width, possibly with +steps).",
    )
    yield info_gauge(
        agents,
        "kept",
        "Which of its models the agent keeps and serves after its latest round, judged on "
        "its own validation data (label kept: personal, fleet or local).",
    )


def info_gauge(agents: list[dict[str, Any]], field: str, doc: str) -> GaugeMetricFamily:
    """An info-style gauge `edgefl_agent_FIELD_info`: value 1 for each agent that says one,
    what it says in the label `field`."""
    gauge = GaugeMetricFamily(f"edgefl_agent_{field}_info", doc, labels=["fleet", "agent", field])
    for row in agents:
        if row.get(field):
            gauge.add_metric([row["fleet"], row["agent"], row[field]], 1.0)
    return gauge


def fleet_metrics(fleets: list[dict[str, Any]]) -> Iterator[Metric]:
    for field, name, doc in FLEET_GAUGES:
        gauge = GaugeMetricFamily(f"edgefl_fleet_{name}", doc, labels=["fleet"])
        for summary in fleets:
            if (value := summary[field]) is not None:
                gauge.add_metric([summary["fleet"]], float(value))
        yield gauge


def registry_for(state: FleetState) -> CollectorRegistry:
    """A registry of its own holding the fleet collector (no process-wide metrics)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(state))
    return registry
