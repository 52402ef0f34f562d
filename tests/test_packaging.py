"""An installed edgefl has every package of the source tree: `pip install .` (not only an
editable install) must ship the subpackages (agent.learning, agent.runtime, ...)."""

from __future__ import annotations

import sys
from pathlib import Path

from setuptools import find_packages

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
TOP_LEVEL = ("agent", "coordinator", "protocol", "firmware_profiles")


def test_the_distribution_ships_every_package_of_the_tree() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    shipped = set(find_packages(ROOT, **config["packages"]["find"]))
    in_tree = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for top in TOP_LEVEL
        for init in (ROOT / top).rglob("__init__.py")
    }
    assert {"agent.learning", "agent.learning.central", "agent.runtime"} <= in_tree
    assert shipped == in_tree
