"""`coordinator simulate --workers N`: a round's training in N processes at once.

The simulator's agents train on inputs fixed before they start (ALGORITHMS.md 1: an agent's
round depends only on its own state, data and round-seeded generator, and on the models it
receives), so they can train on several cores and give, bit for bit, what one process gives:

* a centralized round's participants all train on the same view of the server (`fit`);
* a decentralized agent trains once its prior neighbours in the round's reuse order have
  published (`local_round`): DisPFL's and DFedAvgM's agents have no prior neighbours, so a
  whole round trains at once; DA-DPFL's reuse chains are 4 to 6 agents long at 8 to 50 agents
  with 5 neighbours.

The simulator keeps everything else (inboxes, checks, aggregation, evaluation, early
stopping, traffic) and its order; only a participant's `Turn.train` and a decentralized agent's
`train_round` move here.

Each worker is a fresh interpreter (`spawn`: forking a process that already ran torch and a
progress thread is not safe) that builds the run's workload once from the config, as every
emulated agent does. Jobs go out one agent at a time (a centralized round's the most samples
first, so the workers finish together however unevenly the data is split); their tensors
travel as numpy arrays (`dumps`), about 10 times faster than torch's own pickling of small
tensors.
"""

from __future__ import annotations

import contextlib
import heapq
import io
import multiprocessing
import pickle
from abc import abstractmethod
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import torch

from agent.device import Budget
from agent.experiment import ExperimentConfig
from agent.learning import (
    AgentState,
    CentralStrategy,
    Fit,
    Learner,
    LocalData,
    Published,
    Reduction,
    RoundResult,
    ServerState,
    central_strategy,
    settle_round,
    train_round,
)
from agent.learning.central.participant import Turn
from agent.learning.costs import CostTable
from agent.workload import build_workload
from protocol.cli import log_settings, setup_logging
from protocol.log_context import agent_scope, process_name, set_process_name

__all__ = [
    "FitJob",
    "InProcess",
    "RoundJob",
    "LoggingAs",
    "StateStore",
    "States",
    "Stored",
    "Training",
    "TrainingPool",
    "dumps",
    "logging_here",
    "training_on",
    "when_ready",
    "worker_training",
]

T = TypeVar("T")


@dataclass(frozen=True)
class Stored:
    """An agent's state that the backend keeps (`coordinator.ray_backend.RayStates`: Ray's
    object store), by reference: what a job carries in its place, so that the simulator
    need not hold every agent's state between rounds."""

    ref: Any


class StateStore(MutableMapping[str, AgentState]):
    """The agents' states between rounds, as the simulator reads and writes them: held here
    (`States`) or by the backend (`coordinator.ray_backend.RayStates`), which a job then
    names by reference (`held`)."""

    @abstractmethod
    def held(self, k: str) -> AgentState | Stored:
        """What agent k's next job carries: its state, or a reference to it."""


class States(dict[str, AgentState], StateStore):
    """The agents' states held in this process: a job carries the state itself."""

    def held(self, k: str) -> AgentState | Stored:
        return self[k]


def own(held: T | Stored) -> T:
    """A job's state or received model, which a backend that ships them by reference has
    put in place where the job trains."""
    if isinstance(held, Stored):
        raise TypeError("a job's input was not resolved where it trains")
    return held


@dataclass(frozen=True)
class FitJob:
    """One participant's fit (`Turn.train`): its turn, its state before the round (or a
    reference to it: `Stored`) and the view of the server it trains from."""

    turn: Turn
    state: AgentState | Stored
    view: ServerState
    samples: int
    """Its training samples: what its fit costs, to hand out the longest first."""


@dataclass(frozen=True)
class RoundJob:
    """One decentralized agent's local round (`train_round`'s inputs but its data)."""

    agent: str
    state: AgentState | Stored
    inbox: Mapping[str, Published | Stored]
    """The models it received (or references to them: `Stored`)."""
    round: int
    prune_now: bool
    budget: Budget | None
    """The agent's nominal budget (None: it trains whole)."""
    costs: CostTable | None = None
    """The measured costs `--reduce prefix|width|auto` chooses by (None: the FLOP rules)."""
    weights: Mapping[str, float] | None = None
    """The senders' staleness weights of an asynchronous round (None: synchronous)."""


class Training(Protocol):
    """Where agents' rounds train: here (`InProcess`) or in worker processes
    (`TrainingPool`); the simulator's loop is the same on both."""

    slots: int
    """Rounds worth having under way at once."""

    def fit(
        self, jobs: Sequence[FitJob], meanwhile: Callable[[], None]
    ) -> Iterator[tuple[str, Fit]]:
        """Each job's fit, in the jobs' order, with `meanwhile` done here as they train."""
        ...

    def local_round(self, job: RoundJob) -> Future[tuple[RoundResult, Reduction]]:
        """The agent's round, started (or, on a backend that batches, queued until
        `started`): its result and reduction when it is done."""
        ...

    def started(self) -> None:
        """The rounds `local_round` queued are all asked for: send them off."""
        ...

    def keep(self, states: StateStore) -> StateStore:
        """Where the agents' states stay between this run's rounds, from `states` on."""
        ...


class Local:
    """What the backends on this machine share: states stay in the simulator's process,
    and a round starts as soon as it is asked for."""

    def started(self) -> None:
        return None

    def keep(self, states: StateStore) -> StateStore:
        return states


class InProcess(Local):
    """Training here, one agent after the other."""

    slots = 1

    def __init__(
        self, learner: Learner, data: Mapping[str, LocalData], strategy: CentralStrategy | None
    ) -> None:
        self.learner, self.data, self.strategy = learner, data, strategy

    def fit(
        self, jobs: Sequence[FitJob], meanwhile: Callable[[], None]
    ) -> Iterator[tuple[str, Fit]]:
        meanwhile()
        assert self.strategy is not None  # a centralized run has one
        for job in jobs:
            k = job.turn.agent
            with agent_scope(k):  # the learner's lines are this agent's
                state, data = own(job.state), self.data[k]
                fit = job.turn.train(self.strategy, self.learner, state, data, job.view)
            yield k, fit

    def local_round(self, job: RoundJob) -> Future[tuple[RoundResult, Reduction]]:
        done: Future[tuple[RoundResult, Reduction]] = Future()
        data = self.data[job.agent]
        p_k = job.budget.p_k if job.budget else None
        with agent_scope(job.agent):  # the learner's lines are this agent's
            result, reduction = train_round(
                self.learner,
                own(job.state),
                data,
                {j: own(model) for j, model in job.inbox.items()},
                job.round,
                job.prune_now,
                p_k,
                job.costs,
                job.budget.allowed_mb if job.budget else None,
                job.weights,
            )
            done.set_result((settle_round(self.learner, result, data, p_k), reduction))
        return done


def when_ready(
    order: Sequence[str],
    waits_for: Mapping[str, set[str]],
    start: Callable[[str], Future[T]],
    slots: int,
    started: Callable[[], None] = lambda: None,
) -> Iterator[tuple[str, T]]:
    """Start each of `order` once everything it `waits_for` has been yielded (the caller acts
    on each before asking for the next), at most `slots` at once, the earliest in `order`
    first, and call `started` after each wave of starts (a backend that batches sends them
    then); yield each as it finishes (those that finish together in `order`). With one slot
    that is `order` itself."""
    position = {k: i for i, k in enumerate(order)}
    waiting = {k: set(waits_for.get(k, ())) for k in order}
    needed_by: dict[str, list[str]] = {}
    for k in order:
        for j in waiting[k]:
            needed_by.setdefault(j, []).append(k)
    ready = [position[k] for k in order if not waiting[k]]
    under_way: dict[Future[T], str] = {}
    while ready or under_way:
        while ready and len(under_way) < slots:
            k = order[heapq.heappop(ready)]
            under_way[start(k)] = k
        started()
        finished, _ = wait(under_way, return_when=FIRST_COMPLETED)
        for future in sorted(finished, key=lambda f: position[under_way[f]]):
            k = under_way.pop(future)
            yield k, future.result()
            for later in needed_by.get(k, []):
                waiting[later].discard(k)
                if not waiting[later]:
                    heapq.heappush(ready, position[later])


_WORKER: list[InProcess] = []
"""A worker process's own `InProcess`: the run's learner, data and central strategy."""


LoggingAs = tuple[int, str, str]
"""The simulator's logging (verbosity, format, program name), which its workers take on."""


def logging_here() -> LoggingAs:
    """This process's logging, for workers to take on (`worker_training`)."""
    return (*log_settings(), process_name())


def worker_training(
    config: ExperimentConfig, roster: list[str], logging_as: LoggingAs
) -> InProcess:
    """A worker's training: the run's workload, as the simulator built it, and its logging as
    the simulator's, so that its lines are in the one format with the agent they are about.
    The pool's workers and the Ray backend's (`coordinator.ray_backend`) both start so."""
    verbose, fmt, program = logging_as
    setup_logging(verbose, fmt)
    set_process_name(program)
    workload = build_workload(config, roster)
    learner = workload.learner
    strategy = central_strategy(learner.config.strategy) if learner.traits.centralized else None
    return InProcess(learner, workload.data, strategy)


def _start(config: ExperimentConfig, roster: list[str], logging_as: LoggingAs) -> None:
    """A pool worker's initializer: its `worker_training`."""
    _WORKER[:] = [worker_training(config, roster, logging_as)]


SPARSE_BELOW = 0.75
"""With `dumps(sparse=True)`, a tensor whose share of nonzero elements is below this travels
as those elements and a bit mask of where they are (a pruned model at density 0.5: 53% of
its dense bytes); at or above it, dense."""


class _Pickler(pickle.Pickler):
    """The standard pickler, with CPU tensors as numpy arrays (sparse ones, if `sparse`, as
    their nonzero elements: `_sparse`)."""

    def __init__(self, file: io.BytesIO, sparse: bool) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.sparse = sparse

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is torch.Tensor and not obj.requires_grad and obj.dtype != torch.bfloat16:
            array = obj.numpy()
            return (self.sparse and _sparse(array)) or (torch.from_numpy, (array,))
        return NotImplemented


def _sparse(array: np.ndarray) -> tuple[Any, tuple[Any, ...]] | None:
    """How to pickle `array` as its nonzero elements, or None when it is not sparse enough.
    Nonzero by bits, not by value: a -0.0 is kept, so the copy is the same bit for bit."""
    if array.size < 64 or array.itemsize not in (1, 2, 4, 8):
        return None
    flat = array.reshape(-1)
    present = flat.view(f"u{array.itemsize}") != 0
    if present.mean() >= SPARSE_BELOW:
        return None
    return _from_sparse, (array.shape, np.packbits(present), flat[present])


def _from_sparse(shape: tuple[int, ...], bits: np.ndarray, values: np.ndarray) -> torch.Tensor:
    """The tensor `_sparse` pickled: zeros, and `values` where `bits` are set."""
    flat = np.zeros(int(np.prod(shape)), dtype=values.dtype)
    flat[np.unpackbits(bits, count=flat.size).astype(bool)] = values
    return torch.from_numpy(flat.reshape(shape))


def dumps(obj: object, sparse: bool = False) -> bytes:
    """`obj` pickled, its CPU tensors as numpy arrays, the sparse ones as their nonzero
    elements if `sparse` (`pickle.loads` reads it back, bit for bit)."""
    buffer = io.BytesIO()
    _Pickler(buffer, sparse).dump(obj)
    return buffer.getvalue()


def _fit(job: bytes) -> bytes:
    """The fit of one pickled `FitJob`, pickled."""
    ((_, fit),) = _WORKER[0].fit([pickle.loads(job)], lambda: None)
    return dumps(fit)


def _local_round(job: bytes) -> bytes:
    """The round of one pickled `RoundJob` (its result and reduction), pickled."""
    return dumps(_WORKER[0].local_round(pickle.loads(job)).result())


class TrainingPool(Local):
    """`workers` processes that train agents' rounds; `close` (or `with`) stops them."""

    def __init__(self, config: ExperimentConfig, roster: list[str], workers: int) -> None:
        if workers < 2:
            raise ValueError(f"a training pool needs at least 2 workers, got {workers}")
        self.slots = workers + 1
        """One more than the workers, so that none waits for the simulator between rounds."""
        self._pool = ProcessPoolExecutor(
            max_workers=workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_start,
            initargs=(config, roster, logging_here()),
        )

    def fit(
        self, jobs: Sequence[FitJob], meanwhile: Callable[[], None]
    ) -> Iterator[tuple[str, Fit]]:
        """Each job's fit, in the jobs' order; they train at once, the costliest first, while
        this process does `meanwhile`."""
        futures: dict[str, Future[bytes]] = {}
        for job in sorted(jobs, key=lambda j: j.samples, reverse=True):
            futures[job.turn.agent] = self._pool.submit(_fit, dumps(job))
        meanwhile()
        for job in jobs:
            yield job.turn.agent, pickle.loads(futures[job.turn.agent].result())

    def local_round(self, job: RoundJob) -> Future[tuple[RoundResult, Reduction]]:
        """The agent's round, started: its result and reduction when it is done."""
        done: Future[tuple[RoundResult, Reduction]] = Future()

        def unpickle(future: Future[bytes]) -> None:
            try:
                done.set_result(pickle.loads(future.result()))
            except BaseException as exc:  # the worker's error, raised where the result is taken
                done.set_exception(exc)

        self._pool.submit(_local_round, dumps(job)).add_done_callback(unpickle)
        return done

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> TrainingPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def training_on(
    workers: int, here: Training, config: ExperimentConfig, roster: list[str]
) -> Iterator[Training]:
    """`here` for one worker; else a `TrainingPool` of `workers`, stopped at the end."""
    if workers < 2:
        yield here
        return
    with TrainingPool(config, roster, workers) as pool:
        yield pool
