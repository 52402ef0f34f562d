"""The models a device keeps: one per finished run, in the run's folder, and which of them is
current (`STATE_DIR/model.onnx`, the model `edge-agent predict` serves).

A device in a fleet that runs for months takes part in many runs, and a short test run must
not silently replace a good model. So each finished run's personalized model stays in its
run folder (`STATE_DIR/runs/RUN_ID/`): `model.onnx`, `model.pt` (its weights and masks, for
a run that starts from it, `init = "previous"`) and `model.json` (its metrics, written last:
its presence says the model is whole). A policy picks which model is current (`choose`):

- `latest` (the default): the newest finished run's, unless its accuracy is lower than the
  current model's by more than a margin (`keep_margin`, default 0.02, absolute);
- `best`: a new run's only if its accuracy is at least the current model's.

`current.json` names the current run. Every file is written atomically, and the current
model is copied into place before `current.json` names it: a crash in between leaves a whole
model there, and `reconcile` (at the agent's start) puts back the one `current.json` names.
Old run folders go (`prune`): beyond the newest N ended ones, never the current model's and
never an unfinished run's, which a restart resumes.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.files import atomic_write

if TYPE_CHECKING:
    from torch import Tensor

MODEL_ONNX = "model.onnx"
MODEL_WEIGHTS = "model.pt"
MODEL_METRICS = "model.json"
CURRENT = "current.json"
FINISHED_MARK = "finished"
"""The file that marks a run this agent finished, in the run's folder."""
CANCELLED_MARK = "cancelled"
"""The file that marks a run its signer called off: a restart does not resume it."""
DEFAULT_KEEP_RUNS = 20
_DELETING = ".deleting-"
"""Prefix of a run folder being deleted: renamed first, so a crash never leaves half of one
that looks like an unfinished run."""


@dataclass(frozen=True)
class KeptModel:
    """One finished run's model, as `model.json` describes it."""

    run_id: str
    finished: float
    """Unix time the run's model became final."""
    strategy: str
    model: str
    rounds: int
    """Rounds the run did (fewer than planned when it stopped early)."""
    accuracy: float | None
    """The final round's metric on this device's own test data (accuracy for a
    classification run, else `metric`); None if unknown."""
    metric: str = "accuracy"
    """The name of that figure (`tasks.Task.metric_name`)."""
    higher_is_better: bool = True

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KeptModel:
        """Read back `asdict`; ValueError for a file that is not one."""
        try:
            accuracy = data["accuracy"]
            return cls(
                run_id=str(data["run_id"]),
                finished=float(data["finished"]),
                strategy=str(data["strategy"]),
                model=str(data["model"]),
                rounds=int(data["rounds"]),
                accuracy=None if accuracy is None else float(accuracy),
                metric=str(data.get("metric", "accuracy")),
                higher_is_better=bool(data.get("higher_is_better", True)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a kept model's metrics: {exc}") from None


@dataclass(frozen=True)
class Choice:
    """What `choose` decided: the model current from now on, and why, in one line."""

    current: KeptModel
    changed: bool
    reason: str


def _shown(figure: float | None) -> str:
    return "unknown" if figure is None else f"{figure:.4f}"


def choose(candidate: KeptModel, current: KeptModel | None, policy: str, margin: float) -> Choice:
    """Which of a newly finished run's model (`candidate`) and the current one is current
    from now on, under `policy` ('latest' or 'best', see the module's text). Models are
    compared by their task's metric, in its direction; models of different metrics cannot be
    compared, and the newer one is taken."""
    now = f"run {candidate.run_id} is now the current model"
    metric = candidate.metric
    if current is None or current.run_id == candidate.run_id:
        return Choice(candidate, True, f"{now}: {metric} {_shown(candidate.accuracy)}")
    new, old = candidate.accuracy, current.accuracy
    kept = f"run {current.run_id} kept as current model"
    if current.metric != metric:
        return Choice(candidate, True, f"{now}: run {current.run_id} measured {current.metric}")
    if new is None or old is None:
        if policy == "best" and new is None and old is not None:
            return Choice(current, False, f"{kept}: the new run {candidate.run_id} has no {metric}")
        return Choice(candidate, True, f"{now}: no {metric} to compare with run {current.run_id}")
    versus = f"{metric} {_shown(new)} vs {_shown(old)} of run {current.run_id}"
    worse_by = old - new if candidate.higher_is_better else new - old
    side = "below" if candidate.higher_is_better else "above"
    if policy == "best":
        if worse_by <= 0:
            return Choice(candidate, True, f"{now} (keep best): {versus}")
        return Choice(
            current,
            False,
            f"{kept} (keep best): the new run {candidate.run_id} reaches {metric} "
            f"{_shown(new)}, {side} its {_shown(old)}",
        )
    if worse_by > margin:
        return Choice(
            current,
            False,
            f"{kept}: the new run {candidate.run_id} reaches {metric} {_shown(new)}, more than "
            f"{margin:g} {side} its {_shown(old)}",
        )
    return Choice(candidate, True, f"{now}: {versus}")


def weights_misfit(
    expected: Mapping[str, Tensor],
    mask_names: Sequence[str] | None,
    weights: Mapping[str, Tensor],
    masks: Mapping[str, Tensor],
) -> str | None:
    """Why saved `weights` (and `masks`) cannot start a run whose model has the tensors
    `expected` (and, for a sparse strategy, masks over `mask_names`), as the end of a
    sentence; None when they fit."""
    if set(weights) != set(expected):
        differ = sorted(set(weights) ^ set(expected))
        return f"has other parameters than this run's model ({', '.join(differ[:3])} ...)"
    for name, tensor in expected.items():
        if tuple(weights[name].shape) != tuple(tensor.shape):
            return (
                f"has {name} of shape {tuple(weights[name].shape)}, this run's model "
                f"{tuple(tensor.shape)}"
            )
    if mask_names is None:
        return None
    if set(masks) != set(mask_names):
        return "has no masks for this run's sparse model" if not masks else "has other masks"
    for name in mask_names:
        if tuple(masks[name].shape) != tuple(expected[name].shape):
            return f"has a mask of shape {tuple(masks[name].shape)} for {name}"
    return None


def ended(folder: Path) -> bool:
    """Whether a run folder's run is over for this agent (finished or called off)."""
    return (folder / FINISHED_MARK).exists() or (folder / CANCELLED_MARK).exists()


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    text = json.dumps(data, indent=1).encode()
    atomic_write(path, lambda handle: handle.write(text))


RUNS = "runs"
"""The folder of an agent's state folder that holds one folder per run (`run_folder`)."""


def run_folder(state_dir: Path, run_id: str) -> Path:
    """Where one run's checkpoint and round log live in an agent's state folder: a
    long-lived agent takes part in many runs, and a restart resumes the run it was in."""
    return state_dir / RUNS / run_id


class ModelStore:
    """The kept models of one agent's state folder, and which is current."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.current_path = state_dir / MODEL_ONNX
        """The current model, where `edge-agent predict` finds it."""

    def folder(self, run_id: str) -> Path:
        return run_folder(self.state_dir, run_id)

    def keep(
        self,
        kept: KeptModel,
        weights: Mapping[str, Tensor],
        masks: Mapping[str, Tensor] | None,
        export: Callable[[Path], Any],
    ) -> Path:
        """Keep a finished run's model in its folder: `export(path)` writes its ONNX file,
        then its weights and masks, then its metrics. Returns the ONNX file's path."""
        folder = self.folder(kept.run_id)
        folder.mkdir(parents=True, exist_ok=True)
        export(folder / MODEL_ONNX)
        from agent.runtime import checkpoint  # torch: only where weights are read or written

        checkpoint.save(
            folder / MODEL_WEIGHTS,
            {"run_id": kept.run_id, "weights": dict(weights), "masks": dict(masks or {})},
        )
        _write_json(folder / MODEL_METRICS, asdict(kept))
        return folder / MODEL_ONNX

    def get(self, run_id: str) -> KeptModel | None:
        """The model kept for `run_id`, or None (no such run, or no whole model in it)."""
        folder = self.folder(run_id)
        if not (folder / MODEL_ONNX).is_file():
            return None
        try:
            data = json.loads((folder / MODEL_METRICS).read_text(encoding="utf-8"))
            return KeptModel.from_dict(data)
        except (OSError, ValueError):
            return None

    def models(self) -> list[KeptModel]:
        """Every kept model, the newest first."""
        runs = self.state_dir / RUNS
        found = [self.get(f.name) for f in runs.iterdir()] if runs.is_dir() else []
        return sorted((m for m in found if m is not None), key=lambda m: -m.finished)

    def current_run(self) -> str | None:
        """The run whose model is current, as `current.json` says; None if none is."""
        try:
            data = json.loads((self.state_dir / CURRENT).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        run_id = data.get("run_id") if isinstance(data, dict) else None
        return run_id if isinstance(run_id, str) else None

    def current(self) -> KeptModel | None:
        run_id = self.current_run()
        return None if run_id is None else self.get(run_id)

    def use(self, run_id: str) -> KeptModel:
        """Make `run_id`'s model current (a rollback); ValueError, one line, if it has none."""
        kept = self.get(run_id)
        if kept is None:
            if not self.folder(run_id).is_dir():
                raise ValueError(f"no run {run_id!r} in {self.state_dir / 'runs'}")
            raise ValueError(f"run {run_id} has no kept model (it did not finish)")
        self._make_current(kept)
        return kept

    def settle(self, candidate: KeptModel, policy: str, margin: float) -> Choice:
        """Apply `choose` to a newly kept model, and make its pick current."""
        choice = choose(candidate, self.current(), policy, margin)
        self._make_current(choice.current)
        return choice

    def _make_current(self, kept: KeptModel) -> None:
        """Copy the model into place, then name it in `current.json` (see the module's text
        for why in this order)."""
        data = (self.folder(kept.run_id) / MODEL_ONNX).read_bytes()
        atomic_write(self.current_path, lambda handle: handle.write(data))
        _write_json(self.state_dir / CURRENT, {"run_id": kept.run_id, "since": time.time()})

    def reconcile(self) -> None:
        """Put the model `current.json` names back in place when a crash between the two
        writes of `_make_current` left another one there."""
        kept = self.current()
        if kept is None:
            return
        source = self.folder(kept.run_id) / MODEL_ONNX
        if not self.current_path.is_file() or self.current_path.read_bytes() != source.read_bytes():
            self._make_current(kept)

    def start_weights(self) -> tuple[KeptModel, dict[str, Tensor], dict[str, Tensor]] | None:
        """The current model's weights and masks ({} when dense), to start a run from; None
        when no model is current or its weights cannot be read."""
        kept = self.current()
        if kept is None:
            return None
        from agent.runtime import checkpoint

        try:
            saved = checkpoint.load(self.folder(kept.run_id) / MODEL_WEIGHTS)
        except checkpoint.CheckpointError:
            return None
        if saved is None:
            return None
        return kept, dict(saved["weights"]), dict(saved["masks"] or {})

    def prune(self, keep_runs: int) -> list[str]:
        """Delete the run folders beyond the newest `keep_runs` ended ones, except the
        current model's; unfinished runs' folders stay. Returns the run ids deleted."""
        runs = self.state_dir / RUNS
        if not runs.is_dir():
            return []
        for leftover in runs.glob(f"{_DELETING}*"):
            shutil.rmtree(leftover, ignore_errors=True)
        done = [f for f in runs.iterdir() if f.is_dir() and ended(f)]
        done.sort(key=_ended_at, reverse=True)
        current = self.current_run()
        deleted = []
        for folder in done[keep_runs:]:
            if folder.name == current:
                continue
            doomed = folder.with_name(_DELETING + folder.name)
            folder.rename(doomed)
            shutil.rmtree(doomed, ignore_errors=True)
            deleted.append(folder.name)
        return deleted


def _ended_at(folder: Path) -> float:
    """When a run ended here: the time of its mark."""
    marks = [folder / mark for mark in (FINISHED_MARK, CANCELLED_MARK)]
    return max((mark.stat().st_mtime for mark in marks if mark.exists()), default=0.0)
