"""A model each device can trust (ALGORITHMS.md 6, "never worse than alone").

A personalized strategy is worth deploying only if each device's model beats what the device
could train alone, and no strategy does so on every device: where a device's data is its own
(a machine's calibration, a speaker's voice), a model shaped by its neighbours can fit it
worse than its own. So after every round each device judges, on its own validation split
(data the strategy never trained on), the models it holds:

    personal  the model the strategy left it (decentralized strategies; the fine-tuned
              model of a centralized one: the global model after its local epochs)
    fleet     the global model of a centralized strategy that broadcasts one
    local     its local-only model (`--fallback local`): the `local` strategy's model,
              trained beside the strategy's on the same data and batches

and keeps the best (`choose`): that model is what its round records, statuses and reports
give, what it serves and exports. Ties keep the strategy's model (`personal` for the
personalized strategies, `fleet` for the others), and the local model stays unless another
beats it by more than the validation split's noise. The local model is the one fallback that
costs training, every round (its FLOPs are reported apart, `fallback_flops`): the device's
own model trained as if alone, whatever the fleet gives.

Measured (bench/learning_quality.py, seeds 1-3): a local model that stopped training once the
strategy's had beaten it on validation 5 rounds in a row saved 30-50% of its training where
the fleet helps, but went on to lose to a local model trained to the end: 8 to 11 of 24
anomaly-detection devices kept a fleet model worse than alone under FedAvg, DFedAvgM, FedAdam
and FedLDF, and 2 to 4 of 24 keyword-spotting devices; trained every round, no device did
(those strategies on the anomaly, keyword-spotting and user-regression tasks). One that
stopped once its own validation loss stopped improving (best weights kept) was worse than the
`local` strategy's final model on 3 of 24 sensor-regression devices: validation sets of 20-40
samples pick a best round by noise.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from agent.learning import averaging
from agent.learning.config import SGDConfig, StrategyConfig
from agent.learning.kept import LOCAL, PERSONAL, Judged, Kept, Shadow
from agent.learning.sparse import Masks, State
from agent.learning.training import evaluate, per_sample_metric, train_local

if TYPE_CHECKING:
    from agent.learning.learner import AgentState, Learner, LocalData, RoundResult


def shadow_config(learner: Learner) -> SGDConfig:
    """How the local model trains: as the strategy's agents train, alone; for the FedAdam
    family, whose learning rate is its own Adam's, as the SGD strategies' agents train
    (`StrategyConfig.local_training` with the default optimizer and rates). Never under
    DP-SGD (`--dp sample`): this model is never sent, so it spends none of the device's
    privacy budget, and it is what the device would have alone (docs/privacy.md)."""
    cfg = learner.config
    if not learner.traits.adam:
        return dataclasses.replace(learner.facts.sgd, privacy=None)
    plain = StrategyConfig(epochs=cfg.epochs, batch_size=cfg.batch_size)
    return plain.local_training(learner.facts.recurrent)


def start_shadow(learner: Learner) -> Shadow:
    """The local model before round 1: the fleet's dense initial weights, as the `local`
    strategy starts."""
    return Shadow(dict(learner.facts.initial))


def train_shadow(
    learner: Learner, shadow: Shadow, data: LocalData, agent_id: str, round_: int
) -> tuple[Shadow, int]:
    """One round of the local model (the `local` strategy's round: the same generator, so
    the same batches); returns it and the round's training FLOPs. Not without a validation
    split, where nothing could choose it."""
    if len(data.y_val) == 0:
        return shadow, 0
    trained = train_local(
        learner.facts.model,
        shadow.weights,
        None,
        data.x_train,
        data.y_train,
        shadow_config(learner),
        round_,
        learner.facts.generator("train", agent_id, round_),
        task=learner.facts.task,
        compute=learner.facts.compute_format,
    )
    shadow = Shadow(learner.facts.fresh_statistics(trained.state, data), shadow.rounds + 1)
    return shadow, learner.facts.train_flops(None, trained.samples)


def choose(
    learner: Learner, candidates: Mapping[str, tuple[State, Masks | None]], data: LocalData
) -> Kept:
    """The candidate with the best validation metric (ties: the lower validation loss, then
    the earlier candidate: give the strategy's model first), unless the device's local-only
    model is among them and the best is not better than it beyond the validation split's
    noise (`beats_local`): then the local one, which is what the device would have alone.
    Without a validation split, the first candidate."""
    names = list(candidates)
    if len(names) == 1 or len(data.y_val) == 0:
        weights, masks = candidates[names[0]]
        return Kept(names[0], weights, masks, {}, "no other model to compare")
    ranks = {
        name: _rank(learner, candidates[name][0], data, order) for order, name in enumerate(names)
    }
    best = min(names, key=ranks.__getitem__)
    scores = {name: ranks[name][3] for name in names}
    held_back = ""
    local = candidates.get(LOCAL)
    if best != LOCAL and local and not beats_local(learner, candidates[best][0], local[0], data):
        best, held_back = LOCAL, f"; {best}'s lead is within the validation noise"
    weights, masks = candidates[best]
    others = ", ".join(f"{n} {scores[n]:.4g}" for n in names if n != best)
    reason = f"validation {learner.facts.task.metric_name} {scores[best]:.4g} against {others}"
    return Kept(best, weights, masks, scores, reason + held_back)


def beats_local(learner: Learner, weights: State, local: State, data: LocalData) -> bool:
    """Whether `weights` is better than the local-only model on the validation split by more
    than one standard error of their per-sample difference (a paired comparison on the same
    samples). A device trusts the fleet's model over its own only on evidence: with 20-40
    validation samples a lead of a sample or two is noise, and keeping the fleet's model on
    it left 9 of 24 anomaly-detection devices worse than alone under FedAvg
    (bench/learning_quality.py). A custom metric without per-sample values: any lead."""
    task = learner.facts.task
    ours = per_sample_metric(learner.facts.model, weights, data.x_val, data.y_val, task=task)
    theirs = per_sample_metric(learner.facts.model, local, data.x_val, data.y_val, task=task)
    if ours is None or theirs is None:
        return True
    lead = (ours - theirs) * (1.0 if task.higher_is_better else -1.0)
    if not bool(torch.isfinite(lead).all()):
        return False
    spread = float(lead.std()) / math.sqrt(len(lead)) if len(lead) > 1 else 0.0
    return float(lead.mean()) > spread


def _rank(
    learner: Learner, weights: State, data: LocalData, order: int = 0
) -> tuple[float, float, int, float]:
    """How a model ranks on the validation split, lower first: its metric in the task's good
    direction, then its loss, then `order`; NaN (a diverged model) last. The metric itself
    comes last, for the record."""
    loss, metric = evaluate(
        learner.facts.model, weights, data.x_val, data.y_val, task=learner.facts.task
    )
    sign = 1.0 if learner.facts.task.higher_is_better else -1.0
    finite_metric = metric if math.isfinite(metric) else -sign * math.inf
    return (-sign * finite_metric, loss if math.isfinite(loss) else math.inf, order, metric)


def own_model(learner: Learner) -> str:
    """What the strategy's own model is to the device: its local-only model under a strategy
    whose agents train `alone` (local), else its personal one."""
    return LOCAL if learner.traits.alone else PERSONAL


def advance(
    learner: Learner, agent: AgentState, data: LocalData, round_: int, p_k: float | None = None
) -> tuple[AgentState, int]:
    """The device's local-only model one round on (`--fallback local`; not for the `local`
    strategy, whose model it is), and the FLOPs that cost. A device whose budget p_k cuts its
    rounds (p_k < 1) has no time for a second model: its local model stays as it is (it
    keeps the best of the models it holds)."""
    cfg = learner.config
    if cfg.fallback != "local" or learner.traits.alone or (p_k is not None and p_k < 1):
        return agent, 0
    shadow, flops = train_shadow(
        learner, agent.shadow or start_shadow(learner), data, agent.agent_id, round_
    )
    return dataclasses.replace(agent, shadow=shadow), flops


def judge(
    learner: Learner,
    agent: AgentState,
    data: LocalData,
    held: dict[str, tuple[State, Masks | None]],
    fallback_flops: int = 0,
    tested: tuple[float, float] | None = None,
) -> tuple[AgentState, Judged]:
    """What the device keeps of the models it `held` (the strategy's first) and its
    local-only model (`choose`, on its validation split; `--fallback off`: the strategy's),
    with the test figures of the kept model and of the strategy's (`tested` when known: its
    test loss and metric). Under `--dp sample` with `--dp-average` the strategy's model is
    first averaged with its previous ones (`averaging`): that average is what the device
    judges, keeps and reports, and what its state carries to the next round; the strategy's
    figures stay those of the round's model, which it trains on from and sends."""
    first = next(iter(held))
    strategy_loss, strategy_metric = tested or learner.facts.evaluate_on(held[first][0], data)
    share = averaging.kept_share(learner.config)
    if share > 0:
        held = {**held, first: averaging.averaged_candidate(agent.averaged, held[first], share)}
        agent = dataclasses.replace(agent, averaged=held[first][0])
    mode = learner.config.fallback
    candidates = dict(held) if mode != "off" else {first: held[first]}
    if agent.shadow is not None and mode == "local":
        candidates[LOCAL] = (agent.shadow.weights, None)
    kept = choose(learner, candidates, data)
    loss, metric = strategy_loss, strategy_metric
    if kept.name != first or share > 0:
        loss, metric = learner.facts.evaluate_on(kept.weights, data)
    judged = Judged(kept, loss, metric, strategy_loss, strategy_metric, fallback_flops)
    return dataclasses.replace(agent, kept=kept), judged


def settle(
    learner: Learner, result: RoundResult, data: LocalData, p_k: float | None
) -> RoundResult:
    """A decentralized round's result once the device judged it: the local-only model's
    round, then the device's choice between it and its own model (`advance`, `judge`); the
    result's figures become the kept model's."""
    agent, flops = advance(learner, result.state, data, result.state.round, p_k)
    own = {own_model(learner): (agent.weights, agent.masks)}
    agent, judged = judge(learner, agent, data, own, flops, (result.loss, result.accuracy))
    return dataclasses.replace(
        result, state=agent, loss=judged.loss, accuracy=judged.metric, judged=judged
    )
