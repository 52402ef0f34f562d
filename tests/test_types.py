"""The code type-checks: mypy over every package, strict on the learning core (pyproject.toml's
[tool.mypy]). A type error in a module the simulator, the agent and the aggregator share is a
bug in all three."""

from __future__ import annotations

from pathlib import Path

import pytest
from mypy import api as mypy_api

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_every_package_type_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    report, errors, status = mypy_api.run(["--config-file", str(ROOT / "pyproject.toml")])
    assert status == 0, report + errors
