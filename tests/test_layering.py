"""The dependency rule of the layout (docs/architecture.md): the learning core is pure math
that the simulator, the agent and the aggregator share, so it never imports the network, the
clock, threads or the runtime; `protocol` knows nothing of training or of the programs."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
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


PACKAGES = ("agent", "coordinator", "protocol", "edgefl", "firmware_profiles")
"""The packages whose modules may not import each other in a circle."""


def module_files(root: Path) -> dict[str, Path]:
    """Every module of the `PACKAGES` under `root` by dotted name (a package by its own)."""
    modules: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def import_graph(root: Path) -> dict[str, set[str]]:
    """Which of the project's modules each module imports, counting every import statement:
    at module level, inside functions and under TYPE_CHECKING, since a type-only or a late
    import couples the two modules as much as any (a change to either may break the other).
    A name from a package counts as its submodule where there is one; a module's imports of
    its own packages and a package's of its own submodules are left out, as every module
    loads the packages above it."""
    modules = module_files(root)

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            for target in filter(None, map(owner, targets)):
                own_package = target == name or name.startswith(target + ".")
                own_submodule = path.name == "__init__.py" and target.startswith(name + ".")
                if not own_package and not own_submodule:
                    graph[name].add(target)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules that import each other in a circle, one sorted list per circle (each
    strongly connected component of more than one module): those each reaches the other."""
    reach: dict[str, set[str]] = {}
    for start in graph:
        seen: set[str] = set()
        todo = [start]
        while todo:
            for target in graph[todo.pop()] - seen:
                seen.add(target)
                todo.append(target)
        reach[start] = seen
    circles = {tuple(sorted(m for m in reach[start] if start in reach[m])) for start in graph}
    return sorted(list(circle) for circle in circles if len(circle) > 1)


def test_no_module_imports_itself_through_others() -> None:
    """No import cycle among the project's modules: each module can be read, tested and
    changed on top of those it imports alone, and a type-only import is no exception."""
    cycles = import_cycles(import_graph(ROOT))
    described = "; ".join(f"{len(c)} modules: {', '.join(c)}" for c in cycles)
    assert not cycles, f"import cycles: {described}"


def test_the_cycle_rule_counts_late_and_type_only_imports(tmp_path: Path) -> None:
    """A function-level import and one under TYPE_CHECKING close a circle like any."""
    package = tmp_path / "agent"
    package.mkdir()
    (package / "__init__.py").write_text("from agent.a import A\n")
    (package / "a.py").write_text("def f():\n    from . import b\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from agent.c import C\n"
    )
    (package / "c.py").write_text("import agent.a\nfrom agent import b\n")
    (package / "d.py").write_text("from agent.c import C\n")
    assert import_cycles(import_graph(tmp_path)) == [["agent.a", "agent.b", "agent.c"]]
    (package / "c.py").write_text("from agent import d\n")
    assert import_cycles(import_graph(tmp_path)) == [["agent.c", "agent.d"]]


WALK_COMMANDS = """
import sys
import click
from agent.cli import main as edge_agent
from coordinator.cli import main as coordinator

def paths(command, path=()):
    yield path
    if isinstance(command, click.Group):
        context = click.Context(command)
        for name in command.list_commands(context):
            yield from paths(command.get_command(context, name), (*path, name))

seen = []
state = ["--state-dir", sys.argv[1]]
for run in ([*state, "key"], [*state, "models"]):  # for real: a key made, no model kept
    try:
        edge_agent(run, prog_name="edge-agent")
    except SystemExit as done:
        assert not done.code, (run, done.code)
    assert "torch" not in sys.modules, run
for program, name in ((edge_agent, "edge-agent"), (coordinator, "coordinator")):
    for path in paths(program):
        for flag in (["--help"], ["--version"])[: 2 if not path else 1]:
            try:
                program([*path, *flag], prog_name=name)
            except SystemExit:
                pass
            assert "torch" not in sys.modules, (name, *path, *flag)
            seen.append(" ".join((name, *path)))
print(sorted(set(seen)))
import agent.workload  # control: the probe sees torch once a module that trains loads
print("torch" in sys.modules)
"""


LAZY = {k: v for k, v in os.environ.items() if k != "EAGER_IMPORT"}
"""The environment of the probes: lazy_loader loads every name at once under EAGER_IMPORT."""


def test_every_command_starts_without_torch(tmp_path: Path) -> None:
    """`edge-agent key` and `models`, and every `--help` and `--version`, start in a fraction
    of a second: torch (seconds to import on a Raspberry Pi, 200 MB of memory) loads only
    where a command trains, exports or aggregates."""
    done = subprocess.run(
        [sys.executable, "-c", WALK_COMMANDS, str(tmp_path / "state")],
        cwd=ROOT,
        env=LAZY,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    walked, saw_torch = done.stdout.splitlines()[-2:]
    for command in ("edge-agent models use", "coordinator serve", "coordinator simulate"):
        assert repr(command) in walked
    assert saw_torch == "True", "the probe sees torch load"


def test_predict_serves_a_model_without_torch(tmp_path: Path) -> None:
    """`edge-agent predict` on a device loads onnxruntime, not torch."""
    from agent.learning.models import build_model
    from agent.onnx_export import export_onnx

    model = build_model("mlp", (6,), 3, seed=0)
    export_onnx(model, model.state_dict(), (6,), tmp_path / "m.onnx")
    np.save(tmp_path / "x.npy", np.random.default_rng(0).random((4, 6), dtype=np.float32))
    probe = (
        "import sys\n"
        "from agent.cli import main\n"
        "main(['predict', 'x.npy', '--model', 'm.onnx', '--json'], standalone_mode=False)\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        env={**LAZY, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    answer, saw_torch = done.stdout.splitlines()[-2:]
    assert len(json.loads(answer)["predictions"]) == 4
    assert saw_torch == "False"


def test_every_name_the_lazy_packages_list_exists() -> None:
    """A name in an `__init__.pyi` that its module lacks fails on first use only; loading
    them all at once (lazy_loader's EAGER_IMPORT) finds it now."""
    probe = (
        "import agent.device, agent.learning, agent.runtime, protocol\n"
        "packages = (agent.learning, agent.device, agent.runtime, protocol)\n"
        "print(*(len(p.__all__) for p in packages))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        env={**os.environ, "EAGER_IMPORT": "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["74", "15", "23", "57"]
