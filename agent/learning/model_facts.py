"""The model's facts: what a round's rules read of the model a run trains, apart from the
strategy that trains it.

A `ModelFacts` is the leaf every rule builds on: its shapes, FLOPs, plans, the seeded
generators of its draws, its BatchNorm statistics and how it is evaluated. The budget's
rule (`reduction`), the reduced training (`reduced`, `reductions`), the costs a device
measures (`agent.device.calibration`), the centralized and decentralized strategies and
early stopping take it rather than the `learner.Learner` that holds it beside the strategy
and the round, so that none of them imports the learner (no import cycle, even a
type-only one). It imports torch and the modules it builds on, never the learner.

One `ModelFacts` serves every agent of a simulation: the model module is only a compute
buffer, weights are loaded from the agent's state each time.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from agent.learning import channels, prefix, sparse, statistics
from agent.learning.config import STOP_LAMBDA, StrategyConfig
from agent.learning.models import flops_from_positions, output_positions
from agent.learning.precision import FP32
from agent.learning.tasks import Task
from agent.learning.training import CLASSIFICATION, derive_seed, evaluate, model_device

if TYPE_CHECKING:
    from agent.learning.facts import LocalData
    from agent.learning.freezing import FreezingPlan
    from agent.learning.prefix import Layer
    from agent.learning.sparse import Masks, State
    from agent.learning.width import WidthPlan

log = logging.getLogger(__name__)


class ModelFacts:
    """A model to compute with and what follows from it under the run's config: shapes,
    FLOPs, plans, generators, masks' layout, BatchNorm statistics and evaluation."""

    def __init__(
        self,
        model: nn.Module,
        input_shape: tuple[int, ...],
        prunable: list[str],
        config: StrategyConfig,
        seed: int,
        task: Task = CLASSIFICATION,
        *,
        sparse_masks: bool = False,
    ) -> None:
        self.model = model
        self.task = task
        self.input_shape = input_shape
        self.prunable = prunable
        self.config = config
        """The run's settings the facts depend on (density, mask unit, BatchNorm, optimizer)
        and the rules read (reduce mode, batch size, aggregation)."""
        self.seed = seed
        self.initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        # Output positions per layer, read once: FLOPs under a mask need only the kept counts.
        self._positions = output_positions(model, input_shape)
        self._weight_shapes = {n: tuple(self.initial[n].shape) for n in self._positions}
        self.dense_flops = flops_from_positions(self._positions, self._weight_shapes)
        self.sparse = sparse_masks
        """Each agent trains the model under a mask of its own (the strategy's trait)."""
        self._shapes = {name: tuple(self.initial[name].shape) for name in prunable}
        self.channel_masks = sparse_masks and config.mask_unit == "channel"
        """Masks keep whole channels (`agent.learning.channels`), the model trains narrow."""
        if self.channel_masks:
            self.channel_plan  # noqa: B018 - a model it cannot cut is refused here, in one line
        self.compute_format = FP32
        """The training step's memory format and precision, as the device measured it
        fastest (`agent.device.calibration`); plain fp32 unless a measurement says so."""
        self.local_keys = local_statistics(model) if config.batchnorm == "local" else ()
        """State entries that never take another device's values (`own_statistics`)."""
        self.recurrent = any(isinstance(m, nn.RNNBase) for m in model.modules())
        self.sgd = config.local_training(self.recurrent)  # recurrent: Adam (--optimizer auto)

    @property
    def device(self) -> torch.device:
        """The device the model computes on (`to`); weights and masks stay on the CPU."""
        return model_device(self.model)

    def to(self, device: torch.device) -> None:
        """Compute on `device` from now on: only the model moves. The weights, masks and data
        a round takes and returns stay CPU tensors (`agent.learning.training` copies batches
        in and results out), and the generators stay CPU ones, so batch order, masks and
        active neurons are drawn as on the CPU."""
        self.model.to(device)

    def generator(self, purpose: str, agent_id: str, round_: int) -> torch.Generator:
        """The generator of one draw, seeded by (fleet seed, purpose, agent, round) alone."""
        return torch.Generator().manual_seed(derive_seed(self.seed, purpose, agent_id, round_))

    def drawn_masks(self, agent_id: str) -> Masks:
        """An agent's first mask at the run's density, drawn from (fleet seed, agent id)
        alone (1.1): by ERK, or over whole channels with channel masks
        (`channels.random_masks`). Any agent can therefore recompute any other agent's
        starting model w0 (.) m_j, so round 1 needs no initial exchange of models. A sparse
        strategy's first mask (`SparseStrategy.initial_masks`)."""
        generator = self.generator("mask", agent_id, 0)
        density = self.config.density
        if self.channel_masks:
            return channels.random_masks(self.channel_plan, density, generator)
        return sparse.random_masks(
            self._shapes, sparse.erk_densities(self._shapes, density), generator
        )

    def initial_model(self, agent_id: str) -> tuple[State, Masks | None]:
        """A first model's weights and masks, w0 (.) m_k, as an agent of the run's strategy
        starts (masked when it trains sparse models): what calibration measures."""
        masks = self.drawn_masks(agent_id) if self.sparse else None
        return self.initial_under(masks), masks

    def initial_under(self, masks: Masks | None) -> State:
        """The initial weights under `masks`, w0 (.) m (None: all of them): the model an
        agent with those first masks starts from, which any agent can recompute (1.1)."""
        return sparse.apply_masks(self.initial, masks) if masks else dict(self.initial)

    def forward_flops(self, masks: Masks | None) -> int:
        """Forward FLOPs per sample with the conv/linear weights of `masks` (other entries of
        `masks`, such as biases, are ignored; None: dense)."""
        if not masks:
            return self.dense_flops
        weights = {n: m for n, m in masks.items() if n in self._positions}
        return flops_from_positions(self._positions, self._weight_shapes, weights)

    def train_flops(self, masks: Masks | None, samples: int) -> int:
        """3 x forward FLOPs of the (masked) model x samples: forward + backward (1.10)."""
        return 3 * self.forward_flops(masks) * samples

    def dense_gradient_flops(self, masks: Masks | None, samples: int) -> int:
        """RigL's dense-gradient batches (1.10), counted as the RigL paper does (Evci et al.
        2020, sec. 3: 2 f_S + f_D per sample): the forward pass and the gradient of the
        inputs go through the masked model, like training's; only the weights' gradient is
        dense."""
        return (2 * self.forward_flops(masks) + self.dense_flops) * samples

    def flops_per_density(self, masks: Masks) -> float:
        """FLOP fraction / parameter density of these masks (ERK keeps FLOP-heavy layers
        denser), for `agent.learning.reduction.density_cap`."""
        density = 1.0 - sparse.sparsity(masks)
        flops = flops_from_positions(self._positions, self._weight_shapes, masks)
        return flops / self.dense_flops / density

    def own_statistics(self, state: State, own: State) -> State:
        """`state` with the agent's `own` BatchNorm running statistics (FedBN): a device's
        statistics describe its own data's features, which differ from device to device in
        the non-IID fleets this is for; averaged ones normalize every device with a mix
        that fits none of them (Li et al. 2021, FedBN). The learned scale and shift are
        averaged as usual. `state` itself when the model has none (or with --batchnorm
        shared)."""
        if not self.local_keys:
            return state
        return {name: own[name] if name in self.local_keys else t for name, t in state.items()}

    def fresh_statistics(self, weights: State, data: LocalData) -> State:
        """`weights` with its BatchNorm running statistics re-estimated from the device's
        training data under these very weights (`statistics.refreshed`), as a model is
        evaluated, kept and served; itself without BatchNorm or with --batchnorm shared."""
        return statistics.refreshed(self.model, weights, data.x_train, self.local_keys)

    @functools.cached_property
    def freezing_plan(self) -> FreezingPlan:
        """What FedSPU and `--reduce freeze` freeze in this model (`freezing.freezing_plan`),
        inferred once: it traces the model and runs a forward pass, too much for every draw.
        A model without neuron groups freezes whole layers, and says so here, once."""
        from agent.learning.freezing import freezing_plan

        plan = freezing_plan(self.model, self.input_shape)
        if plan.note is not None:
            log.warning("%s", plan.note)
        return plan

    @functools.cached_property
    def layer_groups(self) -> dict[str, list[str]]:
        """FedLDF's layers: each weight with its bias and norm parameters."""
        from agent.learning.ldf import layer_groups

        return layer_groups(self.model)

    @functools.cached_property
    def forward_layers(self) -> tuple[Layer, ...]:
        """The layers a window trains (`agent.learning.prefix`), in forward order: read once
        with a probe pass."""
        return prefix.forward_layers(self.model, self.input_shape)

    @functools.cached_property
    def channel_plan(self) -> channels.ChannelPlan:
        """The channels `--mask-unit channel` keeps or drops (`agent.learning.channels`),
        traced once; ValueError in one line for a model with none to drop."""
        from agent.learning.width import channel_classes

        try:
            classes = channel_classes(self.model, self.input_shape)
            plan = channels.channel_plan(classes, self._shapes)
        except ValueError as exc:
            raise ValueError(f"--mask-unit channel: {exc}") from None
        return plan

    @functools.cached_property
    def width_plan(self) -> WidthPlan:
        """The channels a narrower sub-model keeps (`agent.learning.width`), traced once."""
        from agent.learning.width import width_plan

        plan = width_plan(self.model, self.input_shape)
        if plan.note is not None:
            log.warning("%s", plan.note)
        return plan

    def stopping_loss(self, weights: State, train_loss: float, data: LocalData) -> float:
        """L_t = 0.7 L_train + 0.3 L_val (ALGORITHMS.md 2): L_train this round's mean training
        loss, L_val the trained model's loss on the validation split, in eval mode. An agent
        stops once L_t exceeds its previous L (NaN, e.g. without a validation split, never)."""
        val_loss, _ = evaluate(self.model, weights, data.x_val, data.y_val, task=self.task)
        return STOP_LAMBDA * train_loss + (1.0 - STOP_LAMBDA) * val_loss

    def evaluate_on(self, weights: State, data: LocalData) -> tuple[float, float]:
        """(mean loss, metric) of `weights` on the agent's test split: the task's metric,
        accuracy for classification."""
        return evaluate(self.model, weights, data.x_test, data.y_test, task=self.task)


def local_statistics(model: nn.Module) -> tuple[str, ...]:
    """The state-dict names of the model's BatchNorm running statistics (running mean,
    variance and batch count): what FedBN keeps on each device."""
    return tuple(
        f"{name}.{buffer}" if name else buffer
        for name, module in model.named_modules()
        if isinstance(module, nn.modules.batchnorm._BatchNorm)
        for buffer, value in module.named_buffers(recurse=False)
        if value is not None
    )
