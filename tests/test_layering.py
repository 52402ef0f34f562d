"""The dependency rule of the layout (docs/architecture.md): the learning core is pure math
that the simulator, the agent and the aggregator share, so it never imports the network, the
clock, threads or the runtime; `protocol` knows nothing of training or of the programs."""

from __future__ import annotations

import ast
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
