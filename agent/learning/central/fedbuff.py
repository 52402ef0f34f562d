"""FedBuff: buffered asynchronous aggregation (Nguyen et al., 2022, Algorithm 1).

Participants train whenever they can, each from the newest global model it holds, and upload
the model they trained to, tagged with the global version it was trained from. The server
keeps a buffer: an update arriving while the server is at version v, trained from version b,
is `s = v - b` versions stale; it enters the buffer as its delta (uploaded model minus version
b's model) with the weight `staleness_weight(s)`, or is dropped when `s > --max-staleness`.
Once K (`--buffer-size`) updates are in, the server applies their staleness-weighted sum over
K (the paper's server step with a server learning rate of 1) and is at version v + 1:

    x_{v+1} = x_v + (1 / K) sum_i w(s_i) (y_i - x_{b_i})

The rule here is pure: `Buffer` takes updates in the order they arrived and says when a
version came out. The simulator feeds it in virtual-time order (`coordinator.buffered_sim`),
the coordinator in the order MQTT delivered them (`coordinator.buffered`); given the same
arrival order both compute the same versions. A participant's round is FedAvg's: local SGD
from the global model, the whole trained model uploaded (`fit`).

The buffer sums what the strategy's `update_delta` makes of an upload: FedBuff's is the
weights' delta; FedBuff-SSM's (`fedbuff_ssm`) the deltas of the weights and both Adam
moments, which `server_step` applies alike.

Under the synchronous contract (`aggregate`: every upload trained from the server's current
model, none stale) the rule is the unweighted mean of the uploads: what one buffer of all of
them gives.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from agent.learning.buffering import buffer_size
from agent.learning.central import client_dp
from agent.learning.central.base import (
    Aggregate,
    CentralStrategy,
    Fit,
    FitContext,
    Payload,
    ServerState,
    Upload,
)
from agent.learning.central.fedavg import full_model_fit
from agent.learning.config import DP_CLIENT
from agent.learning.model_facts import ModelFacts
from agent.learning.sparse import State, averaged
from agent.learning.staleness import fresh_enough, staleness_weight


def delta(uploaded: State, base: State) -> State:
    """An update's delta: its floating tensors minus those of the model it was trained from
    (integer tensors, such as BatchNorm's counters, are not averaged: they carry none)."""
    return {n: uploaded[n].double() - base[n].double() for n in base if averaged(base[n])}


def weights_delta(upload: Upload, base: State) -> ServerState:
    """FedBuff's update delta: the uploaded model minus the model it was trained from."""
    return ServerState(delta(upload.payload.weights, base))


UpdateDelta = Callable[[Upload, State], ServerState]
"""An update as the buffer sums it, from the upload and its base version's weights: the delta
of the weights, and (FedBuff-SSM) of both Adam moments."""


def apply_deltas(
    server: State,
    weighted: Sequence[tuple[State, float]],
    size: int,
    noised: Callable[[State], State] | None = None,
) -> State:
    """The server step: `server` plus the weighted sum of the deltas (`noised` first, under
    `--dp client`) over `size` (K), in float64 and the arrival order given, each tensor back
    in its dtype. Tensors the deltas do not name (FedBuff-SSM's buffers) are left as they
    are."""
    sums = {}
    named = weighted[0][0] if weighted else {}
    for name, tensor in server.items():
        if averaged(tensor) and name in named:
            sums[name] = torch.zeros_like(tensor, dtype=torch.float64)
            for d, weight in weighted:
                sums[name] += d[name] * weight
    if noised is not None:
        sums = noised(sums)
    out = dict(server)
    for name, total in sums.items():
        out[name] = (server[name].double() + total / size).to(server[name].dtype)
    return out


def server_step(
    server: ServerState,
    weighted: Sequence[tuple[ServerState, float]],
    size: int,
    noised: Callable[[State], State] | None = None,
) -> ServerState:
    """`apply_deltas` on the weights and, where the server holds Adam's moments (FedBuff-SSM),
    on each moment. The second moment is clamped at 0: a stale update's delta is taken
    against its own base's V, which may exceed today's, and Adam divides by sqrt(V)."""
    weights = apply_deltas(server.weights, [(d.weights, w) for d, w in weighted], size, noised)
    if server.m is None or server.v is None:
        return ServerState(weights)
    m = apply_deltas(server.m, [(d.m or {}, w) for d, w in weighted], size)
    v = apply_deltas(server.v, [(d.v or {}, w) for d, w in weighted], size)
    return ServerState(weights, m, {n: t.clamp(min=0) for n, t in v.items()})


@dataclass(frozen=True)
class ClientNoise:
    """`--dp client` on FedBuff (DP-FedAvg's fixed clipping, `client_dp`, per version): each
    device clips its update around the version it trained from (`Turn.train`); the server
    clips each delta to C (`--dp-clip`) again and adds N(0, sigma^2 C^2) (sigma: `--dp-noise`)
    to each version's weighted sum before dividing by K. A staleness weight is at most 1 and
    the buffer takes at most one update of a device a version (`Buffer.offer` holds a second
    one for the next), so one device moves a version's sum by at most C: each version is one
    Gaussian release, which each device's accountant counts once an upload."""

    noise: float
    clip: float
    facts: ModelFacts

    def clipped(self, d: State) -> State:
        """`d` scaled down to L2 norm C where longer."""
        norm = math.sqrt(sum(float(t.pow(2).sum()) for t in d.values()))
        scale = min(1.0, self.clip / norm) if norm > 0 else 1.0
        return {n: t * scale for n, t in d.items()}

    def for_version(self, version: int) -> Callable[[State], State]:
        """The noise of `version`'s release, drawn from (fleet seed, "client-dp",
        "aggregator", version) as `client_dp`'s rounds are: simulate and the coordinator
        draw the same."""
        generator = self.facts.generator(client_dp.NOISE_PURPOSE, "aggregator", version)
        return lambda sums: client_dp.noised_sum(sums, self.noise, self.clip, generator)


@dataclass(frozen=True)
class Offer:
    """What became of one update offered to the buffer."""

    staleness: int
    """Versions the server moved on since the update's base: its version minus the base."""
    taken: bool
    """Whether it entered the buffer (False: staler than `--max-staleness`, or its base is
    no longer kept)."""
    version: int | None = None
    """The version this update's arrival made the server apply (the buffer was full), else
    None."""
    held: bool = False
    """`--dp client`: its sender has an update in the buffer already; this one waits for the
    next version (its staleness then counts from there)."""


@dataclass
class Buffer:
    """The server's side of FedBuff: its model, version, the kept versions updates may be
    trained from, and the buffer of updates waiting for the next version."""

    server: ServerState
    size: int
    rule: str
    max_staleness: int
    version: int = 0
    kept: dict[int, State] = field(default_factory=dict)
    """The models of the versions an update may still be trained from (the last
    `max_staleness` + 1): a delta is taken against its own base."""
    pending: list[tuple[str, ServerState, float]] = field(default_factory=list)
    """(sender, delta, staleness weight) of the updates in the buffer, in arrival order."""
    applied: list[list[tuple[str, int]]] = field(default_factory=list)
    """For each version applied, (sender, staleness) of the updates it took, in order."""
    dp: ClientNoise | None = None
    """`--dp client`: the clip and noise of each version."""
    held: list[tuple[str, Upload, int]] = field(default_factory=list)
    """`--dp client`: updates waiting for the next version (their sender's is in this one)."""
    deltas: UpdateDelta = weights_delta
    """How an upload becomes the delta the buffer sums (the strategy's `update_delta`)."""
    _staleness: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.kept.setdefault(self.version, self.server.weights)

    @classmethod
    def of(cls, facts: ModelFacts, server: ServerState, agents: int, deltas: UpdateDelta) -> Buffer:
        """The run's buffer from its config (`--buffer-size`, `--staleness-weight`,
        `--max-staleness`) for a fleet of `agents`; `deltas`: the strategy's `update_delta`."""
        cfg = facts.config
        size = buffer_size(cfg.buffer_size, agents, cfg.secure_aggregation)
        dp = ClientNoise(cfg.dp_noise, cfg.dp_clip, facts) if cfg.dp == DP_CLIENT else None
        return cls(server, size, cfg.staleness_weight, cfg.max_staleness, dp=dp, deltas=deltas)

    def saved(self) -> dict[str, Any]:
        """What a restarted coordinator needs to go on from this version (`restore`), as
        tensors and plain data: kept after each version, when the buffer is empty. Updates
        taken since, or held for the next version (`--dp client`), are lost on a restart as
        those in flight are (their devices counted them: a DP count errs on the safe side)."""
        return {
            "version": self.version,
            "kept": {str(v): w for v, w in self.kept.items()},
            "applied": [[[k, s] for k, s in took] for took in self.applied],
        }

    def restore(self, saved: Mapping[str, Any], server: ServerState) -> None:
        """Go on from `saved` (`saved`), the server at `server` (the coordinator's kept one),
        the buffer empty."""
        self.server, self.version = server, int(saved["version"])
        self.kept = {int(v): w for v, w in saved["kept"].items()}
        self.applied = [[(k, int(s)) for k, s in took] for took in saved["applied"]]
        self.pending, self._staleness, self.held = [], [], []

    def offer(self, sender: str, upload: Upload, base: int) -> Offer:
        """Take `sender`'s update (`upload`, trained from version `base`); apply the buffer
        when it holds K."""
        staleness = self.version - base
        if base not in self.kept or not fresh_enough(staleness, self.max_staleness):
            return Offer(staleness, taken=False)
        if self.dp is not None and any(k == sender for k, _, _ in self.pending):
            self.held.append((sender, upload, base))
            return Offer(staleness, taken=True, held=True)
        d = self.deltas(upload, self.kept[base])
        if self.dp is not None:
            d = ServerState(self.dp.clipped(d.weights))
        self.pending.append((sender, d, staleness_weight(staleness, self.rule)))
        self._staleness.append(staleness)
        if len(self.pending) < self.size:
            return Offer(staleness, taken=True)
        self._apply()
        return Offer(staleness, taken=True, version=self.version)

    def _apply(self) -> None:
        """The server step over the full buffer; the new version kept, the oldest forgotten;
        the updates held for it offered again."""
        weighted = [(d, w) for _, d, w in self.pending]
        noised = None if self.dp is None else self.dp.for_version(self.version + 1)
        self.server = server_step(self.server, weighted, self.size, noised)
        self._next_version(
            [(k, s) for (k, _, _), s in zip(self.pending, self._staleness, strict=True)]
        )
        self.pending, self._staleness = [], []
        held, self.held = self.held, []
        for sender, upload, base in held:
            self.offer(sender, upload, base)

    def apply_summed(self, took: Sequence[tuple[str, int]], summed: ServerState | None) -> int:
        """Under `--secure-aggregation` (`secure_buffer`): a cohort's version from the
        unmasked sum of what its survivors masked, sum_i w(s_i) (y_i - x_{b_i}) (`summed`),
        over their number (`took`: each survivor and its staleness): `_apply`'s server step,
        the weighted sum taken by the members and the ring instead of here. `summed` None
        (the cohort's sum failed): the version is the last one's model again. Returns the
        new version."""
        if summed is not None and took:
            self.server = server_step(self.server, [(summed, 1.0)], len(took))
        self._next_version(list(took))
        return self.version

    def _next_version(self, took: list[tuple[str, int]]) -> None:
        """The server's model is the next version, which took `took` (sender, staleness):
        kept, and the versions no update may be trained from any more forgotten."""
        self.applied.append(took)
        self.version += 1
        self.kept[self.version] = self.server.weights
        for old in [v for v in self.kept if v < self.version - self.max_staleness]:
            del self.kept[old]


class FedBuff(CentralStrategy):
    """FedAvg's participant round; the server's rule is the buffer's (`Buffer`)."""

    name = "fedbuff"

    def fit(self, learner: ModelFacts, ctx: FitContext) -> Fit:
        return full_model_fit(learner, ctx)

    def update_delta(self, upload: Upload, base: State) -> ServerState:
        """The delta the buffer sums: the uploaded model minus its base version's."""
        return weights_delta(upload, base)

    def version_payload(self, server: ServerState) -> Payload:
        """What a version's retained message carries: the whole model."""
        return Payload(server.weights)

    def aggregate(
        self, learner: ModelFacts, server: ServerState, uploads: Mapping[str, Upload]
    ) -> Aggregate:
        """One buffer of every upload, all trained from `server` (none stale): the
        unweighted mean, in sorted-id order."""
        return one_buffer(self, server, uploads)


@runtime_checkable
class Buffered(Protocol):
    """What the buffer and its runtimes need of a buffered strategy besides the contract."""

    def update_delta(self, upload: Upload, base: State) -> ServerState: ...

    def version_payload(self, server: ServerState) -> Payload: ...


def as_buffered(strategy: CentralStrategy) -> Buffered:
    """`strategy` as a buffered one (its table row says `buffered`)."""
    if not isinstance(strategy, Buffered):
        raise TypeError(f"{strategy.name} is not a buffered strategy")
    return strategy


def one_buffer(strategy: Buffered, server: ServerState, uploads: Mapping[str, Upload]) -> Aggregate:
    """The synchronous contract of a buffered strategy: one buffer of every upload, all
    trained from `server` (none stale), unweighted, in sorted-id order; the broadcast is
    the version's whole payload."""
    weighted = [(strategy.update_delta(uploads[k], server.weights), 1.0) for k in sorted(uploads)]
    new = server_step(server, weighted, len(weighted))
    return Aggregate(new, strategy.version_payload(new))
