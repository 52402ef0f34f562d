"""The learning workload an experiment's configuration implies for each agent.

The simulator and every networked agent build their model, learner and local data through
`build_workload` from the same `ExperimentConfig`, so they compute on identical inputs: an
agent process keeps only its own share of the partition, picked by its place in the sorted
roster.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from agent import data as datasets
from agent.device import Budget, BudgetLimits, RoundWork, compute_budget, nominal_reading
from agent.experiment import (
    ExperimentConfig,
    agent_profiles,
    attackers,
    default_model,
    device_outputs,
)
from agent.learning import Learner, LocalData, backdoor, models, robust_rules
from agent.learning.tasks import Task
from agent.user_code import fingerprint, is_import_path

if TYPE_CHECKING:
    from agent.own_data import OwnData


@dataclass
class Workload:
    """What a set of agents computes with: the shared learner and each agent's data."""

    model_name: str
    learner: Learner
    data: dict[str, LocalData]


Partitioned = tuple[datasets.Dataset, list[datasets.AgentData]]


@dataclass
class _SharedPartitions:
    """The process's shared dataset and partition (`share_partitions`), if sharing is on."""

    enabled: bool = False
    last: dict[tuple[object, ...], Partitioned] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


_SHARED = _SharedPartitions()


def share_partitions() -> None:
    """Agents sharing a process (agent/host.py) share one loaded, partitioned dataset: each
    agent building its own made every thread load and split the whole pool at once (1,000
    agents of a 200,000-sample set: 6.5 GB a process of 125 agents, the freed copies held
    by the allocator's per-thread arenas), where one copy serves them all."""
    _SHARED.enabled = True


_COMPUTE: list[threading.Semaphore] = []
"""The process's compute slots, once `share_compute` made them; none: no limit."""


def share_compute(slots: int = 1) -> None:
    """Agents sharing a process (agent/host.py) compute `slots` at a time. A hundred agent
    threads training at once gain nothing on a few cores: they take turns with the
    interpreter lock anyway, and keep the process's network threads waiting for it. Which
    agent computes first changes no result: each agent's computation is its own."""
    _COMPUTE[:] = [threading.Semaphore(slots)]


@contextlib.contextmanager
def compute_slot() -> Iterator[None]:
    """Hold one of the process's compute slots (`share_compute`) while computing."""
    if not _COMPUTE:
        yield
        return
    with _COMPUTE[0]:
        yield


def partitioned(config: ExperimentConfig) -> Partitioned:
    """The run's dataset and its partition over the agents: made here, or the process's
    shared copy (`share_partitions`; the data is only read, never changed in place)."""
    key = (
        config.dataset,
        config.seed,
        config.agents,
        config.partition,
        config.task,
        config.test_size,
        config.min_samples,
    )

    def make() -> Partitioned:
        dataset = datasets.for_task(
            datasets.load_dataset(config.dataset, seed=config.seed), config.task
        )
        parts = datasets.partition(
            dataset,
            config.agents,
            config.partition,
            seed=config.seed,
            test_size=config.test_size,
            min_samples=config.min_samples,
        )
        return dataset, parts

    # A python: source is the user's function, called for every run (it may have more data).
    if not _SHARED.enabled or config.dataset.startswith(datasets.PYTHON_SOURCE):
        return make()
    with _SHARED.lock:
        if key not in _SHARED.last:
            _SHARED.last.clear()  # one run at a time: the previous one's data goes
            _SHARED.last[key] = make()
        return _SHARED.last[key]


def build_workload(
    config: ExperimentConfig, roster: list[str], agents: Iterable[str] | None = None
) -> Workload:
    """Load the dataset, partition it over the sorted roster, build the model and learner.

    `agents` limits which agents' data is kept (a networked agent keeps its own only). A run
    on the devices' own data has no dataset here: its learner is built from the run's input
    shape and classes, and an agent adds its data with `own_workload`.
    """
    config.validate()
    if len(roster) != config.agents:
        raise ValueError(f"the roster has {len(roster)} agents but the run expects {config.agents}")
    torch.set_num_threads(config.threads)
    if config.on_devices:
        assert config.input_shape is not None  # validated
        model_name, learner = build_learner(config, config.input_shape, device_outputs(config))
        return Workload(model_name, learner, {})
    dataset, parts = partitioned(config)
    outputs = datasets.num_outputs(dataset, config.task)
    model_name, learner = build_learner(config, dataset.input_shape, outputs)
    wanted = set(roster if agents is None else agents)
    data = {
        agent_id: LocalData(
            torch.from_numpy(part.train.x),
            torch.from_numpy(part.train.y),
            torch.from_numpy(part.test.x),
            torch.from_numpy(part.test.y),
            torch.from_numpy(part.val.x),
            torch.from_numpy(part.val.y),
        )
        for agent_id, part in zip(sorted(roster), parts, strict=True)
        if agent_id in wanted
    }
    if config.attack in robust_rules.DATA_ATTACKS:
        for agent_id in set(attackers(config, roster)) & set(data):
            data[agent_id] = backdoor.poisoned_data(
                data[agent_id], config.attack, config.seed, outputs
            )
    return Workload(model_name, learner, data)


def data_misfit(config: ExperimentConfig, own: OwnData) -> str | None:
    """Why this device's data does not fit the run `config` (its model's input shape and
    classes or targets, its minimum sample count); None when it fits."""
    from agent.own_data import misfit  # it reads DEFAULT_MIN_SAMPLES here

    return misfit(
        own.describe(),
        config.input_shape or (),
        config.classes or 0,
        config.min_samples,
        task=config.task,
        targets=config.targets if config.task == "regression" else None,
    )


def own_workload(
    config: ExperimentConfig, roster: list[str], agent_id: str, own: OwnData
) -> Workload:
    """One device's workload in a run on its own data: the run's model, and the device's data
    as it is now (a python: source is called again, so data collected since the last run is
    in) split locally (seeded, stratified) into train, validation and test."""
    from agent.own_data import own_for_task, reloaded, split_own_data

    own = reloaded(own, config.input_shape)
    problem = data_misfit(config, own)
    if problem is not None:
        raise ValueError(problem)
    workload = build_workload(config, roster, agents=[])
    workload.data[agent_id] = split_own_data(own_for_task(own, config.task), config.seed, agent_id)
    return workload


_MODEL_INIT = threading.Lock()
"""Held while a model is built: `build_model` seeds the process's global torch RNG, so agents
sharing a process (agent/host.py) build one at a time (a seed set by one thread in the middle
of another's draws would change that agent's initial weights)."""


def build_learner(
    config: ExperimentConfig, input_shape: tuple[int, ...], outputs: int
) -> tuple[str, Learner]:
    """The run's model (the same initial weights on every agent: drawn from the seed) and the
    learner of its strategy; ValueError with one line for a model this device cannot build,
    one that builds differently from the run's, or one the task or the rules cannot use."""
    model_name = config.model or default_model(config.dataset, input_shape)
    with _MODEL_INIT:
        model = models.build_model(model_name, input_shape, outputs, seed=config.seed)
    task = config.learning_task()
    if is_import_path(model_name):
        check_user_model(config, task, model, model_name, input_shape, outputs)
    learner = Learner(
        model, input_shape, models.prunable_names(model), config.learning, config.seed, task
    )
    return model_name, learner


def check_user_model(
    config: ExperimentConfig,
    task: Task,
    model: torch.nn.Module,
    name: str,
    input_shape: tuple[int, ...],
    outputs: int,
) -> None:
    """A user's model, before any round: the run's architecture (its fingerprint), supported
    by the learning rules, and taking the run's input to an output its task can score."""
    if config.model_fingerprint and fingerprint(model) != config.model_fingerprint:
        raise ValueError(
            f"model {name!r} builds a different architecture here (fingerprint "
            f"{fingerprint(model)}) than the run's ({config.model_fingerprint}): every device "
            "needs the same version of the model code"
        )
    try:
        models.check_supported(model)
    except ValueError as exc:
        raise ValueError(f"model {name!r}: {exc}") from None
    x = torch.zeros((2, *input_shape))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            output = model(x)
    except Exception as exc:
        raise ValueError(
            f"model {name!r} cannot take a batch of input shape {input_shape}: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    finally:
        model.train(was_training)
    if not isinstance(output, torch.Tensor):
        raise ValueError(f"model {name!r} must return one tensor, got {type(output).__name__}")
    targets = {
        "classification": torch.zeros(2, dtype=torch.int64),
        "regression": torch.zeros((2,) if outputs == 1 else (2, outputs)),
        "reconstruction": torch.zeros((2, 0)),
    }
    task.check(output, x, targets[task.kind])


def fingerprinted(config: ExperimentConfig) -> ExperimentConfig:
    """A run on devices' own data with a user model, carrying the model's fingerprint (built
    here once from the run's input shape and outputs), so each device checks its copy."""
    if not (config.on_devices and config.model and is_import_path(config.model)):
        return config
    assert config.input_shape is not None  # validated
    with _MODEL_INIT:
        model = models.build_model(config.model, config.input_shape, device_outputs(config), seed=0)
    return dataclasses.replace(config, model_fingerprint=fingerprint(model))


def nominal_budgets(
    config: ExperimentConfig, workload: Workload, roster: list[str]
) -> dict[str, Budget]:
    """Each agent's budget on an idle board of its profile: deterministic, so the simulator
    and an emulated fleet agree on p_k (a real device reads itself each round instead)."""
    learner = workload.learner
    budgets = {}
    for agent_id, profile in agent_profiles(config, roster).items():
        if agent_id not in workload.data:
            continue
        work = round_work(config, learner, len(workload.data[agent_id].y_train))
        limits = BudgetLimits(round_time_s=config.round_time_s)
        budgets[agent_id] = compute_budget(profile, nominal_reading(profile), work, limits)
    return budgets


def round_work(config: ExperimentConfig, learner: Learner, samples: int) -> RoundWork:
    """A full dense local round of this run on `samples` samples, for the budget rule."""
    cfg = config.learning
    return RoundWork.for_model(
        learner.facts.model,
        learner.facts.input_shape,
        samples=samples,
        epochs=cfg.epochs,
        batch_size=cfg.batch_size,
        dense_grad_samples=cfg.rigl_batches * cfg.batch_size if learner.sparse else 0,
        held_models=cfg.neighbours if learner.decentralized else 1,
    )
