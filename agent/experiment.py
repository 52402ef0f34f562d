"""An experiment's configuration and the learning workload it implies for each agent.

The simulator and every networked agent build their model, learner and local data through
`build_workload` from the same `ExperimentConfig`, so they compute on identical inputs: an
agent process keeps only its own share of the partition, picked by its place in the sorted
roster.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from agent import data as datasets
from agent import models
from agent.strategies import Learner, LocalData, StrategyConfig, param


@dataclass(frozen=True)
class ExperimentConfig:
    """What to learn on and how: data, fleet size, seed, and the strategy's hyper-parameters."""

    dataset: str = param(
        "mnist1d",
        "Dataset: digits, mnist1d, synthetic[:ALPHA,BETA], npz:PATH, imagefolder:PATH or "
        "cifar10:PATH.",
    )
    model: str | None = param(
        None, f"Model: {', '.join(models.MODEL_NAMES)} [default: per dataset]."
    )
    agents: int = param(20, "Number of agents K.")
    partition: str = param(
        "dirichlet:0.3", "Data partition: iid, dirichlet:ALPHA, pathological:CLASSES or natural."
    )
    seed: int = param(1, "Fleet seed: data split, initial weights, masks, neighbours, order.")
    threads: int = param(1, "Torch threads (results are reproducible for a given count).")
    learning: StrategyConfig = field(default_factory=StrategyConfig)

    def validate(self) -> None:
        """Reject impossible configurations with one clear sentence each."""
        cfg = self.learning
        if self.agents < 1:
            raise ValueError(f"need at least 1 agent, got {self.agents}")
        if cfg.rounds < 1 or cfg.epochs < 1 or cfg.batch_size < 1:
            raise ValueError("rounds, epochs and batch size must be at least 1")
        decentralized = cfg.strategy in ("dadpfl", "dispfl", "dfedavgm")
        if decentralized and cfg.topology == "random" and not 1 <= cfg.neighbours < self.agents:
            raise ValueError(
                f"--neighbours must be between 1 and agents - 1 = {self.agents - 1} "
                f"for {cfg.strategy}, got {cfg.neighbours}"
            )
        if cfg.max_wait < 0:
            raise ValueError(f"--max-wait must be >= 0, got {cfg.max_wait}")
        if not 0 < cfg.density <= 1:
            raise ValueError(f"--density must be in (0, 1], got {cfg.density}")
        if not 0 <= cfg.target_sparsity < 1:
            raise ValueError(f"--target-sparsity must be in [0, 1), got {cfg.target_sparsity}")
        if self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        if cfg.schedule_b < 0:
            # t_1 = 2 t* + b >= 2 t* lets networked agents decide with old votes only.
            raise ValueError(f"--schedule-b must be >= 0, got {cfg.schedule_b}")


@dataclass
class Workload:
    """What a set of agents computes with: the shared learner and each agent's data."""

    model_name: str
    learner: Learner
    data: dict[str, LocalData]


def build_workload(
    config: ExperimentConfig, roster: list[str], agents: Iterable[str] | None = None
) -> Workload:
    """Load the dataset, partition it over the sorted roster, build the model and learner.

    `agents` limits which agents' data is kept (a networked agent keeps its own only).
    """
    config.validate()
    if len(roster) != config.agents:
        raise ValueError(f"the roster has {len(roster)} agents but the run expects {config.agents}")
    torch.set_num_threads(config.threads)
    dataset = datasets.load_dataset(config.dataset, seed=config.seed)
    parts = datasets.partition(dataset, config.agents, config.partition, seed=config.seed)
    model_name = config.model or models.default_model(config.dataset.split(":")[0])
    model = models.build_model(
        model_name, dataset.input_shape, dataset.num_classes, seed=config.seed
    )
    learner = Learner(
        model, dataset.input_shape, models.prunable_names(model), config.learning, config.seed
    )
    wanted = set(roster if agents is None else agents)
    data = {
        agent_id: LocalData(
            torch.from_numpy(part.train.x),
            torch.from_numpy(part.train.y),
            torch.from_numpy(part.test.x),
            torch.from_numpy(part.test.y),
        )
        for agent_id, part in zip(sorted(roster), parts, strict=True)
        if agent_id in wanted
    }
    return Workload(model_name, learner, data)


def config_from_dict(data: dict) -> ExperimentConfig:
    """Rebuild a config sent as plain data (the coordinator's run message); ValueError if bad."""
    try:
        learning = StrategyConfig(**data.get("learning", {}))
        config = ExperimentConfig(**{**data, "learning": learning})
    except TypeError as exc:
        raise ValueError(f"bad run configuration: {exc}") from None
    config.validate()
    return config
