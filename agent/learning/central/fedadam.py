"""The FedAdam family (ALGORITHMS.md 3): local Adam from the global weights and moments, and
an upload of the deltas of all three.

    fedadam      dense deltas of weights and both moments
    fedadam-top  the three deltas each top-k sparsified with its own mask
    fedadam-ssm  one shared top-k mask, from the weight delta, for all three

These are the paper's Algorithms 1 and 2 as written (checked point by point in
studies/fedadam_study.py). Taking the one mask from |dW| rests on the paper's premise that
|dW| >> |dM| >> |dV| (its Fig. 1: logs about -2, -3, -6), which holds at its L = 30 local
mini-batch steps per round (its "local epoch" is one step, eq. 3) but not at a few: with 2
to 4 steps |dM| is as large as |dW|, and the shared mask locks onto the coordinates it
picked in the first rounds (there M is non-zero and V, averaged with the zeros of the
agents that did not pick them, stays small, so they move most); on digits 60% of the model
then never leaves its initial values. Give the family about 30 local steps per round.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from agent.learning import adam, robust
from agent.learning.central.base import (
    Aggregate,
    CentralStrategy,
    Fit,
    FitContext,
    Layout,
    Payload,
    ServerState,
    Upload,
    clipped_uploads,
    model_layout,
    sample_weights,
)
from agent.learning.model_facts import ModelFacts
from agent.learning.sparse import Masks, State


class FedAdam(CentralStrategy):
    """Local Adam from the global weights and moments; upload the deltas of all three."""

    name = "fedadam"
    mode = adam.MODE_DENSE

    def init_server(self, learner: ModelFacts) -> ServerState:
        """The initial model, and zero moments for its parameters (buffers, such as
        BatchNorm's running statistics, have none: they stay on each device)."""
        params = model_parameters(learner.initial, learner)
        zeros = adam.zeros_like_state
        return ServerState(dict(learner.initial), zeros(params), zeros(params))

    def fit(self, learner: ModelFacts, ctx: FitContext) -> Fit:
        cfg, server = learner.config, ctx.view
        assert server.m is not None and server.v is not None
        result = adam.train_adam(
            learner.model,
            learner.own_statistics(server.weights, ctx.state.weights),
            server.m,
            server.v,
            ctx.data.x_train,
            ctx.data.y_train,
            adam.AdamConfig(
                lr=adam.AdamConfig.lr if cfg.lr is None else cfg.lr,
                epochs=cfg.epochs,
                batch_size=cfg.batch_size,
                privacy=cfg.sample_dp,
            ),
            learner.generator("train", ctx.agent_id, ctx.round),
            learner.task,
        )
        (dw, w_mask), (dm, m_mask), (dv, v_mask) = adam.compress(
            adam.deltas(
                model_parameters(result.weights, learner), model_parameters(server.weights, learner)
            ),
            adam.deltas(result.m, server.m),
            adam.deltas(result.v, server.v),
            cfg.ssm_fraction,
            self.mode,
        )
        upload = moment_payload((dw, w_mask), (dm, m_mask), (dv, v_mask), self.mode)
        flops = learner.train_flops(None, result.samples)
        return ctx.fitted(result.weights, upload, result.mean_loss, flops, result.dp_steps)

    @property
    def broadcast_mode(self) -> str:
        """The broadcast's layout: dense for FedAdam, else one shared mask (the support)."""
        return adam.MODE_DENSE if self.mode == adam.MODE_DENSE else adam.MODE_SSM

    def aggregate(
        self, learner: ModelFacts, server: ServerState, uploads: Mapping[str, Upload]
    ) -> Aggregate:
        assert server.m is not None and server.v is not None
        weights = sample_weights(learner, uploads)
        deltas = {k: moment_deltas(u.payload) for k, u in uploads.items()}
        dw, dm, dv = (
            self._combine(learner, server, {k: d[i] for k, d in deltas.items()}, weights)
            for i in range(3)
        )
        new = ServerState(
            adam.apply(server.weights, dw), adam.apply(server.m, dm), adam.apply(server.v, dv)
        )
        support = {n: (dw[n] != 0) | (dm[n] != 0) | (dv[n] != 0) for n in dw}
        broadcast = moment_payload((dw, support), (dm, support), (dv, support), self.broadcast_mode)
        return Aggregate(new, broadcast)

    def _combine(
        self,
        learner: ModelFacts,
        server: ServerState,
        deltas: Mapping[str, State],
        weights: Mapping[str, float],
    ) -> State:
        """One of the three deltas aggregated: clipped around zero (`--clip`), then the
        weighted mean, or the `--aggregation` rule over the participants that selected each
        coordinate (a sparsified delta's zeros are not selections, the mean's count them)."""
        zero = adam.zeros_like_state(model_parameters(server.weights, learner))
        held = None
        if self.mode != adam.MODE_DENSE:
            held = {k: {n: t != 0 for n, t in d.items()} for k, d in deltas.items()}
        clipped, rule = clipped_uploads(learner, zero, deltas, held)
        if rule.robust:
            return robust.aggregate_onto(zero, clipped, rule, held)
        return adam.aggregate_deltas(clipped, weights)

    def receive(self, view: ServerState, broadcast: Payload) -> ServerState:
        """Apply the broadcast deltas to W, M and V, as the aggregator did."""
        assert view.m is not None and view.v is not None
        dw, dm, dv = moment_deltas(broadcast)
        return ServerState(
            adam.apply(view.weights, dw), adam.apply(view.m, dm), adam.apply(view.v, dv)
        )

    def upload_layout(self, learner: ModelFacts, layers: list[str] | None = None) -> Layout | None:
        return moment_layout(learner) if self.mode != adam.MODE_SSM else None

    def broadcast_layout(self, learner: ModelFacts) -> Layout | None:
        return moment_layout(learner) if self.broadcast_mode == adam.MODE_DENSE else None

    def payload_order(self, learner: ModelFacts) -> list[str]:
        return list(moment_layout(learner))

    def check_payload(self, learner: ModelFacts, payload: Payload) -> None:
        """An SSM-layout payload: w:<name> in the model's shapes with a mask, m:/v:<name>
        value vectors as long as that mask's count."""
        masks = payload.masks or {}
        want = {f"{p}:{n}" for p in "wmv" for n in model_parameters(learner.initial, learner)}
        if set(payload.weights) != want:
            raise ValueError("a moment payload must hold w:, m: and v: of every tensor")
        if not all(torch.is_floating_point(t) for t in payload.weights.values()):
            raise ValueError("a moment payload holds floating values only")
        for name, (shape, _dtype) in model_layout(
            model_parameters(learner.initial, learner)
        ).items():
            w = payload.weights[f"w:{name}"]
            mask = masks.get(f"w:{name}")
            if tuple(w.shape) != shape or mask is None:
                raise ValueError(f"w:{name} must have shape {shape} and a mask")
            count = int(mask.sum())
            for prefix in "mv":
                if tuple(payload.weights[f"{prefix}:{name}"].shape) != (count,):
                    raise ValueError(f"{prefix}:{name} must hold {count} values")


class FedAdamTop(FedAdam):
    name = "fedadam-top"
    mode = adam.MODE_TOP


class FedAdamSSM(FedAdam):
    name = "fedadam-ssm"
    mode = adam.MODE_SSM


def model_parameters(state: State, learner: ModelFacts) -> State:
    """The model's parameters of `state`: what Adam's moments, the deltas and the payloads
    cover (a model's buffers, such as BatchNorm's running statistics, stay local)."""
    names = {name for name, _ in learner.model.named_parameters()}
    return {name: t for name, t in state.items() if name in names}


def moment_layout(learner: ModelFacts) -> Layout:
    layout = model_layout(model_parameters(learner.initial, learner))
    return {f"{p}:{n}": shape for p in "wmv" for n, shape in layout.items()}


def moment_deltas(payload: Payload) -> tuple[State, State, State]:
    """The zero-filled deltas of weights, first and second moment a `moment_payload` carries
    (in the shared-mask layout the moments' values are scattered back under w's mask)."""
    masks = payload.masks or {}
    names = [n.removeprefix("w:") for n in payload.weights if n.startswith("w:")]
    out: list[State] = [{}, {}, {}]
    for i, prefix in enumerate("wmv"):
        for n in names:
            t = payload.weights[f"{prefix}:{n}"]
            shape = payload.weights[f"w:{n}"].shape
            if t.shape != shape:  # a value vector in the order of w's mask
                full = torch.zeros(shape, dtype=t.dtype)
                full[masks[f"w:{n}"]] = t
                t = full
            elif f"{prefix}:{n}" in masks:
                t = torch.where(masks[f"{prefix}:{n}"], t, torch.zeros((), dtype=t.dtype))
            out[i][n] = t
    return out[0], out[1], out[2]


def moment_payload(
    w: tuple[State, Masks], m: tuple[State, Masks], v: tuple[State, Masks], mode: str
) -> Payload:
    """The deltas of weights and both moments as one message body. With one shared mask
    (SSM) the mask travels once: the moments go as bare value vectors in its order."""
    if mode == adam.MODE_DENSE:
        parts = {"w": w[0], "m": m[0], "v": v[0]}
        return Payload({f"{p}:{n}": t for p, s in parts.items() for n, t in s.items()})
    weights = {f"w:{n}": t for n, t in w[0].items()}
    masks = {f"w:{n}": w[1][n] for n in w[0]}
    for prefix, (delta, mask) in (("m", m), ("v", v)):
        for n, t in delta.items():
            if mode == adam.MODE_SSM:
                weights[f"{prefix}:{n}"] = t[w[1][n]]
            else:
                weights[f"{prefix}:{n}"] = t
                masks[f"{prefix}:{n}"] = mask[n]
    return Payload(weights, masks)
