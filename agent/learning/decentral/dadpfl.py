"""DA-DPFL (ALGORITHMS.md 1): a sparse strategy whose agents also prune further, by PQI
(1.9), at the pruning times their votes settle, toward the target sparsity s*."""

from __future__ import annotations

from typing import TYPE_CHECKING

from agent.learning import channels, pqi, sparse
from agent.learning.decentral.sparse import SparseStrategy

if TYPE_CHECKING:
    from agent.learning.config import StrategyConfig
    from agent.learning.model_facts import ModelFacts
    from agent.learning.sparse import Masks, State


class DADPFL(SparseStrategy):
    """dadpfl: DisPFL's sparse rounds, waiting for up to N prior neighbours, with further
    pruning at the voted times."""

    name = "dadpfl"

    def prune(
        self, learner: ModelFacts, weights: State, masks: Masks, prune_now: bool
    ) -> tuple[State, Masks, bool]:
        """PQI further pruning when the plan prunes this round and the model is still
        denser than s*."""
        cfg = learner.config
        if not prune_now or sparse.sparsity(masks) >= cfg.target_sparsity:
            return weights, masks, False
        plan = learner.channel_plan if learner.channel_masks else None
        masks = prune_further(cfg, weights, masks, plan)
        return sparse.apply_masks(weights, masks), masks, True


def prune_further(
    cfg: StrategyConfig, weights: State, masks: Masks, plan: channels.ChannelPlan | None = None
) -> Masks:
    """PQI further pruning (1.9) toward the target sparsity s*: of weights, or with a
    `plan` of whole channels (`agent.learning.channels`)."""
    if plan is not None:
        count = channels.pqi_counter(
            cfg.pqi_p, cfg.pqi_q, cfg.pqi_eta_c, cfg.pqi_gamma, cfg.pqi_beta
        )
        return channels.pqi_prune(plan, weights, masks, count, cfg.target_sparsity)
    return pqi.pqi_prune(
        weights,
        masks,
        p=cfg.pqi_p,
        q=cfg.pqi_q,
        eta_c=cfg.pqi_eta_c,
        gamma=cfg.pqi_gamma,
        beta=cfg.pqi_beta,
        target_sparsity=cfg.target_sparsity,
    )
