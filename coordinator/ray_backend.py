"""`coordinator simulate --backend ray`: agents' rounds as Ray tasks across a cluster's nodes.

The same seam as the home-made pool (`coordinator.training_pool.Training`): the simulator
keeps its loops, its order and its report, and only the participants' fits (a few batches a
CPU, `BATCHES_PER_CPU`) and the decentralized agents' local rounds (a task each, started as
`when_ready` says) move out, as Ray tasks. A task depends only on its job (the
agent's state, its inbox or view of the server, the round) and on the run's workload, which
every worker process builds once from the config, as a pool worker does; so a task that Ray
runs again on another node after its node died (`max_retries`) gives the same result, and a
run gives the same report, bit for bit, as the local backend.

Where things live: the run's config and roster are put in Ray's object store once and each
worker process keeps the workload built from them (`_training_of`: one run at a time); an
agent's state travels with its job and comes back with its result, since the simulator's
own round rules (early stopping, attacks, judging, the report) read it between rounds.
Jobs and results travel as pickles whose tensors are numpy arrays; on a cluster, a pruned
model's as its nonzero weights and a bit mask (`RayTraining.sparse`).

Ray is the `ray` extra, never a device's: it is imported only here, when a run asks for it.
Ray 2.60 listens on every interface of each node, a Ray started here included (it turns a
loopback node address into the machine's reachable one), and guards its ports with its token
authentication (on by default: docs/scaling.md).
"""

from __future__ import annotations

import logging
import pickle
import socket
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from agent.experiment import ExperimentConfig
from agent.learning import Fit, Reduction, RoundResult
from coordinator.training_pool import (
    FitJob,
    InProcess,
    LoggingAs,
    RoundJob,
    dumps,
    logging_here,
    worker_training,
)
from protocol.extras import require

__all__ = ["BACKENDS", "RAY_EXTRA", "ClusterError", "RayTraining", "require_ray"]

BACKENDS = ("local", "ray")
"""Where `simulate` trains agents: this machine (in process or `--workers`), or Ray."""

RAY_EXTRA = "ray"
"""`coordinator simulate --backend ray`: Ray, on the machine that runs simulate and on
every node of its cluster."""

BATCHES_PER_CPU = 4
"""A centralized round's fits go out in about this many tasks per CPU of the cluster: a
task per fit costs Ray more than a short fit (1,000 agents of 16 samples: 1.8x the local
backend's round), and a few batches per CPU still even out uneven ones."""

CONNECT_TIMEOUT_S = 10.0
"""How long `--ray-address` may take to accept a connection before the run gives up."""

TASK_RETRIES = 3
"""How often Ray runs an agent's task again after its worker or node died."""


class ClusterError(RuntimeError):
    """An agent's training was lost on the cluster (its retries spent, the cluster gone)."""


def require_ray() -> None:
    """One line naming the extra when Ray is not installed (exit 2), before anything starts."""
    require(RAY_EXTRA, ("ray",), "--backend ray")


@dataclass(frozen=True)
class _Run:
    """What a worker builds the run's workload from, put in the object store once."""

    id: str
    config: ExperimentConfig
    roster: list[str]
    logging_as: LoggingAs
    sparse: bool
    """Whether results travel sparse (`RayTraining.sparse`)."""


_WORKER: dict[str, InProcess] = {}
"""A worker process's training for the run it last served (by `_Run.id`)."""


def _training_of(run: _Run) -> InProcess:
    """This worker's training for `run`, built on its first task (a worker that served
    another run before drops that one's)."""
    if run.id not in _WORKER:
        _WORKER.clear()
        _WORKER[run.id] = worker_training(run.config, run.roster, run.logging_as)
    return _WORKER[run.id]


def _node() -> str:
    import ray

    return str(ray.get_runtime_context().get_node_id())


def _fit_task(run: _Run, jobs: bytes) -> tuple[bytes, str]:
    """The fits of a pickled list of `FitJob`s (agent -> fit), pickled, and the node that
    trained them."""
    fits = dict(_training_of(run).fit(pickle.loads(jobs), lambda: None))
    return dumps(fits, run.sparse), _node()


def _round_task(run: _Run, job: bytes) -> tuple[bytes, str]:
    """The round of one pickled `RoundJob` (its result and reduction), pickled, and the node
    that trained it."""
    result = _training_of(run).local_round(pickle.loads(job)).result()
    return dumps(result, run.sparse), _node()


class RayTraining:
    """Agents' rounds as Ray tasks: on the cluster at `address`, else on a Ray started here
    with `workers` CPUs (1: all of them) and stopped by `close`. A Ray this process had
    already started (`ray.init`) is used as it is and left running."""

    def __init__(
        self, config: ExperimentConfig, roster: list[str], workers: int, address: str | None
    ) -> None:
        require_ray()
        import ray

        self._ray = ray
        self._started = not ray.is_initialized()
        if self._started:
            _connect(address, workers)
        self.cpus = int(ray.cluster_resources().get("CPU", 1))
        self.slots = self.cpus + 1
        """One more than the cluster's CPUs, so that none waits for the simulator."""
        self.nodes: Counter[str] = Counter()
        """The agents' rounds each node trained (by Ray node id)."""
        self._lock = threading.Lock()
        remote = ray.remote(max_retries=TASK_RETRIES, scheduling_strategy="SPREAD")
        self._fit, self._round = remote(_fit_task), remote(_round_task)
        self.sparse = address is not None or sum(n["Alive"] for n in ray.nodes()) > 1
        """Whether models travel as their nonzero weights and a bit mask: on a cluster, where
        a job may cross the network (about half the bytes at density 0.5, for about 2 ms more
        CPU an agent's round); not on a Ray started here, whose object store is memory."""
        run = _Run(uuid.uuid4().hex, config, roster, logging_here(), self.sparse)
        self._run = ray.put(run)

    def fit(
        self, jobs: Sequence[FitJob], meanwhile: Callable[[], None]
    ) -> Iterator[tuple[str, Fit]]:
        """Each job's fit, in the jobs' order; they train at once across the cluster, in
        `BATCHES_PER_CPU` batches a CPU dealt the costliest first, while this process does
        `meanwhile`."""
        costliest = sorted(jobs, key=lambda j: j.samples, reverse=True)
        count = min(len(jobs), BATCHES_PER_CPU * self.cpus)
        batches = [costliest[i::count] for i in range(count)]
        refs = [self._fit.remote(self._run, dumps(batch, self.sparse)) for batch in batches]
        batch_of = {job.turn.agent: i for i, batch in enumerate(batches) for job in batch}
        meanwhile()
        fits: dict[str, Fit] = {}
        for job in jobs:
            k = job.turn.agent
            if k not in fits:
                i = batch_of[k]
                fits.update(self._result(refs[i], len(batches[i])))
            yield k, fits.pop(k)

    def local_round(self, job: RoundJob) -> Future[tuple[RoundResult, Reduction]]:
        """The agent's round, started: its result and reduction when it is done."""
        done: Future[tuple[RoundResult, Reduction]] = Future()
        ref = self._round.remote(self._run, dumps(job, self.sparse))

        def unpickle(_: Future[Any]) -> None:
            try:
                done.set_result(self._result(ref))
            except BaseException as exc:  # the task's error, raised where the result is taken
                done.set_exception(exc)

        ref.future().add_done_callback(unpickle)
        return done

    def _result(self, ref: Any, agents: int = 1) -> Any:
        """A task's result, the `agents` it trained counted on its node; the task's own
        error as it was raised there, and a lost task as a `ClusterError`."""
        errors = self._ray.exceptions
        try:
            pickled, node = self._ray.get(ref)
        except errors.RayTaskError as exc:
            raise exc.as_instanceof_cause() from None
        except errors.RayError as exc:
            raise ClusterError(f"an agent's training was lost on the Ray cluster: {exc}") from None
        with self._lock:
            self.nodes[node] += agents
        return pickle.loads(pickled)

    def close(self) -> None:
        if self._started:
            self._ray.shutdown()

    def __enter__(self) -> RayTraining:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _connect(address: str | None, workers: int) -> None:
    """Join the cluster at `address`, or start a Ray here with `workers` CPUs (1: all)."""
    import ray

    options: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.WARNING}
    if address is None:
        options["num_cpus"] = workers if workers > 1 else None
    else:
        _answers(address)
    try:
        ray.init(address=address or "local", **options)
    except (ConnectionError, RuntimeError) as exc:
        raise ConnectionError(f"could not join the Ray cluster at {address}: {exc}") from None


def _answers(address: str) -> None:
    """A HOST:PORT where nothing listens is one line at once: Ray itself would retry for
    minutes, logging each attempt. Ray's other forms (`auto`, `ray://...`) are its own."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "/" in host:
        return
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise ConnectionError(
            f"no Ray cluster answers at {address} ({exc.strerror or exc}): start its head "
            f"there with `ray start --head --port {port}`"
        ) from None
