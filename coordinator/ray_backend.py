"""`coordinator simulate --backend ray`: agents' rounds as Ray tasks across a cluster's nodes.

The same seam as the home-made pool (`coordinator.training_pool.Training`): the simulator
keeps its loops, its order and its report, and only the participants' fits (a few batches a
CPU, `BATCHES_PER_CPU`) and the decentralized agents' local rounds (in tasks of about
`AGENTS_PER_TASK`, each agent started as `when_ready` says) move out, as Ray tasks. A task
depends only on its jobs (each agent's state, its inbox or view of the server, the round)
and on the run's workload, which every worker process builds once from the config, as a
pool worker does; so a task that Ray runs again on another node after its node died
(`max_retries`) gives the same results, and a run gives the same report, bit for bit, as
the local backend.

Where things live: the run's config and roster are put in Ray's object store once and each
worker process keeps the workload built from them (`_training_of`: one run at a time). On a
cluster an agent's state waits between rounds in the object store, the simulator holding a
reference (`RayStates`), and a job names it, which Ray fetches to the node that trains it;
on a Ray started here it travels with its job (`RayTraining.keep` says why). Either way it
comes back with the agent's result, since the simulator's own round rules (early stopping,
attacks, judging, the report) read it. A model that several agents receive is put in the
object store once a round and named by their jobs (`RayTraining._put_once`). Jobs and
results travel as pickles whose tensors are numpy arrays; on a cluster, a pruned model's as
its nonzero weights and a bit mask (`RayTraining.sparse`).

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
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

from agent.experiment import ExperimentConfig
from agent.learning import AgentState, Fit, Reduction, RoundResult
from coordinator.training_pool import (
    FitJob,
    InProcess,
    LoggingAs,
    RoundJob,
    StateStore,
    Stored,
    dumps,
    logging_here,
    worker_training,
)
from protocol.extras import require

__all__ = ["BACKENDS", "RAY_EXTRA", "ClusterError", "RayStates", "RayTraining", "require_ray"]

BACKENDS = ("local", "ray")
"""Where `simulate` trains agents: this machine (in process or `--workers`), or Ray."""

RAY_EXTRA = "ray"
"""`coordinator simulate --backend ray`: Ray, on the machine that runs simulate and on
every node of its cluster."""

BATCHES_PER_CPU = 4
"""A centralized round's fits go out in about this many tasks per CPU of the cluster: a
task per fit costs Ray more than a short fit (1,000 agents of 16 samples: 1.8x the local
backend's round), and a few batches per CPU still even out uneven ones."""

AGENTS_PER_TASK = 8
"""A decentralized round's agents go out in tasks of about this many (fewer when fewer are
ready to start): a task per agent cost DA-DPFL's rounds on Ray up to 1.5x the local
backend's, for Ray's scheduling of each."""

ROUNDS_PER_CPU = 64
"""Decentralized agents' rounds under way at once, per CPU of the cluster: enough for a few
tasks of `AGENTS_PER_TASK` a CPU while the simulator takes in those that finished."""

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


def _resolved(jobs: bytes, objects: tuple[bytes, ...]) -> list[Any]:
    """The pickled jobs, each with its state and (a `RoundJob`) its inbox, where a `Stored`
    one is `objects[ref]`, which Ray fetched for the task (`RayTraining._shipped`); an
    object several jobs name is read once."""
    loaded: dict[int, Any] = {}

    def load(held: Any) -> Any:
        if not isinstance(held, Stored):
            return held
        if held.ref not in loaded:
            loaded[held.ref] = pickle.loads(objects[held.ref])
        return loaded[held.ref]

    resolved = []
    for job in pickle.loads(jobs):
        job = replace(job, state=load(job.state))
        if isinstance(job, RoundJob):
            job = replace(job, inbox={j: load(model) for j, model in job.inbox.items()})
        resolved.append(job)
    return resolved


def _fit_task(run: _Run, jobs: bytes, *states: bytes) -> tuple[bytes, str]:
    """The fits of a pickled list of `FitJob`s (agent -> fit), pickled, and the node that
    trained them."""
    fits = dict(_training_of(run).fit(_resolved(jobs, states), lambda: None))
    return dumps(fits, run.sparse), _node()


def _round_task(run: _Run, jobs: bytes, *states: bytes) -> tuple[bytes, str]:
    """The rounds of a pickled list of `RoundJob`s (each one's result and reduction, in
    order), pickled, and the node that trained them."""
    training = _training_of(run)
    results = [training.local_round(job).result() for job in _resolved(jobs, states)]
    return dumps(results, run.sparse), _node()


class RayStates(StateStore):
    """The agents' states between rounds in Ray's object store, pickled as jobs travel: the
    simulator holds a reference per agent, and a job names its agent's state by it
    (`Stored`), which Ray fetches to the node that trains it. An agent's state is put there
    when its round's result comes in (the simulator reads it once, for the round's rules:
    early stopping, judging, attacks), and read back here only for what needs it between
    rounds (an attacker's honest model, the trigger's success at the end). States not yet
    trained stay as the run built them (FedAvg's share the initial model).

    The objects are the simulator's own (`ray.put`), in the object store of its node: a
    lost node loses none of them, only tasks, which Ray runs again. They go with the run's
    Ray (`close`)."""

    def __init__(self, ray: Any, initial: StateStore, sparse: bool) -> None:
        self._ray, self._initial, self._sparse = ray, initial, sparse
        self._order = list(initial)
        self._refs: dict[str, Any] = {}
        self._open = True

    def __getitem__(self, k: str) -> AgentState:
        if k not in self._refs:
            return self._initial[k]
        if not self._open:
            raise RuntimeError("a Ray run's agent states go with its Ray, once the run ends")
        state: AgentState = pickle.loads(self._ray.get(self._refs[k]))
        return state

    def __setitem__(self, k: str, state: AgentState) -> None:
        self._refs[k] = self._ray.put(dumps(state, self._sparse))
        self._initial.pop(k, None)

    def __delitem__(self, k: str) -> None:
        raise TypeError("an agent's state is replaced, never removed")

    def __contains__(self, k: object) -> bool:
        return k in self._refs or k in self._initial

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def held(self, k: str) -> AgentState | Stored:
        return Stored(self._refs[k]) if k in self._refs else self._initial[k]

    def close(self) -> None:
        """Drop the references (Ray frees the objects) as the run's Ray goes."""
        self._refs.clear()
        self._open = False


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
        self.slots = ROUNDS_PER_CPU * self.cpus
        """Decentralized rounds under way at once (`ROUNDS_PER_CPU`)."""
        self._queued: list[tuple[RoundJob, Future[tuple[RoundResult, Reduction]]]] = []
        self._states: RayStates | None = None
        self._put: dict[int, Any] = {}
        """Received models in the object store, by the id of the simulator's object."""
        self.nodes: Counter[str] = Counter()
        """The agents' rounds each node trained (by Ray node id)."""
        self.tasks = 0
        """The Ray tasks this run sent (a task trains a batch of agents' rounds)."""
        self._lock = threading.Lock()
        remote = ray.remote(max_retries=TASK_RETRIES, scheduling_strategy="SPREAD")
        self._fit, self._round = remote(_fit_task), remote(_round_task)
        self.sparse = address is not None or sum(n["Alive"] for n in ray.nodes()) > 1
        """Whether models travel as their nonzero weights and a bit mask: on a cluster, where
        a job may cross the network (about half the bytes at density 0.5, for about 2 ms more
        CPU an agent's round); not on a Ray started here, whose object store is memory."""
        run = _Run(uuid.uuid4().hex, config, roster, logging_here(), self.sparse)
        self._run = ray.put(run)

    def keep(self, states: StateStore) -> StateStore:
        """On a cluster, the agents' states from now on in Ray's object store (`RayStates`),
        so that the simulator's own memory holds a reference per agent and the round's
        fits; on a Ray started here, where the object store is this machine's memory too,
        they stay in the simulator and travel with each job (a reference each cost 1.3 ms
        of CPU more an agent-round at 1,000 FedAvg agents, and more memory: docs/scaling.md)."""
        if not self.sparse:
            return states
        self._states = RayStates(self._ray, states, self.sparse)
        return self._states

    def _shipped(self, jobs: Sequence[FitJob] | Sequence[RoundJob]) -> tuple[bytes, list[Any]]:
        """`jobs` pickled, with the objects they name by reference (`Stored`: states kept in
        the store; a `RoundJob`'s received models, put there once each, `_put_once`) as
        the task's own arguments, each once, which Ray fetches before the task runs."""
        refs: list[Any] = []
        index: dict[Any, int] = {}

        def named(held: Any) -> Stored:
            ref = held.ref if isinstance(held, Stored) else self._put_once(held)
            if ref not in index:
                index[ref] = len(refs)
                refs.append(ref)
            return Stored(index[ref])

        shipped: list[Any] = []
        for job in jobs:
            state = named(job.state) if isinstance(job.state, Stored) else job.state
            job = replace(job, state=state)
            if isinstance(job, RoundJob):
                job = replace(job, inbox={j: named(model) for j, model in job.inbox.items()})
            shipped.append(job)
        return dumps(shipped, self.sparse), refs

    def _put_once(self, model: Any) -> Any:
        """A received model in the object store, put once while the simulator holds it (a
        model goes to each of an agent's receivers: about M jobs a round)."""
        key = id(model)
        if key not in self._put:
            self._put[key] = self._ray.put(dumps(model, self.sparse))
            weakref.finalize(model, self._put.pop, key, None)
        return self._put[key]

    def fit(
        self, jobs: Sequence[FitJob], meanwhile: Callable[[], None]
    ) -> Iterator[tuple[str, Fit]]:
        """Each job's fit, in the jobs' order; they train at once across the cluster, in
        `BATCHES_PER_CPU` batches a CPU dealt the costliest first, while this process does
        `meanwhile`."""
        costliest = sorted(jobs, key=lambda j: j.samples, reverse=True)
        count = min(len(jobs), BATCHES_PER_CPU * self.cpus)
        batches = [costliest[i::count] for i in range(count)]
        refs = [self._fit.remote(self._run, *self._args(batch)) for batch in batches]
        batch_of = {job.turn.agent: i for i, batch in enumerate(batches) for job in batch}
        meanwhile()
        fits: dict[str, Fit] = {}
        for job in jobs:
            k = job.turn.agent
            if k not in fits:
                i = batch_of[k]
                fits.update(self._result(refs[i], len(batches[i])))
            yield k, fits.pop(k)

    def _args(self, jobs: Sequence[FitJob] | Sequence[RoundJob]) -> list[Any]:
        """A task's arguments after the run's: the pickled jobs, then their states' refs."""
        self.tasks += 1
        pickled, states = self._shipped(jobs)
        return [pickled, *states]

    def local_round(self, job: RoundJob) -> Future[tuple[RoundResult, Reduction]]:
        """The agent's round, queued until `started`: its result and reduction when done."""
        done: Future[tuple[RoundResult, Reduction]] = Future()
        self._queued.append((job, done))
        return done

    def started(self) -> None:
        """The queued rounds, sent as tasks of about `AGENTS_PER_TASK` (at most
        `BATCHES_PER_CPU` tasks a CPU), the earliest dealt first across them."""
        queued, self._queued = self._queued, []
        count = max(1, min(BATCHES_PER_CPU * self.cpus, len(queued) // AGENTS_PER_TASK))
        for batch in (queued[i::count] for i in range(count)):
            if batch:
                self._send([job for job, _ in batch], [done for _, done in batch])

    def _send(self, jobs: list[RoundJob], dones: list[Future[Any]]) -> None:
        """One task of `jobs`, whose results settle `dones` (or its error, every one)."""
        ref = self._round.remote(self._run, *self._args(jobs))

        def unpickle(_: Future[Any]) -> None:
            try:
                results = self._result(ref, len(jobs))
            except BaseException as exc:  # the task's error, raised where results are taken
                for done in dones:
                    done.set_exception(exc)
                return
            for done, result in zip(dones, results, strict=True):
                done.set_result(result)

        ref.future().add_done_callback(unpickle)

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
        if self._states is not None:
            self._states.close()
        self._put.clear()
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
