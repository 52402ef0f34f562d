"""Which kept model is current, rollbacks, retention and warm starts (`agent.model_store`),
and the run-file keys that choose them: fast, on files only."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from agent.model_store import (
    CANCELLED_MARK,
    CURRENT,
    FINISHED_MARK,
    KeptModel,
    ModelStore,
    choose,
    weights_misfit,
)
from agent.runfile import parse_run_table


def model(run_id: str, accuracy: float | None, finished: float = 1.0) -> KeptModel:
    return KeptModel(run_id, finished, "dadpfl", "mlp", 10, accuracy)


@pytest.mark.parametrize(
    ("policy", "new", "old", "becomes_current"),
    [
        ("latest", 0.96, 0.97, True),  # within the margin: the newer model
        ("latest", 0.99, 0.97, True),
        ("latest", 0.94, 0.97, False),  # more than 0.02 lower: the current one stays
        ("best", 0.96, 0.97, False),  # best: any lower accuracy keeps the current one
        ("best", 0.97, 0.97, True),
        ("latest", None, 0.97, True),  # nothing to compare: the newer model
        ("best", None, 0.97, False),
        ("best", 0.5, None, True),
    ],
)
def test_the_policy_picks_the_current_model(
    policy: str, new: float | None, old: float | None, becomes_current: bool
) -> None:
    choice = choose(model("run-new", new), model("run-old", old), policy, 0.02)
    assert choice.changed is becomes_current
    assert choice.current.run_id == ("run-new" if becomes_current else "run-old")


def test_the_choice_says_in_one_line_what_stays_current_and_why() -> None:
    choice = choose(model("run-y", 0.91), model("run-x", 0.97), "latest", 0.02)
    assert choice.reason == (
        "run run-x kept as current model: the new run run-y reaches accuracy 0.9100, more "
        "than 0.02 below its 0.9700"
    )
    first = choose(model("run-y", 0.91), None, "latest", 0.02)
    assert first.reason == "run run-y is now the current model: accuracy 0.9100"


def keep(store: ModelStore, run_id: str, accuracy: float | None, fill: float = 0.0) -> KeptModel:
    """Keep a run's model as an agent does: its ONNX bytes say which run it is."""
    kept = model(run_id, accuracy, finished=float(len(store.models()) + 1))
    weights = {"fc.weight": torch.full((2, 3), fill), "fc.bias": torch.zeros(2)}
    masks = {"fc.weight": torch.ones(2, 3, dtype=torch.bool)}
    store.keep(kept, weights, masks, lambda path: path.write_bytes(run_id.encode()))
    (store.folder(run_id) / FINISHED_MARK).touch()
    return kept


def test_a_worse_run_is_kept_but_not_current_and_use_rolls_back(tmp_path: Path) -> None:
    store = ModelStore(tmp_path)
    store.settle(keep(store, "run-good", 0.9), "latest", 0.02)
    choice = store.settle(keep(store, "run-short", 0.5), "latest", 0.02)
    assert not choice.changed
    assert store.current_path.read_bytes() == b"run-good"
    assert [m.run_id for m in store.models()] == ["run-short", "run-good"], "newest first"
    store.use("run-short")
    assert store.current_run() == "run-short"
    assert store.current_path.read_bytes() == b"run-short"


def test_use_of_an_unknown_run_or_one_without_a_model_is_a_one_line_error(
    tmp_path: Path,
) -> None:
    store = ModelStore(tmp_path)
    with pytest.raises(ValueError, match="no run 'run-nope'"):
        store.use("run-nope")
    store.folder("run-cut").mkdir(parents=True)  # a run that never finished here
    with pytest.raises(ValueError, match="run run-cut has no kept model"):
        store.use("run-cut")


def test_a_crash_between_the_model_and_its_record_leaves_the_old_current_model(
    tmp_path: Path,
) -> None:
    store = ModelStore(tmp_path)
    store.settle(keep(store, "run-a", 0.9), "latest", 0.02)
    keep(store, "run-b", 0.95)
    store.current_path.write_bytes(b"run-b")  # copied in place, current.json not yet written
    store.reconcile()
    assert store.current_path.read_bytes() == b"run-a"
    assert store.current_run() == "run-a"


def test_retention_keeps_the_newest_ended_runs_the_current_one_and_unfinished_ones(
    tmp_path: Path,
) -> None:
    store = ModelStore(tmp_path)
    for k, run_id in enumerate(["run-1", "run-2", "run-3", "run-4"]):
        keep(store, run_id, 0.5 + k / 10)
        os.utime(store.folder(run_id) / FINISHED_MARK, (1000.0 + k, 1000.0 + k))
    store.use("run-1")  # the oldest is current
    (store.folder("run-5") / "checkpoint.pt").parent.mkdir(parents=True)  # unfinished
    (store.folder("run-0")).mkdir()
    (store.folder("run-0") / CANCELLED_MARK).touch()
    os.utime(store.folder("run-0") / CANCELLED_MARK, (10.0, 10.0))
    deleted = store.prune(2)
    assert sorted(deleted) == ["run-0", "run-2"]
    remaining = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert remaining == ["run-1", "run-3", "run-4", "run-5"]


def test_a_warm_start_reads_the_current_weights_and_checks_their_shapes(tmp_path: Path) -> None:
    store = ModelStore(tmp_path)
    assert store.start_weights() is None
    store.settle(keep(store, "run-a", 0.9, fill=0.25), "latest", 0.02)
    saved = store.start_weights()
    assert saved is not None
    kept, weights, masks = saved
    assert kept.run_id == "run-a"
    assert torch.equal(weights["fc.weight"], torch.full((2, 3), 0.25))
    expected = {"fc.weight": torch.zeros(2, 3), "fc.bias": torch.zeros(2)}
    assert weights_misfit(expected, ["fc.weight"], weights, masks) is None
    assert weights_misfit(expected, None, weights, {}) is None, "a dense run ignores masks"
    other = {"fc.weight": torch.zeros(4, 3), "fc.bias": torch.zeros(4)}
    assert "fc.weight of shape (2, 3)" in str(weights_misfit(other, None, weights, masks))
    renamed = {"head.weight": torch.zeros(2, 3), "fc.bias": torch.zeros(2)}
    assert "other parameters" in str(weights_misfit(renamed, None, weights, masks))
    assert "no masks" in str(weights_misfit(expected, ["fc.weight"], weights, {}))


def test_a_damaged_record_of_the_current_model_means_no_current_model(tmp_path: Path) -> None:
    store = ModelStore(tmp_path)
    store.settle(keep(store, "run-a", 0.9), "latest", 0.02)
    (tmp_path / CURRENT).write_text("{not json")
    assert store.current() is None
    assert store.start_weights() is None


RUN = {"agents": 2, "input_shape": [1, 40], "classes": 10}


def test_run_file_keys_choose_the_start_and_the_policy_and_name_the_model() -> None:
    config = parse_run_table(
        {**RUN, "init": "previous", "keep": "best", "keep_margin": 0.05}, "run.toml"
    ).config(2)
    assert (config.init, config.keep, config.keep_margin) == ("previous", "best", 0.05)
    default = parse_run_table(RUN, "run.toml").config(2)
    assert (default.init, default.keep, default.keep_margin) == ("seed", "latest", 0.02)
    assert default.model == "cnn1d", "the report names the model the devices build"


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"init": "last"}, "init must be one of seed, previous"),
        ({"keep": "newest"}, "keep must be one of latest, best"),
        ({"keep_margin": 2}, "keep_margin must be in [0, 1]"),
    ],
)
def test_a_bad_model_keeping_key_is_a_one_line_error(keys: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[")) as error:
        parse_run_table({**RUN, **keys}, "run.toml")
    assert str(error.value).startswith("run.toml: ")
    assert "\n" not in str(error.value)


def test_kept_metrics_are_plain_json(tmp_path: Path) -> None:
    store = ModelStore(tmp_path)
    keep(store, "run-a", 0.875)
    data = json.loads((store.folder("run-a") / "model.json").read_text())
    assert data == {
        "run_id": "run-a",
        "finished": 1.0,
        "strategy": "dadpfl",
        "model": "mlp",
        "rounds": 10,
        "accuracy": 0.875,
        "metric": "accuracy",
        "higher_is_better": True,
    }
