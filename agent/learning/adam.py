"""FedAdam-SSM: local Adam and sparse deltas with one shared mask (ALGORITHMS.md section 3).

Pure functions over state dicts (`sparse.State`): each returns new tensors and leaves its
inputs alone, so the simulator and the networked agent get the same numbers from the same
inputs. One agent's round, for the parameter names P (the keys of M):

    r = train_adam(model, W, M, V, x, y, config, generator)
    dW = deltas({p: r.weights[p] for p in P}, {p: W[p] for p in P})
    dM, dV = deltas(r.m, M), deltas(r.v, V)
    w, m, v = compress(dW, dM, dV, fraction, MODE_SSM)  # upload the values and the mask(s)

and the aggregator's, over every participant j with sample count a_j:

    W = apply(W, aggregate_deltas({j: w_j.values, ...}, a))  # likewise M from m_j, V from v_j

Moments exist for the parameters only, so deltas and masks cover the parameters; buffers
(none in the bundled models) stay local, and `apply` carries them through.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from agent.learning.config import SampleDP, round_steps
from agent.learning.sparse import Masks, State, aggregate_weighted, apply_masks
from agent.learning.tasks import Task
from agent.learning.training import (
    CLASSIFICATION,
    PrivateBatches,
    load_weights,
    minibatch_epochs,
)

MODE_SSM = "ssm"  # FedAdam-SSM: one top-k mask of |dW| sparsifies dW, dM and dV
MODE_TOP = "top"  # FedAdam-Top: each delta sparsified by its own top-k mask
MODE_DENSE = "dense"  # FedAdam: nothing dropped
MODES = (MODE_SSM, MODE_TOP, MODE_DENSE)


@dataclass(frozen=True)
class AdamConfig:
    """Local Adam of ALGORITHMS.md 3 (the paper's values); E epochs of mini-batches."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-6
    batch_size: int = 128
    epochs: int = 5
    privacy: SampleDP | None = None
    """Sample-level DP-SGD's clipping and noise under the Adam step (`--dp sample`)."""


@dataclass(frozen=True)
class AdamResult:
    weights: State
    m: State
    v: State
    mean_loss: float
    samples: int
    dp_steps: int = 0
    """DP steps taken, which the device's accountant counts."""


class SparseDelta(NamedTuple):
    """A delta to upload: `values` is exactly 0 outside `mask`; only the kept entries and the
    mask go on the wire."""

    values: State
    mask: Masks


def zeros_like_state(state: Mapping[str, torch.Tensor]) -> State:
    """Zero tensors shaped like `state`: the first round's M and V (pass the parameters)."""
    return {name: torch.zeros_like(t) for name, t in state.items()}


def _adam_step_(params: Mapping[str, nn.Parameter], m: State, v: State, config: AdamConfig) -> None:
    """One step of the paper's Adam, in place: no bias correction and eps inside the root,
    w -= lr m / sqrt(v + eps). Not torch.optim.Adam, which corrects bias and adds eps outside
    the root (and building it imports torch._dynamo, 1.3 s per process). A parameter without a
    gradient is skipped, moments included, as torch's optimizers do."""
    for name, param in params.items():
        grad = param.grad
        if grad is None:
            continue
        m[name].mul_(config.beta1).add_(grad, alpha=1 - config.beta1)
        v[name].mul_(config.beta2).addcmul_(grad, grad, value=1 - config.beta2)
        param.addcdiv_(m[name], v[name].add(config.eps).sqrt_(), value=-config.lr)


def train_adam(
    model: nn.Module,
    weights: State,
    m: State,
    v: State,
    x: torch.Tensor,
    y: torch.Tensor,
    config: AdamConfig,
    generator: torch.Generator,
    task: Task = CLASSIFICATION,
) -> AdamResult:
    """E epochs of local Adam from the global (W, M, V); returns the new (w, m, v).

    Batches are drawn as `train_local` draws them (same generator, same order). `m` and `v`
    must hold exactly the model's parameter names. Buffers get no moments and no Adam step:
    they come back as the forward passes leave them, as in `train_local` (the bundled models
    have none; BatchNorm running statistics stay local, ALGORITHMS.md).
    """
    load_weights(model, weights)
    model.train()
    params = dict(model.named_parameters())
    if m.keys() != params.keys() or v.keys() != params.keys():
        raise ValueError("m and v must hold exactly the model's parameters")
    new_m = {name: m[name].detach().clone() for name in params}
    new_v = {name: v[name].detach().clone() for name in params}
    mean_loss, samples = minibatch_epochs(
        model,
        x,
        y,
        config.epochs,
        config.batch_size,
        generator,
        lambda: _adam_step_(params, new_m, new_v, config),
        task,
        private=None if config.privacy is None else PrivateBatches(config.privacy, {}),
    )
    new_weights = {k: t.detach().clone() for k, t in model.state_dict().items()}
    dp_steps = 0
    if config.privacy is not None:
        dp_steps = round_steps(len(y), config.batch_size, config.epochs)
    return AdamResult(new_weights, new_m, new_v, mean_loss, samples, dp_steps)


def deltas(new: Mapping[str, torch.Tensor], old: Mapping[str, torch.Tensor]) -> State:
    """new - old per tensor; both must hold the same names (select the parameters first)."""
    if new.keys() != old.keys():
        raise ValueError("new and old must hold the same tensor names")
    return {name: new[name] - old[name] for name in old}


def top_k_mask(delta: Mapping[str, torch.Tensor], fraction: float) -> Masks:
    """One mask over the whole flattened model keeping its k = max(1, round(fraction d))
    entries of largest |delta|: a layer that changed more keeps more (ALGORITHMS.md 3).

    Exactly k entries are kept: ties go to the lower flat index, tensors being concatenated in
    sorted-name order so the mask does not depend on dict order. The result keeps `delta`'s
    order. ``round`` is Python's (half to even).
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    names = sorted(delta)
    flat = torch.cat([delta[name].detach().reshape(-1).to(torch.float64).abs() for name in names])
    k = min(flat.numel(), max(1, round(fraction * flat.numel())))
    kept = torch.zeros(flat.numel(), dtype=torch.bool)
    kept[torch.sort(flat, descending=True, stable=True).indices[:k]] = True
    out: Masks = {}
    offset = 0
    for name in names:
        n = delta[name].numel()
        out[name] = kept[offset : offset + n].view(delta[name].shape)
        offset += n
    return {name: out[name] for name in delta}


def sparsify(state: Mapping[str, torch.Tensor], mask: Mapping[str, torch.Tensor]) -> State:
    """`state` with every entry outside `mask` set to +0.0 (new tensors)."""
    if state.keys() != mask.keys():
        raise ValueError("state and mask must hold the same tensor names")
    return apply_masks(state, mask)


def compress(
    dW: State, dM: State, dV: State, fraction: float, mode: str
) -> tuple[SparseDelta, SparseDelta, SparseDelta]:
    """Sparsify the three deltas for upload, as (w, m, v).

    MODE_SSM: one top-k mask of |dW| for all three (the same mask object, sent once).
    MODE_TOP: three top-k masks, each of its own delta's magnitude (three masks sent).
    MODE_DENSE: all-True masks, values unchanged (FedAdam; `fraction` is ignored).
    """
    if not dW.keys() == dM.keys() == dV.keys():
        raise ValueError("dW, dM and dV must hold the same tensor names")
    if mode == MODE_SSM:
        masks = (top_k_mask(dW, fraction),) * 3
    elif mode == MODE_TOP:
        masks = (top_k_mask(dW, fraction), top_k_mask(dM, fraction), top_k_mask(dV, fraction))
    elif mode == MODE_DENSE:
        masks = ({name: torch.ones_like(t, dtype=torch.bool) for name, t in dW.items()},) * 3
    else:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    w, m, v = (
        SparseDelta(sparsify(d, mask), mask) for d, mask in zip((dW, dM, dV), masks, strict=True)
    )
    return w, m, v


def aggregate_deltas(updates: Mapping[str, State], weights: Mapping[str, float]) -> State:
    """sum_j a_j delta_j / sum_j a_j over all participants j (a_j = sample count).

    The deltas are zero outside their masks, so a coordinate an agent did not select counts as
    a 0 in the average while its weight still counts in the total (ALGORITHMS.md 3): exactly
    `aggregate_weighted` of the zero-filled deltas (sorted-id order, float64 sums).
    """
    return aggregate_weighted(updates, weights)


def apply(state: Mapping[str, torch.Tensor], delta: Mapping[str, torch.Tensor]) -> State:
    """state + delta (new tensors); tensors `delta` does not name, such as buffers, are copied."""
    if not delta.keys() <= state.keys():
        raise ValueError(f"delta names tensors the state lacks: {sorted(delta.keys() - state)}")
    return {name: t + delta[name] if name in delta else t.clone() for name, t in state.items()}
