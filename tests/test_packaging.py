"""An installed edgefl has every package of the source tree: `pip install .` (not only an
editable install) must ship the subpackages (agent.learning, agent.runtime, ...), and every
distribution it imports is declared. tests/test_install.py installs the wheel for real."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from setuptools import find_packages

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
TOP_LEVEL = ("agent", "coordinator", "protocol", "firmware_profiles", "edgefl")


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


UNDECLARED = ROOT.parent / "shared" / "tools" / "undeclared_imports.py"


@pytest.mark.skipif(not UNDECLARED.is_file(), reason="../shared/tools is not beside the checkout")
def test_every_imported_distribution_is_declared() -> None:
    """Each distribution the shipped packages import is in `dependencies` or an extra: one
    that is only here because another package pulled it in fails a clean install."""
    done = subprocess.run(
        [sys.executable, str(UNDECLARED)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout.strip().splitlines()[-1] == "undeclared imports: 0", done.stdout
    assert done.returncode == 0
