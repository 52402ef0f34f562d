"""A round that trained a window of layers (`--reduce prefix`, `auto`) sends those layers
alone: fewer bytes, the rest being what the agent had from its neighbours anyway. Receivers
take such a model in whole layers only, aggregate each layer over those who sent it, and
screen each part against models of the same part."""

from __future__ import annotations

import dataclasses

import torch

from agent.learning import robust, robust_rules
from agent.learning.config import preset
from agent.learning.learner import AgentState, Learner, LocalData, Published, combine
from agent.learning.models import build_model, prunable_names
from agent.learning.reduction import NO_REDUCTION, Reduction
from agent.runtime import Expected, Inbox, expected_shapes, model_message
from agent.runtime.codec import encode_state
from protocol import topics

FLEET, RUN = "lab", "run-1"


def learner_for(reduce: str, wire: str = "full") -> Learner:
    model = build_model("cnn2d", (1, 8, 8), 10, seed=1)
    config = preset("dfedavgm", reduce=reduce, wire=wire, epochs=1, batch_size=16)
    return Learner(model, (1, 8, 8), prunable_names(model), config, seed=1)


def data() -> LocalData:
    x, y = torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))
    return LocalData(x, y, x[:8], y[:8], x[:8], y[:8])


def round_with(learner: Learner, reduction: Reduction) -> Published:
    agent = learner.init_agent("a")
    return learner.local_round(agent, data(), {}, 1, False, reduction).published


def test_a_window_round_publishes_its_layers_alone() -> None:
    learner = learner_for("prefix")
    layers = learner.facts.forward_layers
    window = (len(layers) - 1, len(layers))
    published = round_with(learner, Reduction("prefix", window))
    assert set(published.weights) == set(layers[-1].tensors)
    whole = round_with(learner, NO_REDUCTION)
    assert set(whole.weights) == set(learner.facts.initial)
    assert len(encode_state(published.weights)) < 0.5 * len(encode_state(whole.weights))


def test_modes_that_send_deltas_or_layers_keep_whole_models() -> None:
    for learner in (learner_for("prune"), learner_for("prefix", wire="delta")):
        window = (0, 1)
        published = round_with(learner, Reduction("prefix", window))
        assert set(published.weights) == set(learner.facts.initial)


def test_a_part_counts_for_its_layers_and_is_screened_among_its_peers() -> None:
    """Ten layers of weights at zero; two neighbours sent whole models one away in each
    layer, three sent the last layer alone, one away. Over whole models' distances (3.16)
    and parts' (1.0) the median is a part's and the screen (3x it) would throw the whole
    models out; compared part with part, every model counts."""
    names = [f"l{i}.weight" for i in range(10)]
    own = AgentState("me", {n: torch.zeros(4) for n in names}, None, {})
    inbox = {j: Published({n: torch.full((4,), 0.5) for n in names}, None, 1) for j in ("a", "b")}
    inbox |= {j: Published({names[-1]: torch.full((4,), 0.5)}, None, 1) for j in "cde"}
    rule = robust_rules.parse_rule(robust_rules.SCREENED)
    out = combine(own, inbox, rule, robust_rules.CLIP_AUTO)
    assert torch.allclose(out[names[0]], torch.full((4,), 1.0 / 3))  # a, b and me
    assert torch.allclose(out[names[-1]], torch.full((4,), 2.5 / 6))  # all five and me
    # the whole-model screen this replaces: the whole models lost
    flat = robust.clip(
        own.weights, {j: p.weights for j, p in inbox.items()}, robust_rules.CLIP_AUTO
    ).models
    assert not torch.equal(flat["a"][names[0]], inbox["a"].weights[names[0]])


def window_inbox(learner: Learner) -> Inbox:
    layers = {layer.name: list(layer.tensors) for layer in learner.facts.forward_layers}
    expected = Expected(
        FLEET,
        RUN,
        frozenset({"a", "b"}),
        expected_shapes(learner.facts.initial),
        window_layers=layers,
    )
    return Inbox(expected)


def payload(weights: dict[str, torch.Tensor]) -> bytes:
    return model_message(
        fleet=FLEET, sender="b", run_id=RUN, round_=1, weights=weights, masks=None, num_samples=5
    )


def test_a_receiver_takes_a_model_in_whole_layers_only() -> None:
    learner = learner_for("prefix")
    last = learner.facts.forward_layers[-1]
    part = {name: learner.facts.initial[name] for name in last.tensors}
    box = window_inbox(learner)
    box.on_model(topics.round_topic(FLEET, 1, "model", "b"), payload(part))
    got = box.model(1, "b")
    assert got is not None and set(got.weights) == set(last.tensors)
    # half a layer (its weight without its bias) is refused
    box = window_inbox(learner)
    box.on_model(topics.round_topic(FLEET, 1, "model", "b"), payload(dict(list(part.items())[:1])))
    assert box.model(1, "b") is None and box.rejected == 1
    # and a run whose rounds train no windows takes whole models only, as before
    whole_only = Inbox(dataclasses.replace(window_inbox(learner).expected, window_layers=None))
    whole_only.on_model(topics.round_topic(FLEET, 1, "model", "b"), payload(part))
    assert whole_only.model(1, "b") is None and whole_only.rejected == 1


def test_the_wire_says_which_runs_send_windows() -> None:
    from agent.runtime.wire_full import FullWire

    assert FullWire.expects(learner_for("prune"), "a") == {}
    layers = FullWire.expects(learner_for("auto"), "a")["window_layers"]
    assert list(layers) == [layer.name for layer in learner_for("auto").facts.forward_layers]
