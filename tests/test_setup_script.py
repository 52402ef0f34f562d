"""README.md's first command on a Debian system Python that refuses pip (PEP 668), as on
Debian 12 and Raspberry Pi OS: scripts/setup.sh makes its own virtual environment with that
Python, installs there, and the main job then runs exactly as README.md writes it.

(CI's own run of scripts/setup.sh covers a Python whose pip installs freely.)"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from bench.install_footprint import SOURCES, copy_sources, externally_managed_python

ROOT = Path(__file__).resolve().parents[1]
SYSTEM_PYTHON = externally_managed_python()

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(SYSTEM_PYTHON is None, reason="no externally managed system Python"),
    pytest.mark.skipif(
        os.environ.get("EDGEFL_SETUP_TEST") != "1",
        reason="installs everything anew (about 100 s): EDGEFL_SETUP_TEST=1 runs it; CI runs "
        "scripts/setup.sh itself and tests/test_install.py installs on this Python",
    ),
]


def test_readme_first_command_on_an_externally_managed_python(tmp_path: Path) -> None:
    checkout = copy_sources(tmp_path / "edgefl", (*SOURCES, "scripts"))
    first = re.search(r"^bash scripts/setup\.sh && .+$", (ROOT / "README.md").read_text(), re.M)
    assert first, "README.md's first command is not `bash scripts/setup.sh && ...`"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    system_bin = str(Path(str(SYSTEM_PYTHON)).parent)
    env["PATH"] = f"{system_bin}:{env['PATH']}"  # `python3` is Debian's
    env["PIP_NO_COMPILE"] = "0"  # pip reads it inverted: no .pyc written, torch in 10 s not 45
    done = subprocess.run(
        ["bash", "-c", first.group(0)],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "setup: making the virtual environment .venv" in done.stdout
    config = (checkout / ".venv" / "pyvenv.cfg").read_text()
    assert f"home = {system_bin}" in config  # made by the system Python
    assert (checkout / "report.json").is_file()
    assert (checkout / "plots" / "accuracy.png").is_file()
    system_packages = subprocess.run(
        [str(SYSTEM_PYTHON), "-c", "import importlib.util as u; print(u.find_spec('coordinator'))"],
        capture_output=True, text=True, cwd=tmp_path, timeout=60,
    ).stdout  # fmt: skip
    assert system_packages.strip() == "None"  # the system Python was left alone
