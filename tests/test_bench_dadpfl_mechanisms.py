"""bench/dadpfl_mechanisms.py: every DA-DPFL variant is judged against the one DisPFL that
the baseline's file holds (measured by the same code on the same splits), with the grid's
own verdict, and a variant it does not know is one line."""

from __future__ import annotations

from typing import Any

import pytest

from bench import dadpfl_mechanisms


def run(strategy: str, seed: int, accuracy: float, mb: float, gflop: float) -> dict[str, Any]:
    """A grid cell of one agent, in bench.learning_quality's format."""
    agent = {
        "final": accuracy,
        "last5": accuracy,
        "bytes": mb * 1e6,
        "flops": gflop * 1e9,
        "last_bytes": mb * 1e5,
        "last_flops": gflop * 1e8,
        "trained_rounds": 10,
        "kept": "personal",
        "own": accuracy,
        "fallback_flops": 0,
        "se": 0.01,
        "constant": 0.2,
    }
    return {
        "task": "digits-path2",
        "strategy": strategy,
        "seed": seed,
        "metric": "accuracy",
        "higher_is_better": True,
        "rounds": 10,
        "chance_accuracy": 0.1,
        "busiest_bytes": mb * 1e6,
        "agents": {"agent-000": agent},
    }


def cells(*runs: dict[str, Any]) -> dict[str, Any]:
    return {f"{r['task']}|{r['strategy']}|{r['seed']}": r for r in runs}


def test_each_variant_is_judged_against_the_baselines_dispfl() -> None:
    local = [run("local", s, 0.80, 0, 1.0) for s in (1, 2)]
    variants = {
        "default": cells(
            *local,
            run("dispfl", 1, 0.90, 10, 2.0),
            run("dispfl", 2, 0.92, 10, 2.0),
            run("dadpfl", 1, 0.91, 9, 1.8),
            run("dadpfl", 2, 0.93, 9, 1.8),
        ),
        "detection-0.2": cells(
            *local,
            run("dadpfl", 1, 0.90, 7, 1.4),
            run("dadpfl", 2, 0.91, 7, 1.4),
        ),
    }
    rows = dadpfl_mechanisms.compare(variants, ["digits-path2"])
    default, earlier = rows
    assert default["variant"] == "default" and earlier["variant"] == "detection-0.2"
    assert default["gain"] == pytest.approx(0.01)
    assert (default["bytes_ratio"], default["flops_ratio"]) == pytest.approx((0.9, 0.9))
    assert not default["shown"]  # cheaper, but not by the margins
    assert earlier["gain"] == pytest.approx(-0.005)  # against the default file's DisPFL
    assert (earlier["bytes_ratio"], earlier["flops_ratio"]) == pytest.approx((0.7, 0.7))
    assert not earlier["shown"]  # the margins met, a point lost
    means = dadpfl_mechanisms.print_table(rows)
    assert [m["variant"] for m in means] == ["default", "detection-0.2"]
    assert means[1]["gain"] == pytest.approx(-0.5)  # points


def test_an_unknown_variant_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        dadpfl_mechanisms.main(["--table", "--variants", "quicker"])
    assert stopped.value.code == 2
    assert "unknown 'quicker'; known: default, waiting-only" in capsys.readouterr().err
