"""A device's measured training costs: what a round of each reduction really takes.

Counted FLOPs say a model pruned to density 0.2 trains in 0.2 of the time; on a CPU its
masked-dense kernels take as long as the dense ones. So an agent measures instead
(`agent.device.calibration` times a few minibatches of its model at each reduction level
and keeps the table in its state folder), and the budget rule reads this table: a
reduction's cost is its measured step time over the dense one at the same batch size.

Pure data: the table, its file form and its lookups; measuring lives with the device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from agent.learning.prefix import Window

TABLE_VERSION = 1


@dataclass(frozen=True)
class Cost:
    """One minibatch step (forward, backward, update) as measured at the table's batch."""

    step_s: float
    """Seconds of the step (the fastest of the timed repeats)."""
    fixed_mb: float
    """Memory that does not grow with the batch: weights, their gradients, optimizer state."""
    activation_mb: float
    """What autograd kept for the backward pass (and the batch itself): grows with the batch."""

    @property
    def peak_mb(self) -> float:
        return self.fixed_mb + self.activation_mb

    def peak_at(self, batch_size: int, measured_batch: int) -> float:
        """Peak memory at another batch size: activations scale with the batch."""
        return self.fixed_mb + self.activation_mb * batch_size / measured_batch


@dataclass(frozen=True)
class Row:
    """One reduction at one level: `kind` (freeze, prefix, width, prune), its `level`
    (active fraction, FLOP fraction of the window, width, density) and for prefix the window
    of layers measured."""

    kind: str
    level: float
    cost: Cost
    window: Window | None = None


@dataclass(frozen=True)
class CostTable:
    """The measured costs of one model on one device at one batch size.

    `key` says what the table was measured for (model, batch, threads, compute device,
    torch version, processor): a table whose key differs from the agent's is measured again.
    """

    key: str
    batch_size: int
    dense: Cost
    forward_s: float
    """Seconds per sample of an evaluation pass (no gradients), for the round's evaluation."""
    rows: tuple[Row, ...]
    format: str = "fp32"
    """The training step's format (`agent.learning.precision`) measured fastest, in which
    the rows were measured and the agent trains."""

    def fraction(self, row: Row) -> float:
        """The row's step time over the dense step's: the share of a dense round it takes."""
        return row.cost.step_s / self.dense.step_s

    def memory_fraction(self, row: Row) -> float:
        return row.cost.peak_mb / self.dense.peak_mb

    def of_kind(self, kind: str) -> list[Row]:
        return [row for row in self.rows if row.kind == kind]

    def interpolated(
        self, kind: str, level: float, measure: Callable[[Row], float] | None = None
    ) -> float | None:
        """The cost fraction of `kind` at `level` (its time, or `measure` of its rows, such
        as `memory_fraction`), linear between the measured levels (the nearest one outside
        them); None when the kind was not measured."""
        measure = measure or self.fraction
        points = sorted(
            {row.level: measure(row) for row in self.of_kind(kind) if row.window is None}.items()
        )
        if not points:
            return None
        if level <= points[0][0]:
            return points[0][1]
        for (low, low_cost), (high, high_cost) in zip(points, points[1:], strict=False):
            if level <= high:
                return low_cost + (high_cost - low_cost) * (level - low) / (high - low)
        return points[-1][1]

    def to_dict(self) -> dict[str, Any]:
        plain = asdict(self)
        plain["version"] = TABLE_VERSION
        return plain

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostTable:
        """The table of `to_dict`; ValueError for another version or a malformed one."""
        if data.get("version") != TABLE_VERSION:
            raise ValueError(f"cost table version {data.get('version')!r}, not {TABLE_VERSION}")
        try:
            rows = tuple(
                Row(
                    kind=str(row["kind"]),
                    level=float(row["level"]),
                    cost=Cost(**row["cost"]),
                    window=None if row.get("window") is None else _window(row["window"]),
                )
                for row in data["rows"]
            )
            return cls(
                key=str(data["key"]),
                batch_size=int(data["batch_size"]),
                dense=Cost(**data["dense"]),
                forward_s=float(data["forward_s"]),
                rows=rows,
                format=str(data.get("format", "fp32")),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed cost table: {exc}") from None


def _window(value: Any) -> Window:
    start, stop = value
    return int(start), int(stop)
