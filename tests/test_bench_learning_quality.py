"""bench/learning_quality.py: a `--set` option overrides the task's own setting (a variant
with longer runs is `--set rounds=120`), rather than failing every cell."""

from __future__ import annotations

from bench import learning_quality


def test_a_set_option_overrides_the_tasks_own() -> None:
    cell = learning_quality.run_cell("user-mlp-regression", "local", 1, {"rounds": 2})
    assert learning_quality.TASKS["user-mlp-regression"]["rounds"] == 30
    assert cell["rounds"] == 2 and "error" not in cell
