"""The dependency rule of the layout (docs/architecture.md): the learning core is pure math
that the simulator, the agent and the aggregator share, so it never imports the network, the
clock, threads or the runtime; `protocol` knows nothing of training or of the programs."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LEARNING_FORBIDDEN = (
    "protocol",
    "paho",
    "threading",
    "time",
    "socket",
    "asyncio",
    "agent.runtime",
    "agent.device",
    "agent.cli",
    "coordinator",
)
PROTOCOL_FORBIDDEN = ("agent", "coordinator", "torch")


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at any depth of its code (function-level imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def violations(path: Path, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        name
        for name in imported_modules(path)
        if any(name == bad or name.startswith(bad + ".") for bad in forbidden)
    )


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("path", sources("agent/learning"), ids=lambda p: p.name)
def test_the_learning_core_imports_no_network_clock_thread_or_runtime(path: Path) -> None:
    assert violations(path, LEARNING_FORBIDDEN) == []


@pytest.mark.parametrize("path", sources("protocol"), ids=lambda p: p.name)
def test_protocol_knows_nothing_of_agent_coordinator_or_training(path: Path) -> None:
    assert violations(path, PROTOCOL_FORBIDDEN) == []


def test_the_rule_catches_an_import_at_any_depth(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import math\n\ndef f():\n    from protocol.errors import ProtocolError\n")
    assert violations(module, LEARNING_FORBIDDEN) == [
        "protocol.errors",
        "protocol.errors.ProtocolError",
    ]
    module.write_text("import timeit\nfrom agent.learning import sparse\n")
    assert violations(module, LEARNING_FORBIDDEN) == []


def test_the_gateway_commands_start_without_torch() -> None:
    """A gateway's `coordinator status` or `serve` starts in a fraction of a second: they load
    neither torch nor the learning core (seconds to import on a Raspberry Pi); only the lab's
    commands and a run that aggregates do."""
    probe = (
        "import sys\n"
        "from coordinator.cli import main\n"
        "gateway = sorted(main.commands)  # all but the lab's, which load when asked for\n"
        "assert {'serve', 'status', 'admit', 'run'} <= set(gateway), gateway\n"
        "for name in gateway:\n"
        "    try:\n"
        "        main([name, '--help'], prog_name='coordinator')\n"
        "    except SystemExit:\n"
        "        pass\n"
        "    assert 'torch' not in sys.modules, name\n"
        "main(['simulate', '--help'], standalone_mode=False)\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "True", "the probe sees simulate load torch"
