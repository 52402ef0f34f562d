"""edgefl's Python API: configure a run, simulate or emulate a fleet, read the report.

    import edgefl

    config = edgefl.config(
        strategy="dadpfl",
        dataset="python:./sensors.py:load",   # or digits, mnist1d, npz:PATH, ...
        model="./nets.py:build",              # or a function: model=build
        task="regression",
        agents=8,
        rounds=20,
    )
    report = edgefl.simulate(config)
    print(report.metric, report.mean_metric)

`config` takes the long options of ``coordinator simulate`` as keywords (dashes as
underscores) and validates them as the command line does: one `ConfigError` sentence for a
bad value. A model, loss, metric or data source may be given as a function, the strategy as
a class (``strategy=FedAvgM``, examples/own_strategy): it is named by its import path (a
function of a script run as ``python script.py`` by the script's file), so agent processes
can import it too. The commands ``coordinator simulate`` and ``coordinator
emulate`` run the same code as `simulate` and `emulate`; `run_agent` and `run` are
``edge-agent`` and ``coordinator run`` on a real fleet, taking the same options.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.experiment import ExperimentConfig as Config
from agent.learning import StrategyConfig
from agent.learning.config import TASKS
from agent.learning.tasks import Task
from agent.options import experiment_config
from agent.report import metric_of
from agent.runfile import lab_config
from agent.user_code import FILE_MODULE_PREFIX

__all__ = [
    "TASKS",
    "Config",
    "ConfigError",
    "Report",
    "Task",
    "config",
    "emulate",
    "run",
    "run_agent",
    "simulate",
]


class ConfigError(ValueError):
    """A configuration that cannot run, in one sentence (what and why)."""


USER_CODE = ("model", "loss", "metric", "strategy")
"""Options that name the user's code; `config` also takes functions (a class for the
strategy) for them."""


def _import_path(function: Callable[..., Any], what: str) -> str:
    """MODULE:NAME for a module-level function; FILE.py:NAME for one of the script that
    runs as __main__, which another process can only import by its file."""
    name = getattr(function, "__qualname__", "")
    module = getattr(function, "__module__", None)
    if not name.isidentifier() or module is None:
        raise ConfigError(
            f"{what} must be defined at the top level of a module or script "
            f"(agents import it by name), got {function!r}"
        )
    if module.startswith(FILE_MODULE_PREFIX):  # imported from ./FILE.py: name it by its file
        return f"{sys.modules[module].__file__}:{name}"
    if module == "__main__":
        script = getattr(sys.modules["__main__"], "__file__", None)
        if script is None:
            raise ConfigError(
                f"{what} {name} is defined interactively: put it in a .py file so agents can "
                "import it"
            )
        return f"{Path(script).resolve()}:{name}"
    return f"{module}:{name}"


def config(run_file: str | Path | None = None, **options: Any) -> Config:
    """A validated run configuration from ``coordinator simulate``'s long options as keywords
    (``agents=8, rounds=20, strategy="fedavg"``), over a `run_file`'s [run] table if given;
    anything not given keeps its default. `model`, `loss`, `metric` may be functions,
    `dataset` a function returning the data (``x``, ``(x, y)`` or a dict with x, y and
    groups); ConfigError for a bad value."""
    values = dict(options)
    for key in USER_CODE:
        if callable(values.get(key)):
            values[key] = _import_path(values[key], key)
    if callable(values.get("dataset")):
        values["dataset"] = "python:" + _import_path(values["dataset"], "dataset")
    known = {f.name for f in dataclasses.fields(Config)} - {
        "learning",
        "model_fingerprint",
        "strategy_fingerprint",
    }
    known |= {f.name for f in dataclasses.fields(StrategyConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown option {unknown[0]!r}; see coordinator simulate --help")
    try:
        return lab_config(run_file, values) if run_file else experiment_config(values)
    except (ValueError, TypeError) as exc:
        raise ConfigError(str(exc)) from None


@dataclass(frozen=True)
class Report:
    """A run's report, as ``coordinator simulate --report`` writes it: the configuration,
    one record per round (each agent's figures), and the run's summary."""

    config: dict[str, Any]
    rounds: list[dict[str, Any]]
    summary: dict[str, Any]

    @classmethod
    def of(cls, data: Mapping[str, Any]) -> Report:
        return cls(dict(data.get("config", {})), list(data["rounds"]), dict(data["summary"]))

    @classmethod
    def load(cls, path: str | Path) -> Report:
        """A report file written by the commands or by `save`."""
        return cls.of(json.loads(Path(path).read_text()))

    def as_dict(self) -> dict[str, Any]:
        return {"config": self.config, "rounds": self.rounds, "summary": self.summary}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.as_dict(), indent=1))
        return path

    @property
    def metric(self) -> str:
        """The task's metric: accuracy, mae, reconstruction_error or a custom one."""
        return metric_of(self.as_dict())[0]

    @property
    def higher_is_better(self) -> bool:
        return metric_of(self.as_dict())[1]

    @property
    def mean_metric(self) -> float:
        """The metric averaged over the agents of the last round."""
        return float(self.summary[f"mean_{self.metric}"])

    def final(self) -> dict[str, float]:
        """Each agent's metric in the last round."""
        if not self.rounds:
            return {}
        return {k: a[self.metric] for k, a in self.rounds[-1]["agents"].items()}


def _log_as_the_commands() -> None:
    """Warnings in the commands' one format (each line naming its agent), unless the program
    set its own logging up (as `logging.basicConfig` does nothing then)."""
    if not logging.getLogger().handlers:
        from protocol.cli import setup_logging

        setup_logging(0, "text")


def simulate(
    config: Config,
    *,
    workers: int = 1,
    backend: str = "local",
    ray_address: str | None = None,
    progress: Callable[[int, str], None] | None = None,
) -> Report:
    """Run the whole fleet in this process (no network); `progress(round, agent)` after each
    agent's round. The agents train in `workers` processes, or with `backend="ray"` as Ray
    tasks on the cluster at `ray_address` (none: a Ray started here with `workers` CPUs, 1:
    all); the same report either way."""
    from coordinator.simulate import Simulation
    from protocol.extras import MissingExtra

    _log_as_the_commands()
    try:
        simulation = Simulation(config, workers, backend, ray_address)
    except (ValueError, OSError) as exc:
        raise ConfigError(str(exc)) from None
    except MissingExtra as exc:  # --backend ray without Ray: the same line as the command's
        raise ConfigError(exc.message) from None
    return Report.of(simulation.run(progress))


def emulate(
    config: Config,
    *,
    agents_per_process: int | None = None,
    workdir: str | Path | None = None,
    round_timeout_s: float = 120.0,
) -> Report:
    """Run the fleet as real agent processes over an embedded MQTT broker on loopback, with
    a coordinator in this process, and return the same report as `simulate` (plus what only
    a network has: waiting and stragglers). Logs and state go to `workdir` (a temporary
    folder by default)."""
    from coordinator.broker import EmbeddedBroker
    from coordinator.emulate import Emulation, EmulationOptions, auto_agents_per_process
    from coordinator.ports import free_port

    _log_as_the_commands()
    folder = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="emulate-"))
    options = EmulationOptions(
        workdir=folder,
        round_timeout_s=round_timeout_s,
        agents_per_process=agents_per_process or auto_agents_per_process(config.agents),
    )
    broker = EmbeddedBroker(host="127.0.0.1", port=free_port())
    try:
        emulation = Emulation(config, broker.address, options)
    except (ValueError, OSError) as exc:
        raise ConfigError(str(exc)) from None
    broker.start()
    try:
        return Report.of(emulation.run())
    finally:
        broker.stop()


def _arguments(options: Mapping[str, Any]) -> list[str]:
    """Command-line arguments from keyword options: ``round_timeout=30`` is
    ``--round-timeout 30``, ``once=True`` is ``--once``; None and False are left out."""
    args: list[str] = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is None or value is False:
            continue
        args += [flag] if value is True else [flag, str(value)]
    return args


def _invoke(command: Any, args: list[str], prog: str, obj: Any = None) -> Any:
    """Run a click command in this thread and return what it returns; its one-line errors
    become `ConfigError`."""
    import click

    try:
        return command.main(args, prog_name=prog, obj=obj, standalone_mode=False)
    except click.ClickException as exc:
        raise ConfigError(exc.format_message()) from None


def run_agent(*, broker: str, stop: threading.Event | None = None, **options: Any) -> None:
    """Run an edge agent in this thread, as ``edge-agent --broker BROKER`` with `options`
    (its long options as keywords: ``data="python:sensors:read"``, ``agent_id`` for --id,
    ``state_dir``, ``once=True``, ``expect=3, run="run.toml"``...). It takes part in every
    run that names it until `stop` is set (or, with ``once``, after one run). Several agents
    may run in threads of one process: signals are left to the caller."""
    from agent.cli import Hosted
    from agent.cli import main as edge_agent

    stop = stop or threading.Event()
    renamed = {"id" if k == "agent_id" else k: v for k, v in options.items()}
    hosted = Hosted(started=lambda: stop, joined=lambda _transport: None)
    _invoke(edge_agent, ["--broker", broker, *_arguments(renamed)], "edge-agent", hosted)


def run(run_file: str | Path, *, report: str | Path | None = None, **options: Any) -> Report:
    """Run RUN_FILE on the fleet's devices, as ``coordinator run`` with `options` (its long
    options as keywords: ``broker="gateway:1883"``, ``fleet``, ``runs_dir``, ``force``...),
    and return its report (also written to `report`; by default where the command writes
    it: report.json or the first report-N.json not taken, the interrupted run's own report
    when going on with one). Call it from the main thread: like the command, it stops
    cleanly on SIGINT or SIGTERM, and puts the previous handlers back after."""
    from coordinator.cli import main as coordinator

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    named = [] if report is None else ["--report", str(report)]
    args = ["run", str(run_file), *named, *_arguments(options)]
    try:
        written = _invoke(coordinator, args, "coordinator")
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return Report.load(written)
