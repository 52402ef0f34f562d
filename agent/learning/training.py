"""Local training and evaluation: the compute an agent does each round, and nothing else.

Every function takes the model weights as a state dict and returns new tensors, so the
simulator and the networked agent call the same code with the same inputs and get the same
numbers. Randomness (batch order) comes from an explicit generator derived by `derive_seed`.

The model may live on a GPU (`Learner.to`); everything else stays on the CPU: the states,
masks and data given here are CPU tensors (data may also be on the model's device), each
batch is copied to the model's device, and what comes back (states, gradients) is on the CPU,
where messages, checkpoints and reports read it. On the CPU every copy is a no-op.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from agent.learning.checkpointing import checkpointed
from agent.learning.config import SampleDP, SGDConfig, round_steps
from agent.learning.exact_freezing import active_block_gradients
from agent.learning.precision import FP32, ComputeFormat, LossScale
from agent.learning.sparse import Masks, State, apply_masks_
from agent.learning.tasks import Task

CLASSIFICATION = Task()


@dataclass(frozen=True)
class TrainResult:
    state: State
    mean_loss: float
    samples: int
    dp_steps: int = 0
    """DP-SGD steps taken (`agent.learning.privacy`), which the device's accountant counts."""


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from any labels (fleet seed, agent id, round, purpose), stable everywhere.

    sha256 rather than Python's hash(), which is salted per process.
    """
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def model_device(model: nn.Module) -> torch.device:
    """The device the model computes on (that of its first parameter; the CPU without any)."""
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def cpu_state(model: nn.Module) -> State:
    """A copy of the model's state dict on the CPU, detached: what a round returns."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def load_weights(model: nn.Module, state: State) -> None:
    """``model.load_state_dict(state)``: the same in-place copies into the model's parameters
    and buffers, without load_state_dict's per-module walk, which costs 3x the copies on the
    small models (three loads per agent and round). A state whose names or shapes differ from
    the model's goes through load_state_dict, for its checks and error messages."""
    targets = model.state_dict(keep_vars=True)
    if targets.keys() != state.keys() or any(
        target.shape != state[name].shape for name, target in targets.items()
    ):
        model.load_state_dict(state)
        return
    with torch.no_grad():
        for name, target in targets.items():
            target.copy_(state[name])


def _batches(n: int, batch_size: int, generator: torch.Generator) -> list[torch.Tensor]:
    order = torch.randperm(n, generator=generator)
    return list(order.split(min(batch_size, n)))  # type: ignore[no-untyped-call]


def sgd_step_(
    params: dict[str, nn.Parameter],
    momentum_buffers: dict[str, torch.Tensor],
    config: SGDConfig,
    round_: int,
) -> None:
    """One step of `torch.optim.SGD` (no dampening, no Nesterov), bit for bit, in place.

    Written out because building a torch optimizer imports torch._dynamo, 1.3 s of CPU in
    every agent process before its first round; the update itself is these three lines.
    """
    lr = config.lr_at(round_)
    for name, param in params.items():
        if param.grad is None:
            continue
        grad = param.grad
        if config.weight_decay != 0:
            grad = grad.add(param, alpha=config.weight_decay)
        if config.momentum != 0:
            buf = momentum_buffers.get(name)
            if buf is None:
                grad = momentum_buffers[name] = grad.detach().clone()
            else:
                grad = buf.mul_(config.momentum).add_(grad)
        param.add_(grad, alpha=-lr)


ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8


def adam_step_(
    params: dict[str, nn.Parameter],
    moments: dict[str, tuple[torch.Tensor, torch.Tensor]],
    step: int,
    config: SGDConfig,
    round_: int,
) -> None:
    """Step `step` (from 1) of Adam with decoupled weight decay (AdamW: torch.optim.AdamW's
    arithmetic, betas 0.9 and 0.999, eps 1e-8), in place; `moments` start empty each round.
    Adam's per-weight step sizes fit models whose gradients differ by orders of magnitude
    between layers (a GRU's, a model on unscaled inputs), where one SGD learning rate fits
    none of them."""
    lr = config.lr_at(round_)
    beta1, beta2 = ADAM_BETAS
    for name, param in params.items():
        if param.grad is None:
            continue
        grad = param.grad
        if name not in moments:
            moments[name] = (torch.zeros_like(param), torch.zeros_like(param))
        m, v = moments[name]
        param.mul_(1 - lr * config.weight_decay)
        m.lerp_(grad, 1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denominator = (v / (1 - beta2**step)).sqrt_().add_(ADAM_EPS)
        param.addcdiv_(m, denominator, value=-lr / (1 - beta1**step))


class LocalOptimizer:
    """A round's local optimizer (`SGDConfig.optimizer`): SGD with momentum and weight decay,
    or Adam, each after clipping the gradient's norm to `clip_norm` when set. Its state (the
    momentum or the moments) lives for one round: every round starts afresh, as the papers'
    local training does."""

    def __init__(self, params: dict[str, nn.Parameter], config: SGDConfig, round_: int) -> None:
        self.params, self.config, self.round = params, config, round_
        self.momentum: dict[str, torch.Tensor] = {}
        self.moments: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.steps = 0

    @torch.no_grad()
    def step(self) -> None:
        self.steps += 1
        if self.config.clip_norm > 0:
            trained = [p for p in self.params.values() if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(trained, self.config.clip_norm)
        if self.config.optimizer == "adam":
            adam_step_(self.params, self.moments, self.steps, self.config, self.round)
        else:
            sgd_step_(self.params, self.momentum, self.config, self.round)


@contextlib.contextmanager
def _only_trainable(model: nn.Module, trainable: set[str] | None) -> Iterator[None]:
    """Within: only the `trainable` parameters require gradients, and the buffers outside it
    (BatchNorm's running statistics, which a train-mode forward updates) are put back on
    exit. Everything requires gradients again afterwards, as before."""
    if trainable is None:
        yield
        return
    frozen = [p for name, p in model.named_parameters() if name not in trainable]
    buffers = [
        (buffer, buffer.detach().clone())
        for name, buffer in model.named_buffers()
        if name not in trainable
    ]
    for param in frozen:
        param.requires_grad_(False)
    try:
        yield
    finally:
        for param in frozen:
            param.requires_grad_(True)
        with torch.no_grad():
            for buffer, start in buffers:
                buffer.copy_(start)


def train_local(
    model: nn.Module,
    state: State,
    masks: Masks | None,
    x: torch.Tensor,
    y: torch.Tensor,
    config: SGDConfig,
    round_: int,
    generator: torch.Generator,
    *,
    frozen: Masks | None = None,
    trainable: set[str] | None = None,
    step_fraction: float | None = None,
    task: Task = CLASSIFICATION,
    compute: ComputeFormat = FP32,
    checkpoint: bool = False,
) -> TrainResult:
    """E epochs of (masked) SGD from `state`; weights outside the mask stay exactly 0.

    The mask is re-applied after every optimizer step (ALGORITHMS.md 1.5), which keeps a
    pruned weight at zero even with weight decay or momentum. `frozen` holds FedSPU's active
    masks (True = trainable, ALGORITHMS.md 2): entries where it is False are put back to
    their starting values after every step, so they come out bit-identical whatever the
    gradient, weight decay or momentum did, while still taking part in the forward pass
    (frozen buffers, such as BatchNorm's running statistics, are put back likewise). The
    backward pass computes conv and linear weight gradients for the active block only
    (`exact_freezing`), which gives the same values bit for bit in less time.
    `trainable` names the only tensors that train (a layer window, `agent.learning.prefix`):
    the other parameters do not require gradients for the round, so no backward pass runs
    before the first trainable layer and none of its activations are kept; their values and
    buffers come out unchanged. `step_fraction` trains only that fraction of the round's
    minibatches (at least one), the budget's last resort. `compute` is the step's memory
    format and precision (`agent.learning.precision`; plain fp32 by default). `checkpoint`
    checkpoints the model's blocks (`agent.learning.checkpointing`): the same numbers in
    less memory, for the time of a second forward pass through them.
    """
    load_weights(model, state)
    model.train()
    device = model_device(model)
    params = dict(model.named_parameters())
    optimizer = LocalOptimizer(params, config, round_)
    # A sub-model's masks may cover buffers (BatchNorm statistics of dropped channels): the
    # step masks the parameters, the returned state is masked whole.
    masked = {n: (params[n], mask.to(device)) for n, mask in (masks or {}).items() if n in params}
    # Frozen buffers too: every forward pass in train mode updates BatchNorm's running
    # statistics, frozen channels' included.
    tensors = {**dict(model.named_buffers()), **params}
    kept = {
        name: (tensors[name], trainable.to(device), tensors[name].detach().clone())
        for name, trainable in (frozen or {}).items()
        if not bool(trainable.all())
    }

    def step() -> None:
        optimizer.step()
        for param, trainable, start in kept.values():
            torch.where(trainable, param, start, out=param)
        for param, mask in masked.values():
            param.mul_(mask)

    steps = None
    if step_fraction is not None:
        steps = round_steps(len(y), config.batch_size, config.epochs, step_fraction)
    active = {name: mask for name, (_, mask, _) in kept.items()}
    private = None
    if config.privacy is not None:
        private = PrivateBatches.of(config.privacy, params, masked, active)
    with _stepping(model, trainable, active, compute, checkpoint, private is not None):
        mean_loss, samples = minibatch_epochs(
            model, x, y, config.epochs, config.batch_size, generator, step, task, steps, compute,
            private,
        )  # fmt: skip
    dp_steps = 0
    if private is not None:
        dp_steps = round_steps(len(y), config.batch_size, config.epochs, step_fraction)
    new_state = cpu_state(model)
    if masks:
        apply_masks_(new_state, masks)
    return TrainResult(new_state, mean_loss, samples, dp_steps)


@contextlib.contextmanager
def _stepping(
    model: nn.Module,
    trainable: set[str] | None,
    active: Masks,
    compute: ComputeFormat,
    checkpoint: bool,
    private: bool,
) -> Iterator[None]:
    """What `train_local`'s steps run within: only the `trainable` tensors requiring
    gradients, the compute format's layout and, but under DP-SGD (whose per-sample gradients
    take no backward hooks), exact freezing's block gradients and checkpointed blocks."""
    with contextlib.ExitStack() as stack:  # in this order, as before DP-SGD came
        stack.enter_context(_only_trainable(model, trainable))
        if not private:
            stack.enter_context(active_block_gradients(model, active))
        stack.enter_context(compute.laid_out(model))
        if checkpoint and not private:
            stack.enter_context(checkpointed(model))
        yield


@dataclass(frozen=True)
class PrivateBatches:
    """DP-SGD in `minibatch_epochs` (`agent.learning.privacy`): its settings, and the entries
    that train (name -> 0/1 mask; absent: all of it), outside which no sample's gradient
    counts towards its clipped norm and no noise goes."""

    dp: SampleDP
    entries: dict[str, torch.Tensor]

    @classmethod
    def of(
        cls,
        dp: SampleDP,
        params: dict[str, nn.Parameter],
        masked: dict[str, tuple[nn.Parameter, torch.Tensor]],
        active: Masks,
    ) -> PrivateBatches:
        """The entries that train: a sparse mask's kept ones (`masked`), of those FedSPU's
        `active` ones, as 0/1 in each parameter's dtype."""
        entries = {name: mask for name, (_, mask) in masked.items()}
        for name, mask in active.items():
            if name in params:
                entries[name] = entries[name] & mask if name in entries else mask
        return cls(dp, {n: m.to(params[n].dtype) for n, m in entries.items()})


def _private_epochs(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    steps: int,
    batch_size: int,
    generator: torch.Generator,
    step: Callable[[], None],
    task: Task,
    private: PrivateBatches,
) -> tuple[float, int]:
    """`minibatch_epochs` under DP-SGD: `steps` Poisson-sampled batches (each sample in with
    probability q = B / n), each step's gradient `privacy.private_gradients_`'s (plain fp32:
    a compute format's autocast and loss scale, exact freezing's and checkpointing's hooks
    do not apply to per-sample gradients). An empty batch still steps, on noise alone."""
    from agent.learning import privacy

    privacy.check_private_model(model)
    device = model_device(model)
    n = len(y)
    rate = privacy.sample_rate(batch_size, n)
    losses, samples = [], 0
    entries = {name: mask.to(device) for name, mask in private.entries.items()}
    for batch in privacy.poisson_batches(n, rate, steps, generator):
        model.zero_grad(set_to_none=True)
        inputs = x[batch].to(device)
        targets = task.target(inputs, y[batch].to(device))
        loss = privacy.private_gradients_(
            model, inputs, targets, task, private.dp, rate * n, generator, entries
        )
        with torch.no_grad():
            step()
        if len(batch):
            losses.append(loss)
        samples += len(batch)
    return sum(losses) / max(len(losses), 1), samples


def minibatch_epochs(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    epochs: int,
    batch_size: int,
    generator: torch.Generator,
    step: Callable[[], None],
    task: Task = CLASSIFICATION,
    max_steps: int | None = None,
    compute: ComputeFormat = FP32,
    private: PrivateBatches | None = None,
) -> tuple[float, int]:
    """`epochs` passes of minibatches of the task's loss in `_batches` order, calling `step` (in
    no_grad) after each backward; returns (mean batch loss, samples seen). The loop every
    local optimizer shares, so SGD and Adam see the same batches for the same generator.
    `max_steps` ends the loop early (the batch order stays that of the full round); `compute`
    lays out and autocasts each step (a step whose fp16 gradients overflowed is skipped).
    `private`: DP-SGD's steps instead, as many as the round's minibatches (`_private_epochs`)."""
    if private is not None:
        total = round_steps(len(y), batch_size, epochs)
        count = total if max_steps is None else min(total, max_steps)
        return _private_epochs(model, x, y, count, batch_size, generator, step, task, private)
    total_loss, steps, samples = 0.0, 0, 0
    device = model_device(model)
    scale = LossScale(compute)
    for _ in range(epochs):
        for batch in _batches(len(y), batch_size, generator):
            if max_steps is not None and steps >= max_steps:
                break
            model.zero_grad(set_to_none=True)
            inputs = compute.inputs(x[batch].to(device))
            with compute.autocast(device):
                loss = task.loss(model(inputs), task.target(inputs, y[batch].to(device)))
            scale.backward(loss)
            if scale.unscaled(model):
                with torch.no_grad():
                    step()
            total_loss += loss.item()
            steps += 1
            samples += len(batch)
    return total_loss / max(steps, 1), samples


def _outputs(
    model: nn.Module,
    state: State,
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int,
    task: Task,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The outputs of `state` on (x, y), batch by batch, with their targets; model in eval
    mode (call it under torch.no_grad)."""
    load_weights(model, state)
    model.eval()
    device = model_device(model)
    for start in range(0, len(y), batch_size):
        inputs = x[start : start + batch_size].to(device)
        yield model(inputs), task.target(inputs, y[start : start + batch_size].to(device))


@torch.no_grad()
def evaluate(
    model: nn.Module,
    state: State,
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int = 1024,
    task: Task = CLASSIFICATION,
) -> tuple[float, float]:
    """(mean loss, mean metric) of `state` on (x, y), model in eval mode: for
    classification the mean cross-entropy and the accuracy."""
    if len(y) == 0:
        return float("nan"), float("nan")
    loss, metric = 0.0, 0.0
    for output, target in _outputs(model, state, x, y, batch_size, task):
        batch_loss, batch_metric = task.sums(output, target)
        loss += batch_loss
        metric += batch_metric
    return loss / len(y), metric / len(y)


@torch.no_grad()
def per_sample_metric(
    model: nn.Module,
    state: State,
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int = 1024,
    task: Task = CLASSIFICATION,
) -> torch.Tensor | None:
    """The task's metric of `state` on each sample of (x, y), model in eval mode (float64, on
    the CPU); None for a custom metric that gives only a batch's mean. `evaluate`'s mean
    metric is their mean."""
    values = []
    for output, target in _outputs(model, state, x, y, batch_size, task):
        batch = task.per_sample(output, target)
        if batch is None:
            return None
        values.append(batch.cpu())
    return torch.cat(values) if values else torch.zeros(0, dtype=torch.float64)


def dense_gradients(
    model: nn.Module,
    state: State,
    names: list[str],
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int,
    num_batches: int,
    generator: torch.Generator,
    task: Task = CLASSIFICATION,
    privacy: SampleDP | None = None,
) -> tuple[dict[str, torch.Tensor], int]:
    """The task loss's gradient of the named (masked) weights as if they were dense, for RigL.

    Model in eval mode but for its BatchNorm layers, which normalize with the batch's own
    statistics as in training: the running statistics may describe other weights (those of
    the round's last minibatches, or an aggregate's), the batch's always describe these.
    Mean over `num_batches` local batches (ALGORITHMS.md 1.6). Returns the gradients (on the
    CPU) and the number of samples used, for FLOP accounting. With `privacy` (`--dp sample`),
    DP-SGD's gradients of `num_batches` Poisson-sampled batches: RigL's regrowth reads local
    data too, and the mask it moves is published with the model, so these are DP steps the
    accountant counts (`privacy.round_steps_of`).
    """
    load_weights(model, state)
    model.eval()
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.train()  # the buffer model's statistics move; the next load resets them
    device = model_device(model)
    params = dict(model.named_parameters())
    if privacy is not None:
        return _private_dense_gradients(
            model, {n: params[n] for n in names}, x, y, batch_size, num_batches, generator,
            task, privacy,
        )  # fmt: skip
    wanted = [params[name] for name in names]
    batches = _batches(len(y), batch_size, generator)[:num_batches]
    total: list[torch.Tensor] = []
    for batch in batches:
        inputs = x[batch].to(device)
        target = task.target(inputs, y[batch].to(device))
        loss = task.loss(model(inputs), target) / len(batches)
        # Only the named weights' gradients: none for norms and biases, nothing left in .grad.
        # Summed over batches in order, as backward() accumulates them.
        grads = torch.autograd.grad(loss, wanted)
        total = list(grads) if not total else [a + b for a, b in zip(total, grads, strict=True)]
    on_cpu = {name: g.to("cpu") for name, g in zip(names, total, strict=True)}
    return on_cpu, sum(len(b) for b in batches)


def _private_dense_gradients(
    model: nn.Module,
    wanted: dict[str, nn.Parameter],
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int,
    num_batches: int,
    generator: torch.Generator,
    task: Task,
    dp: SampleDP,
) -> tuple[dict[str, torch.Tensor], int]:
    """`dense_gradients` under DP-SGD: the mean over `num_batches` Poisson-sampled batches of
    `privacy.private_mean` over the `wanted` weights, whole (their masks do not apply)."""
    from agent.learning import privacy

    device = model_device(model)
    rate = privacy.sample_rate(batch_size, len(y))
    total = {name: torch.zeros_like(p) for name, p in wanted.items()}
    samples = 0
    for batch in privacy.poisson_batches(len(y), rate, num_batches, generator):
        inputs = x[batch].to(device)
        targets = task.target(inputs, y[batch].to(device))
        means, _ = privacy.private_mean(
            model, inputs, targets, task, dp, rate * len(y), generator, wanted
        )
        total = {name: total[name] + means[name] / num_batches for name in total}
        samples += len(batch)
    return {name: g.detach().to("cpu") for name, g in total.items()}, samples
