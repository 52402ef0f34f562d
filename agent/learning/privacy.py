"""Sample-level differential privacy on the device: DP-SGD's step and its accountant.

DP-SGD (Abadi et al. 2016, Opacus's approach): each sample's gradient is computed alone
(`torch.func`: functional_call, vmap and grad; a loop over the samples for a model vmap cannot
take, such as a recurrent one), clipped to norm C over the entries that train, summed,
Gaussian noise N(0, sigma^2 C^2) added, and divided by the expected batch size. One sample
then moves a step by at most C / B plus noise it cannot tell apart, whatever its value, which
is what the accountant's bound rests on. Batches are Poisson-sampled (each sample in a step's
batch with probability q = B / n, `poisson_batches`), which is the sampling the accountant
assumes (a Poisson-sampled Gaussian event per step).

The accountant is Google's dp-accounting (the RDP accountant, composed over every DP step a
device took in the run so far), never written here: `Accountant.epsilon`. Under client-level
DP (`--dp client`, `agent.learning.central.client_dp`) a device's DP step is a round it
uploaded in: one Gaussian event of the aggregator's noise, at sampling rate 1 (every running
agent takes part in every round). Training code calls
`private_gradients_`; the learner and the reports call `Accountant` (torch-free, dp-accounting
imported when first asked).
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agent.learning import strategies
from agent.learning.config import DP_CLIENT, StrategyConfig, round_steps

if TYPE_CHECKING:
    import torch
    from torch import nn

    from agent.learning.config import SampleDP
    from agent.learning.tasks import Task

ORDERS = tuple(range(2, 256))
"""The Renyi orders the accountant minimizes over: the integers to 255 (small sampling rates
and many steps want high orders); dp-accounting's fractional orders below 2 fail to converge
at a small device's sampling rates (q of 0.3 to 0.6) and log a warning each time."""


def round_steps_of(config: StrategyConfig, samples: int) -> int:
    """A full round's DP steps for a device with `samples` training samples: as many as the
    plain round's minibatches (`config.round_steps`), each a Poisson-sampled batch, and a
    sparse strategy's RigL batches (`--rigl-batches`), whose dense gradients read the data
    too; under `--dp client`, one (the round's noised aggregate)."""
    if config.dp == DP_CLIENT:
        return 1
    rigl = config.rigl_batches if strategies.strategy(config.strategy).sparse else 0
    return round_steps(samples, config.batch_size, config.epochs) + rigl


@dataclass(frozen=True)
class Accountant:
    """One device's privacy loss: `noise` (sigma) per step, each step's batch Poisson-sampled
    at `sample_rate` from its training set, epsilon at `delta` after a number of steps."""

    noise: float
    sample_rate: float
    delta: float

    @classmethod
    def of(cls, config: StrategyConfig, samples: int) -> Accountant | None:
        """The accountant of a device with `samples` training samples under `config`; None
        without `--dp`. Under `--dp client` its steps are rounds, each with every running
        agent taking part (sampling rate 1)."""
        if config.dp == DP_CLIENT:
            return cls.of_rounds(config)
        if config.sample_dp is None:
            return None
        return cls(config.dp_noise, sample_rate(config.batch_size, samples), config.dp_delta)

    @classmethod
    def of_rounds(cls, config: StrategyConfig) -> Accountant:
        """The accountant of a `--dp client` run: a step is a round's noised aggregate, with
        every running agent taking part (sampling rate 1)."""
        return cls(config.dp_noise, 1.0, config.dp_delta)

    def epsilon(self, steps: int) -> float:
        """Epsilon at `delta` after `steps` DP steps (the RDP accountant of dp-accounting over
        a Poisson-sampled Gaussian event composed `steps` times); 0 before any."""
        return _epsilon(self.noise, self.sample_rate, steps, self.delta)

    def passes(self, steps: int, limit: float | None) -> bool:
        """Whether `steps` DP steps take epsilon past `limit` (none: never)."""
        return limit is not None and self.epsilon(steps) > limit

    def spent(self, steps: int) -> str:
        """What a device that stops before passing its limit says: its epsilon so far."""
        return f"privacy budget spent: epsilon {self.epsilon(steps):.3g} at delta {self.delta:g}"


def budget_spent(config: StrategyConfig, samples: int, steps: int) -> str | None:
    """Why a device with `samples` training samples that has taken `steps` DP steps stops
    now: its next full round would take its epsilon past `--max-epsilon`, so it trains and
    shares nothing more ("privacy budget spent: epsilon X at delta Y"); None while it may go
    on (or without a limit)."""
    accountant = Accountant.of(config, samples)
    if accountant is None or config.max_epsilon is None:
        return None
    if accountant.passes(steps + round_steps_of(config, samples), config.max_epsilon):
        return accountant.spent(steps)
    return None


def release_spent(config: StrategyConfig, round_: int) -> str | None:
    """Under `--dp client` with `--max-epsilon`: why the aggregator releases no round
    `round_` (its `round_`-th noised aggregate would take the run's epsilon past the limit),
    in the words a device that stops says it; None while it may go on. The devices stop
    themselves at the same round (`budget_spent`); this holds the aggregator to it too."""
    if config.dp != DP_CLIENT or config.max_epsilon is None:
        return None
    accountant = Accountant.of_rounds(config)
    return accountant.spent(round_ - 1) if accountant.passes(round_, config.max_epsilon) else None


def released(config: StrategyConfig, rounds: int) -> str | None:
    """Under `--dp client`: the run's privacy loss after `rounds` noised aggregates, as the
    aggregator logs it each round ("privacy spent: epsilon X at delta Y"); None otherwise."""
    if config.dp != DP_CLIENT:
        return None
    epsilon = Accountant.of_rounds(config).epsilon(rounds)
    return f"privacy spent: epsilon {epsilon:.3g} at delta {config.dp_delta:g}"


def check_run(config: StrategyConfig, model: nn.Module, samples: Mapping[str, int]) -> None:
    """ValueError (one line) for a `--dp` run that cannot go as asked: a model it cannot
    train privately (`check_private_model`), or a device (agent -> its training samples)
    whose first round alone would pass `--max-epsilon`, so that it could share nothing."""
    if config.dp == "off":
        return
    check_private_model(model, config.dp)
    limit = config.max_epsilon
    if limit is None:
        return
    for agent, n in samples.items():
        accountant = Accountant.of(config, n)
        assert accountant is not None
        first = accountant.epsilon(round_steps_of(config, n))
        if first > limit:
            raise ValueError(_below_one_round(config, agent, n, first))


def _below_one_round(config: StrategyConfig, agent: str, samples: int, first: float) -> str:
    """Why a `--max-epsilon` below one round's epsilon `first` is refused, with what to change."""
    limit, noise = config.max_epsilon, config.dp_noise
    if config.dp == DP_CLIENT:
        return (
            f"--max-epsilon {limit:g} is below one round's epsilon {first:.3g} "
            f"(--dp-noise {noise:g}): raise --dp-noise or --max-epsilon"
        )
    return (
        f"--max-epsilon {limit:g} is below one round's epsilon "
        f"{first:.3g} for {agent} ({samples} samples, --dp-noise {noise:g}): "
        "raise --dp-noise or --max-epsilon, or train fewer epochs"
    )


def sample_rate(batch_size: int, samples: int) -> float:
    """q = B / n: the probability of a sample being in a step's batch (1 when B >= n)."""
    return min(batch_size, samples) / max(samples, 1)


@functools.lru_cache(maxsize=4096)
def _epsilon(noise: float, rate: float, steps: int, delta: float) -> float:
    if steps <= 0:
        return 0.0
    import dp_accounting
    from dp_accounting import rdp

    accountant = rdp.RdpAccountant(orders=list(ORDERS))
    gaussian = dp_accounting.GaussianDpEvent(noise)
    event = gaussian if rate >= 1 else dp_accounting.PoissonSampledDpEvent(rate, gaussian)
    accountant.compose(event, steps)
    return float(accountant.get_epsilon(delta))


def noise_for(epsilon: float, rate: float, steps: int, delta: float) -> float:
    """The noise multiplier sigma that spends `epsilon` at `delta` over `steps` Poisson-sampled
    steps at `rate`: dp-accounting's calibration (a bisection over the same accountant)."""
    import dp_accounting

    def event(sigma: float) -> Any:
        gaussian = dp_accounting.GaussianDpEvent(sigma)
        step = gaussian if rate >= 1 else dp_accounting.PoissonSampledDpEvent(rate, gaussian)
        return dp_accounting.SelfComposedDpEvent(step, steps)

    return float(
        dp_accounting.calibrate_dp_mechanism(
            lambda: dp_accounting.rdp.RdpAccountant(orders=list(ORDERS)),
            event,
            epsilon,
            delta,
            dp_accounting.LowerEndpointAndGuess(0.05, 1.0),
        )
    )


# ------------------------------------------------------------------------------- the step


def poisson_batches(
    n: int, rate: float, steps: int, generator: torch.Generator
) -> list[torch.Tensor]:
    """`steps` batches of indices into n samples, each sample in each with probability
    `rate`, independently (a batch may be empty): the sampling the accountant assumes."""
    import torch

    return [
        torch.nonzero(torch.rand(n, generator=generator) < rate).flatten() for _ in range(steps)
    ]


_LOOPED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""Models vmap could not take: their per-sample gradients come from a loop."""


def check_private_model(model: nn.Module, mode: str = "sample") -> None:
    """A model DP can train: none whose forward mixes the samples of a batch. BatchNorm
    normalizes each sample with its batch's statistics (and keeps running ones), so a
    sample's gradient would depend on the others and the bound would not hold (Opacus
    refuses it too); under `--dp client` its running statistics and their integer count
    would travel beside the clipped update. GroupNorm or LayerNorm instead (the bundled
    models use GroupNorm)."""
    from torch import nn

    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            raise ValueError(
                f"--dp {mode} cannot train {name or 'the model'} ({type(module).__name__}): "
                "BatchNorm mixes a batch's samples; use GroupNorm or LayerNorm"
            )


def per_sample_gradients(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    task: Task,
    trained: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Each sample's gradient of the task's loss for the `trained` parameters (name ->
    [batch, *shape]) and each sample's loss: vmap over the batch, or a loop over it for a
    model vmap cannot take (remembered per model)."""
    if model not in _LOOPED:
        try:
            return _vmapped(model, inputs, targets, task, trained)
        except (RuntimeError, NotImplementedError, ValueError):
            _LOOPED.add(model)
    return looped_gradients(model, inputs, targets, task, trained)


def _vmapped(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    task: Task,
    trained: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    from torch.func import functional_call, grad_and_value, vmap

    fixed = {
        **{n: p.detach() for n, p in model.named_parameters() if n not in trained},
        **dict(model.named_buffers()),
    }

    def loss(params: dict[str, torch.Tensor], x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        output = functional_call(model, {**fixed, **params}, (x.unsqueeze(0),))
        return task.loss(output, t.unsqueeze(0))

    detached = {n: p.detach() for n, p in trained.items()}
    grads, losses = vmap(grad_and_value(loss), in_dims=(None, 0, 0), randomness="different")(
        detached, inputs, targets
    )
    return dict(grads), losses


def looped_gradients(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    task: Task,
    trained: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """`per_sample_gradients` one sample at a time: a forward and backward pass each."""
    import torch

    names, params = list(trained), list(trained.values())
    rows: list[tuple[torch.Tensor, ...]] = []
    losses = []
    for i in range(len(inputs)):
        loss = task.loss(model(inputs[i : i + 1]), targets[i : i + 1])
        rows.append(torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True))
        losses.append(loss.detach())
    if not rows:
        empty = {n: p.new_zeros((0, *p.shape)) for n, p in trained.items()}
        return empty, inputs.new_zeros(0)
    grads = {n: torch.stack([row[j] for row in rows]) for j, n in enumerate(names)}
    return grads, torch.stack(losses)


def private_gradients_(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    task: Task,
    dp: SampleDP,
    expected_batch: float,
    generator: torch.Generator,
    entries: Mapping[str, torch.Tensor] | None = None,
) -> float:
    """Set each trainable parameter's `.grad` to DP-SGD's gradient of the batch
    (`private_mean` over the parameters that require gradients). Returns the batch's mean
    loss (nan when empty)."""
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    means, mean_loss = private_mean(
        model, inputs, targets, task, dp, expected_batch, generator, trained, entries
    )
    for name, param in trained.items():
        param.grad = means[name].to(param.dtype)
    return mean_loss


def private_mean(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    task: Task,
    dp: SampleDP,
    expected_batch: float,
    generator: torch.Generator,
    trained: Mapping[str, torch.Tensor],
    entries: Mapping[str, torch.Tensor] | None = None,
) -> tuple[dict[str, torch.Tensor], float]:
    """DP-SGD's gradient of the batch for the `trained` parameters: every sample's gradient
    (zero outside `entries`, name -> mask of the entries that train: a sparse mask, FedSPU's
    active neurons) clipped to norm `dp.clip` over all of them, summed, Gaussian noise of
    standard deviation `dp.noise` x `dp.clip` added (zero outside `entries` too), divided by
    `expected_batch`. The noise is drawn from `generator` on the CPU, so every process draws
    the same. Returns it and the batch's mean loss (nan when empty)."""
    import torch

    entries = entries or {}
    if len(inputs):
        grads, losses = per_sample_gradients(model, inputs, targets, task, trained)
        grads = {n: g * entries[n] if n in entries else g for n, g in grads.items()}
        squares = torch.stack([g.flatten(1).pow(2).sum(1) for g in grads.values()])
        norms = squares.sum(0).sqrt()
        scale = (dp.clip / (norms + 1e-6)).clamp(max=1.0)
        summed = {n: torch.einsum("b,b...->...", scale, g) for n, g in grads.items()}
        mean_loss = float(losses.mean())
    else:
        summed = {n: torch.zeros_like(p) for n, p in trained.items()}
        mean_loss = math.nan
    means = {}
    for name, param in trained.items():
        noise = torch.normal(0.0, dp.noise * dp.clip, param.shape, generator=generator)
        noisy = summed[name] + noise.to(param.device)
        if name in entries:
            noisy = noisy * entries[name]
        means[name] = noisy / expected_batch
    return means, mean_loss
