"""The sparse strategies' steps (dadpfl, dispfl): each agent's model lives under its own
mask, drawn by ERK (1.1, or over whole channels with `--mask-unit channel`), which each
round scores for pruning-time detection (1.7), may prune further (`SparseStrategy.prune`:
only DA-DPFL does) and moves with RigL (1.6)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from agent.learning import channels, pruning, rigl, sparse
from agent.learning.decentral.base import DecentralizedStrategy, MaskStep, RoundStart, Trained
from agent.learning.training import dense_gradients

if TYPE_CHECKING:
    from agent.learning.config import StrategyConfig
    from agent.learning.facts import AgentFacts, LocalData
    from agent.learning.model_facts import ModelFacts
    from agent.learning.sparse import Masks, State


class SparseStrategy(DecentralizedStrategy):
    """A strategy whose agents train sparse models, each under a mask of its own drawn at
    the start; after training, detection's vote, then `prune` (none here), then RigL's mask
    update, in the order of the paper's Algorithm 1."""

    def initial_masks(self, learner: ModelFacts, agent_id: str) -> Masks | None:
        """The agent's ERK mask at the run's density (1.1), or with channel masks its
        channels drawn at that density (`ModelFacts.drawn_masks`)."""
        return learner.drawn_masks(agent_id)

    def after_training(self, learner: ModelFacts, start: RoundStart, trained: Trained) -> MaskStep:
        agent, weights, masks = start.agent, trained.weights, start.masks
        if masks is None:
            return MaskStep(weights, masks, agent.distances)
        distances, score, vote = detect(learner.config, learner.prunable, agent, weights)
        weights, masks, pruned = self.prune(learner, weights, masks, start.prune_now)
        weights, masks, flops = rigl_step(
            learner, weights, masks, start.data, agent.agent_id, start.round
        )
        dp_steps = learner.config.rigl_batches if learner.sgd.privacy is not None else 0
        return MaskStep(weights, masks, distances, flops, vote, score, pruned, dp_steps)

    def prune(
        self, learner: ModelFacts, weights: State, masks: Masks, prune_now: bool
    ) -> tuple[State, Masks, bool]:
        """The model pruned further this round, and whether it was: never here."""
        return weights, masks, False


def detect(
    cfg: StrategyConfig, prunable: list[str], agent: AgentFacts, weights: State
) -> tuple[list[float], float, bool]:
    """Pruning-time detection (1.7): the distances so far, this round's score and vote."""
    distance = pruning.distance_from_init(
        weights, agent.init_weights, prunable, cfg.detection_distance
    )
    distances = [*agent.distances, distance]
    score = pruning.scaled_score(distances, cfg.detection_scale)
    return distances, score, pruning.vote(score, cfg.pruning_threshold)


def rigl_step(
    learner: ModelFacts, weights: State, masks: Masks, data: LocalData, agent_id: str, round_: int
) -> tuple[State, Masks, int]:
    """RigL's mask update (1.6) from dense gradients on local batches; returns the new
    weights and masks and the FLOPs the dense gradients cost. With channel masks, over
    whole channels (`channels.rigl_update`), the gradients taken at `channels.revived`."""
    cfg = learner.config
    plan = learner.channel_plan if learner.channel_masks else None
    grads, grad_samples = dense_gradients(
        learner.model,
        weights if plan is None else channels.revived(plan, weights, learner.initial, masks),
        learner.prunable,
        data.x_train,
        data.y_train,
        cfg.batch_size,
        cfg.rigl_batches,
        learner.generator("rigl", agent_id, round_),
        learner.task,
        learner.sgd.privacy,
    )
    flops = learner.dense_gradient_flops(masks, grad_samples)
    alpha = rigl.rigl_alpha(round_, cfg.rounds, cfg.rigl_a)
    if plan is not None:
        weights, masks = channels.rigl_update(plan, weights, masks, grads, learner.initial, alpha)
        return weights, masks, flops
    masks = rigl.rigl_update(weights, masks, grads, alpha)
    return sparse.apply_masks(weights, masks), masks, flops
