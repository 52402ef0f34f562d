"""`--wire layers`: FedLDF's divergence feedback between DA-DPFL neighbours.

Agents announce a divergence vector per round; each receiver picks, per layer, the `ldf_n`
neighbours that diverged most and fetches only those layers, which senders publish once for
everyone who asked at about the same time."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest
import torch

from agent.learning import Published, preset
from agent.runtime import Expected, Inbox, expected_shapes, model_message
from agent.runtime.layer_server import LayerServer, PublishLayers
from agent.runtime.wire_layers import LayersWire
from agent.workload import build_workload
from coordinator.simulate import ExperimentConfig, simulate
from protocol import MemoryBroker, MemoryTransport, messages, topics

FLEET, RUN = "lab", "run-1"


def small(agents: int = 6, **learning: object) -> ExperimentConfig:
    learning = {"rounds": 3, "neighbours": 3, "epochs": 1, **learning}
    return ExperimentConfig(
        dataset="mnist1d",
        agents=agents,
        partition="dirichlet:0.5",
        seed=3,
        learning=preset("dadpfl", **learning),
    )


@pytest.fixture(scope="module")
def learner():
    # the plain mean: the noisy neighbour below is one the default defence would screen out
    config = small(agents=4, wire="layers", aggregation="mean")
    return build_workload(config, ["a", "b", "c", "d"]).learner


def test_a_neighbour_counts_only_for_the_layers_it_sent(learner) -> None:
    me, a, b = (learner.init_agent(k) for k in "abc")
    torch.manual_seed(0)
    noisy = {n: t + torch.randn_like(t) for n, t in b.weights.items()}
    b_model = learner.published(b, 1)
    b_model = Published(noisy, b_model.masks, 1)
    a_model = learner.published(a, 1)
    layers = list(learner.facts.layer_groups)
    picked = layers[:2]
    partial = learner.aggregate(me, {"a": a_model, "b": learner.layer_part(b_model, picked)})
    with_b = learner.aggregate(me, {"a": a_model, "b": b_model})
    without_b = learner.aggregate(me, {"a": a_model})
    assert list(partial) == list(me.weights)
    for layer, names in learner.facts.layer_groups.items():
        want = with_b if layer in picked else without_b
        for name in names:
            assert torch.equal(partial[name], want[name]), name
    assert any(
        not torch.equal(with_b[n], without_b[n]) for n in learner.facts.layer_groups[picked[0]]
    )


def test_with_n_at_least_the_neighbours_every_layer_comes_and_learning_equals_full() -> None:
    full = simulate(small(rounds=4))
    layered = simulate(small(rounds=4, wire="layers", ldf_n=3))
    for f, g in zip(full["rounds"], layered["rounds"], strict=True):
        for k, agent in f["agents"].items():
            assert g["agents"][k]["accuracy"] == agent["accuracy"]
            assert g["agents"][k]["sparsity"] == agent["sparsity"]


def test_with_n_1_each_layer_comes_from_one_neighbour_at_a_fraction_of_the_bytes() -> None:
    full = simulate(small(agents=10, rounds=4))
    layered = simulate(small(agents=10, rounds=4, wire="layers", ldf_n=1))
    assert layered["summary"]["total_bytes"] < 0.5 * full["summary"]["total_bytes"]
    assert layered["summary"]["busiest_agent_bytes"] < 0.75 * full["summary"]["busiest_agent_bytes"]
    # a receiver gets about one neighbour's worth of layers, not M = 3 models
    for f, g in zip(full["rounds"][1:], layered["rounds"][1:], strict=True):
        received = sum(a["bytes_received"] for a in g["agents"].values())
        assert received < 0.5 * sum(a["bytes_received"] for a in f["agents"].values())
    assert layered["summary"]["mean_accuracy"] > 0.2


# ---------------------------------------------------------------------------- the inbox

GROUPS = {"conv": ["conv.weight", "conv.bias"], "fc": ["fc.weight"]}
WEIGHTS = {
    "conv.weight": torch.ones(2, 3),
    "conv.bias": torch.zeros(2),
    "fc.weight": torch.arange(4, dtype=torch.float32),
}


def inbox() -> Inbox:
    return Inbox(
        Expected(FLEET, RUN, frozenset({"a", "b"}), expected_shapes(WEIGHTS), layer_groups=GROUPS)
    )


def layer_payload(names: list[str], base_round: int = -1) -> bytes:
    return model_message(
        fleet=FLEET,
        sender="b",
        run_id=RUN,
        round_=2,
        weights={n: WEIGHTS[n] for n in names},
        masks=None,
        num_samples=7,
        base_round=base_round,
    )


def test_layers_are_stored_under_their_index_and_assembled() -> None:
    box = inbox()
    box.on_layer(topics.layer(FLEET, 2, "b", 1), layer_payload(["fc.weight"]))
    box.on_layer(topics.layer(FLEET, 2, "b", 0), layer_payload(["conv.weight", "conv.bias"]))
    assert box.rejected == 0
    part = box.layers_of(2, "b", ["fc"])
    assert part is not None and list(part.weights) == ["fc.weight"] and part.num_samples == 7
    both = box.layers_of(2, "b", ["conv", "fc"])
    assert both is not None and set(both.weights) == set(WEIGHTS)
    assert box.layers_of(2, "a", ["fc"]) is None
    assert box.wait_layers({(2, "b", "fc"), (2, "b", "conv")}, 0.0) == set()


@pytest.mark.parametrize(
    ("index", "names", "base_round"),
    [
        (0, ["fc.weight"], -1),  # another layer's tensors under this index
        (0, ["conv.weight"], -1),  # part of a layer
        (2, ["fc.weight"], -1),  # no such layer
        (1, ["fc.weight"], 1),  # a delta
    ],
)
def test_a_layer_that_does_not_match_its_index_is_rejected(index, names, base_round) -> None:
    box = inbox()
    box.on_layer(topics.layer(FLEET, 2, "b", index), layer_payload(names, base_round=base_round))
    assert box.rejected == 1
    assert box.layers_of(2, "b", list(GROUPS)) is None


def test_a_request_must_be_addressed_to_its_target() -> None:
    box = inbox()
    request = messages.Request(fleet=FLEET, sender="a", run_id=RUN, round=2, target="b")
    data = messages.encode(request)
    assert box.decode_request(topics.round_topic(FLEET, 2, "request", "a", to="a"), data) is None
    assert box.rejected == 1
    got = box.decode_request(topics.round_topic(FLEET, 2, "request", "a", to="b"), data)
    assert got is not None and got.target == "b"


def divergence_payload(layers: list[str], values: list[float]) -> bytes:
    message = messages.Divergence(
        fleet=FLEET, sender="b", run_id=RUN, round=2, layers=layers, values=values
    )
    return messages.encode(message)


def test_divergence_vectors_must_give_one_value_per_layer() -> None:
    box = inbox()
    topic = topics.round_topic(FLEET, 2, "divergence", "b")
    box.on_divergence(topic, divergence_payload(["fc"], [1.0]))
    box.on_divergence(topic, divergence_payload(["fc", "conv"], [1.0, -2.0]))
    assert box.rejected == 2 and box.divergence(2, "b") is None
    box.on_divergence(topic, divergence_payload(["fc", "conv"], [1.0, 2.0]))
    assert box.divergence(2, "b") == {"conv": 2.0, "fc": 1.0}
    assert list(box.divergence(2, "b") or {}) == ["conv", "fc"], "kept in the model's order"


@pytest.fixture
def transport() -> Iterator[MemoryTransport]:
    """Fetching layers subscribes to their topics: subscriptions that take at once."""
    with MemoryTransport(MemoryBroker(), "a") as transport:
        yield transport


class RecordingFetcher:
    """A round driver that records the layer requests it is told to send."""

    def __init__(self) -> None:
        self.requests: list[tuple[set[tuple[int, str]], list[str] | None]] = []

    def request(self, missing: set[tuple[int, str]], layers: list[str] | None = None) -> None:
        self.requests.append((missing, layers))


def test_a_sender_that_announces_again_is_asked_again_for_its_layers_at_once(
    transport: MemoryTransport,
) -> None:
    """A request sent to a peer while it was down is lost; the peer, back from its restart,
    announces its recent rounds again, which tells its askers to ask again (not 4 request
    intervals later, as their last resort)."""
    box = inbox()
    topic = topics.round_topic(FLEET, 2, "divergence", "b")
    box.on_divergence(topic, divergence_payload(["conv", "fc"], [1.0, 2.0]))
    session = SimpleNamespace(
        inbox=box,
        learner=SimpleNamespace(facts=SimpleNamespace(layer_groups=GROUPS)),
        transport=transport,
        timeouts=SimpleNamespace(request_every_s=30.0),
        stop=threading.Event(),
    )
    wire = LayersWire(session)  # type: ignore[arg-type]
    fetcher = RecordingFetcher()
    fetching = {(2, "b", "fc"): topics.layer(FLEET, 2, "b", 1)}
    result: list[set[tuple[int, str, str]]] = []
    thread = threading.Thread(
        target=lambda: result.append(
            wire._fetch_layers(fetching, time.monotonic() + 20, fetcher)  # type: ignore[arg-type]
        )
    )
    thread.start()
    try:
        wait_until(lambda: len(fetcher.requests) == 1)
        time.sleep(0.6)  # more than a look of the inbox's wait: no ask while b stays silent
        assert len(fetcher.requests) == 1
        box.on_divergence(topic, divergence_payload(["conv", "fc"], [1.0, 2.0]))  # b is back
        wait_until(lambda: len(fetcher.requests) == 2)
        assert fetcher.requests[1] == ({(2, "b")}, ["fc"])
        box.on_layer(topics.layer(FLEET, 2, "b", 1), layer_payload(["fc.weight"]))
        thread.join(5)
        assert result == [set()], "the layer came: nothing missing"
        assert len(fetcher.requests) == 2
    finally:
        session.stop.set()
        thread.join(5)


def wait_until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# ---------------------------------------------------------------------------- the sender


def recording_publisher(
    retained: frozenset[str] = frozenset(),
) -> tuple[list[tuple[int, set[str]]], threading.Semaphore, PublishLayers]:
    """A LayerServer publisher that records its batches and retains `retained`; the
    semaphore is released once a batch is published and recorded."""
    published: list[tuple[int, set[str]]] = []
    calls = threading.Semaphore(0)

    def publish(round_: int, layers: set[str]) -> Iterator[tuple[str, int, bool]]:
        published.append((round_, set(layers)))
        for layer in sorted(layers):
            yield layer, 10, layer in retained
        calls.release()  # runs when the server asks for more: after it recorded the last

    return published, calls, publish


def served(server: LayerServer, at_least: int) -> int:
    total, deadline = 0, time.monotonic() + 5
    while total < at_least and time.monotonic() < deadline:
        total += server.take_served()
        time.sleep(0.01)
    return total


def test_requests_within_a_batch_share_one_publish_and_later_ones_get_another() -> None:
    published, calls, publish = recording_publisher()
    server = LayerServer(publish, delay_s=0.2)
    server.ask(3, ["conv"], "a")
    server.ask(3, ["fc", "conv"], "b")
    server.ask(2, ["fc"], "a")
    assert calls.acquire(timeout=5) and calls.acquire(timeout=5)
    assert published == [(2, {"fc"}), (3, {"conv", "fc"})]
    assert served(server, 30) == 30 and server.take_served() == 0
    server.ask(3, ["conv"], "c")
    assert calls.acquire(timeout=5)
    assert published[-1] == (3, {"conv"}), "not retained: a later asker gets a new publish"
    server.close()
    server.ask(3, ["fc"], "d")
    assert not calls.acquire(timeout=0.5), "a closed server publishes nothing"


def test_a_retained_layer_is_published_once_a_round_unless_an_asker_missed_it() -> None:
    published, calls, publish = recording_publisher(retained=frozenset({"conv"}))
    server = LayerServer(publish, delay_s=0.05)
    server.ask(3, ["conv", "fc"], "a")
    assert calls.acquire(timeout=5)
    server.ask(3, ["conv"], "b")  # gets the broker's retained copy when it subscribes
    server.ask(3, ["fc", "conv"], "c")
    assert calls.acquire(timeout=5)
    assert published == [(3, {"conv", "fc"}), (3, {"fc"})]
    server.ask(3, ["conv"], "b")  # b asks again: it missed the retained copy
    assert calls.acquire(timeout=5)
    assert published[-1] == (3, {"conv"})
    server.reconnected()  # the broker may have lost it: a new asker gets a publish
    server.ask(3, ["conv"], "d")
    assert calls.acquire(timeout=5)
    assert published[-1] == (3, {"conv"})
    assert server.forget(3) == {"conv"}, "what the broker retains, for the sender to clear"
    server.may_retain(5, ["fc"])  # restored after a restart: cleared, never trusted
    server.ask(5, ["fc"], "a")
    assert calls.acquire(timeout=5)
    assert published[-1] == (5, {"fc"})
    assert server.close() == {5: {"fc"}}


def test_forget_and_close_wait_for_a_batch_being_published() -> None:
    """A layer published while the sender forgets its round, or closes, is still reported
    for clearing: nothing stays retained on the broker unaccounted for."""
    started, release = threading.Event(), threading.Event()

    def slow_publish(round_: int, layers: set[str]) -> Iterator[tuple[str, int, bool]]:
        for layer in sorted(layers):
            started.set()
            release.wait(5)
            yield layer, 10, True

    for end in ("forget", "close"):
        started.clear()
        release.clear()
        server = LayerServer(slow_publish, delay_s=0.01)
        server.ask(3, ["conv"], "a")
        assert started.wait(5)
        threading.Timer(0.2, release.set).start()
        if end == "forget":
            assert server.forget(3) == {"conv"}
        else:
            assert server.close() == {3: {"conv"}}


def test_requests_are_addressed_and_layers_have_their_own_topics() -> None:
    request = topics.round_topic(FLEET, 4, "request", "a", to="b")
    assert request == "fl/v1/lab/round/4/request/a/b"
    assert topics.parse(request) == ("lab", "request", {"round": "4", "agent": "a", "to": "b"})
    assert topics.parse(topics.layer(FLEET, 4, "b", 12))[2] == {
        "round": "4",
        "agent": "b",
        "layer": "12",
    }
    resend = topics.round_topic(FLEET, 4, "resend", "b", to="a")
    assert topics.parse(resend) == ("lab", "resend", {"round": "4", "agent": "b", "to": "a"})
    with pytest.raises(ValueError, match="only they are addressed"):
        topics.round_topic(FLEET, 4, "model", "a", to="b")
    with pytest.raises(ValueError, match="only they are addressed"):
        topics.round_topic(FLEET, 4, "resend", "a")
