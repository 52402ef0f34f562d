"""What a model learns: its task's loss, the target it is compared with, and the metric that
reports, statuses, early stopping and model keeping read.

    classification  cross-entropy over class labels; metric accuracy (higher is better)
    regression      MSE (or L1) against float targets; metric MAE (lower is better)
    reconstruction  MSE of the model's output against its own input; metric the mean
                    per-sample reconstruction error (lower is better): an autoencoder's
                    anomaly score

A run may replace the loss and the metric with its own callables (`user_code`). The built-in
classification path is the same arithmetic as before tasks existed, so its reports are
unchanged bit for bit.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional as F

from agent.learning.config import METRIC_GOALS, TASKS
from agent.user_code import is_import_path, load_callable

BUILTIN_LOSSES = ("mse", "l1")
METRIC_NAMES = {
    "classification": "accuracy",
    "regression": "mae",
    "reconstruction": "reconstruction_error",
}

LossFn = Callable[[Tensor, Tensor], Tensor]


def _as_target_shape(output: Tensor, target: Tensor, kind: str) -> Tensor:
    """The output laid out as its target: a regression head of (N, 1) for (N,) targets, a
    flat reconstruction for an (N, C, L) input. A size mismatch is the model's error."""
    if output.shape == target.shape:
        return output
    if output.numel() != target.numel():
        raise ValueError(
            f"{kind}: the model outputs {_values(output)} per sample but the target holds "
            f"{_values(target)}"
        )
    return output.reshape(target.shape)


def _values(batch: Tensor) -> str:
    """One sample's size in words: "1 value", "3 values" or "values of shape (2, 8)"."""
    shape = tuple(batch.shape[1:])
    count = math.prod(shape)
    if len(shape) <= 1:
        return f"{count} value" + ("" if count == 1 else "s")
    return f"values of shape {shape}"


def _per_sample(values: Tensor) -> Tensor:
    """Mean over every dimension but the first."""
    return values.reshape(len(values), -1).mean(1)


@dataclass(frozen=True)
class Task:
    """A run's task: how a batch's loss and metric are computed (`loss`, `sums`). The
    loss and metric functions are made (user code imported) once, when the task is."""

    kind: str = "classification"
    loss_name: str = ""
    """'mse' or 'l1' (regression), or an import path to a loss(output, target) -> Tensor."""
    metric_spec: str = ""
    """An import path to a metric(output, target) -> per-sample Tensor, or '' (built in)."""
    goal: str = ""
    """'max' or 'min': whether a higher metric is better ('' for the task's own)."""

    def __post_init__(self) -> None:
        if self.kind not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.kind!r}")
        if self.goal and self.goal not in METRIC_GOALS:
            raise ValueError(f"metric_goal must be max or min, got {self.goal!r}")
        built_in = self.kind == "regression" and self.loss_name in BUILTIN_LOSSES
        if self.loss_name and not is_import_path(self.loss_name) and not built_in:
            known = "mse or l1 (regression)" if self.kind == "regression" else "none built in"
            raise ValueError(
                f"loss {self.loss_name!r} is not a loss of {self.kind}: give "
                f"MODULE:FUNCTION ({known})"
            )
        if self.metric_spec and not is_import_path(self.metric_spec):
            raise ValueError(f"metric {self.metric_spec!r} must be MODULE:FUNCTION")
        object.__setattr__(self, "_loss", self._make_loss())
        object.__setattr__(self, "_metric", self._make_metric())

    @property
    def metric_name(self) -> str:
        """The metric's name in reports: accuracy, mae, reconstruction_error, or the custom
        metric function's name."""
        if self.metric_spec:
            return self.metric_spec.rpartition(":")[2]
        return METRIC_NAMES[self.kind]

    @property
    def higher_is_better(self) -> bool:
        """Accuracy and a custom metric with goal max are better higher; errors lower."""
        if self.goal:
            return self.goal == "max"
        return self.kind == "classification" and not self.metric_spec

    def target(self, x: Tensor, y: Tensor) -> Tensor:
        """What the output is compared with: the input itself for reconstruction."""
        return x if self.kind == "reconstruction" else y

    def loss(self, output: Tensor, target: Tensor) -> Tensor:
        """The batch's mean loss, the quantity training minimizes."""
        return self._loss(output, target)  # type: ignore[attr-defined,no-any-return]

    def sums(self, output: Tensor, target: Tensor) -> tuple[float, float]:
        """(loss summed over the batch, metric summed over the batch), for `evaluate`."""
        if self.kind == "classification" and not self.loss_name and not self.metric_spec:
            loss = F.cross_entropy(output, target, reduction="sum").item()
            return loss, float(int((output.argmax(1) == target).sum()))
        loss = self.loss(output, target).item() * len(target)
        metric = self._metric(output, target)  # type: ignore[attr-defined]
        # A metric may give per-sample values or, like a loss, the batch's mean.
        total = metric * len(target) if metric.dim() == 0 else metric.sum()
        return loss, float(total)

    def per_sample(self, output: Tensor, target: Tensor) -> Tensor | None:
        """The metric of every sample of a batch (float64), for the spread of a mean over a
        device's samples; None for a custom metric that gives only the batch's mean."""
        metric: Tensor = self._metric(output, target)  # type: ignore[attr-defined]
        if metric.dim() == 0 or metric.numel() != len(target):
            return None
        return metric.detach().reshape(-1).to(torch.float64)

    def check(self, output: Tensor, x: Tensor, y: Tensor) -> None:
        """Compute the loss and metric of one batch's `output` before a run starts, so a
        model whose output does not fit the task, or a loss or metric that fails, is one
        line before any round rather than a traceback in the middle of one."""
        target = self.target(x, y)
        if self.kind == "classification" and not self.loss_name and output.dim() != 2:
            raise ValueError(
                f"classification: the model must output (batch, classes) logits, got "
                f"shape {tuple(output.shape)}"
            )
        try:
            self.sums(output, target)
        except ValueError:
            raise
        except Exception as exc:
            raise ValueError(
                f"{self.kind}: the loss or metric failed on the model's output "
                f"{tuple(output.shape)}: {type(exc).__name__}: {exc}"
            ) from None

    def _make_loss(self) -> LossFn:
        if is_import_path(self.loss_name):
            return _checked_user_fn(self.loss_name, "loss")
        if self.kind == "classification":
            return F.cross_entropy
        reduce = F.l1_loss if self.loss_name == "l1" else F.mse_loss
        return functools.partial(_shaped_loss, reduce, self.kind)

    def _make_metric(self) -> LossFn:
        if self.metric_spec:
            return _checked_user_fn(self.metric_spec, "metric")
        if self.kind == "classification":
            return _correct
        if self.kind == "regression":
            return _absolute_error
        return _squared_error


def _shaped_loss(reduce: LossFn, kind: str, output: Tensor, target: Tensor) -> Tensor:
    return reduce(_as_target_shape(output, target, kind), target)


def _correct(output: Tensor, target: Tensor) -> Tensor:
    return (output.argmax(1) == target).to(torch.float64)


def _absolute_error(output: Tensor, target: Tensor) -> Tensor:
    """Per sample, the mean absolute error over its target's values (MAE)."""
    return _per_sample((_as_target_shape(output, target, "regression") - target).abs())


def _squared_error(output: Tensor, target: Tensor) -> Tensor:
    """Per sample, the mean squared error over its features: the reconstruction error."""
    return _per_sample((_as_target_shape(output, target, "reconstruction") - target) ** 2)


def _checked_user_fn(spec: str, what: str) -> LossFn:
    """A user's loss or metric, checked to take (output, target)."""
    fn = load_callable(spec, what)
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        raise ValueError(f"{what} {spec!r} must take (output, target)") from None
    except ValueError:  # a builtin without a signature: trust it
        pass
    return fn
