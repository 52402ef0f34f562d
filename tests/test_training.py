"""Local training, the strategy's round, and the torch <-> wire bridge."""

from __future__ import annotations

import pytest
import torch

from agent.learning import Learner, LocalData, Published, preset, sparse
from agent.learning.config import SGDConfig
from agent.learning.models import build_model, forward_flops, prunable_names
from agent.learning.training import derive_seed, evaluate, sgd_step_, train_local
from agent.runtime import decode_state, encode_state, expected_shapes
from protocol import ProtocolError

INPUT = (1, 40)


def _setup(strategy: str = "dadpfl", **overrides: object) -> tuple[Learner, LocalData]:
    model = build_model("cnn1d", INPUT, 10, seed=0)
    config = preset(strategy, rounds=10, epochs=1, batch_size=16, **overrides)
    learner = Learner(model, INPUT, prunable_names(model), config, seed=5)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(48, *INPUT, generator=g), torch.randint(0, 10, (48,), generator=g)
    return learner, LocalData(x[:32], y[:32], x[32:40], y[32:40], x[40:], y[40:])


def test_masked_sgd_keeps_pruned_weights_exactly_zero() -> None:
    learner, data = _setup()
    agent = learner.init_agent("a")
    config = SGDConfig(lr=0.5, momentum=0.9, weight_decay=0.01, batch_size=8, epochs=2)
    result = train_local(
        learner.facts.model,
        agent.weights,
        agent.masks,
        data.x_train,
        data.y_train,
        config,
        1,
        torch.Generator().manual_seed(1),
    )
    for name, mask in agent.masks.items():
        assert torch.all(result.state[name][~mask] == 0)
        assert torch.any(result.state[name][mask] != agent.weights[name][mask])
    assert result.samples == 2 * 32
    assert result.mean_loss > 0


@pytest.mark.parametrize("momentum, weight_decay", [(0.0, 5e-4), (0.9, 0.01), (0.5, 0.0)])
def test_the_sgd_step_is_torchs_sgd_bit_for_bit(momentum: float, weight_decay: float) -> None:
    config = SGDConfig(lr=0.3, lr_decay=0.9, momentum=momentum, weight_decay=weight_decay)
    ours, reference = (build_model("cnn1d", INPUT, 10, seed=0) for _ in range(2))
    optimizer = torch.optim.SGD(
        reference.parameters(),
        lr=config.lr_at(2),
        momentum=momentum,
        weight_decay=weight_decay,
    )
    params, buffers = dict(ours.named_parameters()), {}
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        x, y = torch.randn(8, *INPUT, generator=g), torch.randint(0, 10, (8,), generator=g)
        for model in (ours, reference):
            model.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        with torch.no_grad():
            sgd_step_(params, buffers, config, 2)
    want = reference.state_dict()
    for name, got in ours.state_dict().items():
        assert torch.equal(got, want[name]), name


def test_training_is_a_pure_function_of_its_inputs() -> None:
    learner, data = _setup()
    agent = learner.init_agent("a")
    runs = [
        train_local(
            learner.facts.model,
            agent.weights,
            agent.masks,
            data.x_train,
            data.y_train,
            SGDConfig(epochs=1, batch_size=8),
            3,
            torch.Generator().manual_seed(7),
        ).state
        for _ in range(2)
    ]
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
    assert torch.equal(
        agent.weights["features.0.weight"], learner.init_agent("a").weights["features.0.weight"]
    )


def test_derived_seeds_are_stable_and_distinct() -> None:
    assert derive_seed(1, "train", "a", 3) == derive_seed(1, "train", "a", 3)
    assert derive_seed(1, "train", "a", 3) != derive_seed(1, "train", "b", 3)
    assert derive_seed(1, "train", "a", 3) == 8891325487050540596
    assert 0 <= derive_seed("x") < 2**63


def test_every_agent_can_derive_every_other_agents_starting_mask() -> None:
    learner, _ = _setup()
    again, _ = _setup()
    a, b = learner.initial_masks("a"), again.initial_masks("a")
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = learner.initial_masks("c")
    assert any(not torch.equal(a[k], c[k]) for k in a)
    assert sparse.sparsity(a) == pytest.approx(0.5, abs=0.01)


def test_a_round_publishes_an_exactly_masked_model_and_counts_its_flops() -> None:
    learner, data = _setup()
    agent = learner.init_agent("a")
    neighbour = learner.init_agent("b")
    inbox = {"b": Published(neighbour.weights, neighbour.masks, 32)}
    result = learner.local_round(agent, data, inbox, 1, prune_now=False)
    published = result.published
    for name, mask in published.masks.items():
        assert torch.all(published.weights[name][~mask] == 0)
        assert int(mask.sum()) == int(agent.masks[name].sum()), "RigL keeps layer density"
    sparse_per_sample = forward_flops(learner.facts.model, INPUT, agent.masks)
    rigl = (2 * sparse_per_sample + learner.facts.dense_flops) * 16  # masked fwd and input grad
    assert result.train_flops == 3 * sparse_per_sample * 32 + rigl
    assert result.state.round == 1 and len(result.state.distances) == 1
    assert result.score == 1.0 and result.vote is False


def test_rigls_flops_count_the_masks_its_gradient_ran_with_after_further_pruning() -> None:
    learner, data = _setup(target_sparsity=0.7)
    agent = learner.init_agent("a")
    result = learner.local_round(agent, data, {}, 1, prune_now=True)
    pruned = result.published.masks  # RigL keeps each layer's count, so its FLOPs too
    assert sparse.sparsity(pruned) > sparse.sparsity(agent.masks)
    trained = forward_flops(learner.facts.model, INPUT, agent.masks)
    rigl = forward_flops(learner.facts.model, INPUT, pruned)
    assert result.train_flops == 3 * trained * 32 + (2 * rigl + learner.facts.dense_flops) * 16


def test_dense_strategies_average_plainly_and_never_mask() -> None:
    learner, data = _setup("dfedavgm")
    agent = learner.init_agent("a")
    assert agent.masks is None
    result = learner.local_round(agent, data, {}, 1, prune_now=False)
    assert result.published.masks is None and result.vote is None
    assert result.train_flops == 3 * learner.facts.dense_flops * 32


def test_evaluate_reports_loss_and_accuracy() -> None:
    learner, data = _setup()
    loss, accuracy = evaluate(learner.facts.model, learner.facts.initial, data.x_test, data.y_test)
    assert loss > 0 and 0 <= accuracy <= 1
    empty = evaluate(learner.facts.model, learner.facts.initial, data.x_test[:0], data.y_test[:0])
    assert all(value != value for value in empty), "no test data: NaN, not a made-up number"


def test_the_wire_round_trip_restores_weights_and_masks() -> None:
    learner, _ = _setup()
    agent = learner.init_agent("a")
    weights, masks = decode_state(
        encode_state(agent.weights, agent.masks), expected_shapes(agent.weights)
    )
    assert all(torch.equal(weights[k], agent.weights[k]) for k in weights)
    assert all(torch.equal(masks[k], agent.masks[k]) for k in masks)
    half, _ = decode_state(
        encode_state(agent.weights, agent.masks, fp16=True), expected_shapes(agent.weights)
    )
    assert all(torch.allclose(half[k], agent.weights[k], atol=1e-3) for k in half)


def test_the_wire_rejects_a_model_of_another_shape_or_with_nan() -> None:
    learner, _ = _setup()
    agent = learner.init_agent("a")
    other = build_model("mlp", (40,), 10, seed=0).state_dict()
    with pytest.raises(ProtocolError):
        decode_state(encode_state(other), expected_shapes(agent.weights))
    poisoned = {k: v.clone() for k, v in agent.weights.items()}
    poisoned["classifier.bias"][0] = float("nan")
    with pytest.raises(ProtocolError):
        decode_state(encode_state(poisoned), expected_shapes(agent.weights))
