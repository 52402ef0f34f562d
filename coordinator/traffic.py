"""The simulator's byte accounting: what each wire format puts on every link, and what the
receivers decode from it.

`coordinator.simulate` runs the algorithm; at each point where a networked agent would send
or receive, it calls the run's traffic model, which charges the size of the real encoded
message to the sender's and receivers' `Traffic` for the round. One model per wire format:
`FullWire` (whole sparse models), `DeltaWire` (deltas on what everyone holds), `LayersWire`
(divergence vectors, then the requested layers), `LocalWire` (nothing but votes) and
`CentralTraffic` (a coordinator's downloads, uploads and broadcast). A model is published once
per round whatever the number of its receivers; each vote goes to the keeper, and every agent
receives the round's tally (`coordinator.tallies`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from agent.learning import (
    Aggregate,
    Fit,
    Learner,
    Payload,
    Published,
    RoundResult,
    RoundTopology,
    StrategyConfig,
    Upload,
    as_sent,
    delta,
    layers_to_fetch,
    running,
)
from agent.report import COORDINATOR, Traffic
from agent.runtime import divergence_message, encode_state, model_message, values_sent
from protocol import fits_one_frame, messages

FLEET = "sim"
KEEPER = "coordinator"
"""Who publishes the tallies in a networked run (`coordinator.tallies`)."""
"""The fleet name in the simulator's messages (their size depends on it)."""
RUN_ID = "sim"
Models = dict[str, Published]
"""Models by sender: an inbox."""


def as_received(published: Published, fp16: bool) -> Published:
    """A model as its receivers decode it: `as_sent`'s rounding (fp16 on the wire), and the
    very same object without fp16."""
    if not fp16:
        return published
    rounded = as_sent(Payload(published.weights), fp16).weights
    return Published(rounded, published.masks, published.num_samples)


def message_size(
    round_: int, sender: str, published: Published, fp16: bool, base_round: int = -1
) -> tuple[int, int]:
    """(encoded bytes, nonzeros) of the Model message carrying `published`."""
    data = model_message(
        fleet=FLEET,
        sender=sender,
        run_id=RUN_ID,
        round_=round_,
        weights=published.weights,
        masks=published.masks,
        num_samples=published.num_samples,
        fp16=fp16,
        base_round=base_round,
    )
    return len(data), values_sent(published.weights, published.masks)


def divergence_size(round_: int, sender: str, divergence: dict[str, float]) -> int:
    """Bytes of the message announcing a divergence vector."""
    message = divergence_message(
        fleet=FLEET, sender=sender, run_id=RUN_ID, round_=round_, divergence=divergence
    )
    return len(message)


class LocalWire:
    """`--strategy local`: no models on the wire; the base of the decentralized wires.

    A round goes `begin`, then per agent in reuse order `receive` (its inbox as it arrives:
    the neighbours that stopped early left out) and `publish` (what its receivers will
    hold), or `sat_out` for one that stopped early, then `votes` and `end`. `stopped` is the
    simulator's live record of early stops."""

    def __init__(self, roster: Sequence[str], stopped: Mapping[str, int], fp16: bool) -> None:
        self.roster = list(roster)
        self.stopped = stopped
        self.fp16 = fp16
        self.traffic: dict[str, Traffic] = {}

    def begin(self, round_: int) -> None:
        self.traffic = {k: Traffic() for k in self.roster}

    def sat_out(self, agent: str) -> None:
        """`agent` stopped early: it publishes nothing more."""

    def receive(self, agent: str, topology: RoundTopology, inbox: Models) -> Models:
        """The inbox `agent` aggregates in `topology`'s round (this round's models of its
        prior neighbours, last round's of the others) as the wire delivers it."""
        return inbox

    def publish(
        self, agent: str, round_: int, result: RoundResult, previous: Published
    ) -> Published:
        """The model `agent`'s receivers hold after its round (`previous`: before it)."""
        return as_received(result.published, self.fp16)

    def votes(self, voters: list[str]) -> None:
        """Every voter sends its vote to the keeper and receives the round's tally (what it
        costs the agents, not the coordinator)."""
        vote = messages.Vote(fleet=FLEET, sender=self.roster[0], vote=True, score=0.0)
        everyone = messages.bitmap(self.roster, self.roster)
        tally = messages.Tally(
            fleet=FLEET, sender=FLEET, done=everyone, voted=everyone, yes=everyone
        )
        vote_size, tally_size = len(messages.encode(vote)), len(messages.encode(tally))
        for k in voters:  # an agent that stopped early neither votes nor settles tallies
            self.traffic[k].sent += vote_size
            self.traffic[k].received += tally_size

    def end(self, round_: int) -> dict[str, Traffic]:
        """The round's traffic per agent."""
        return self.traffic


class ModelWire(LocalWire):
    """The base of the wires that publish a model message per agent and round (`size`: its
    bytes this round; an agent that stopped early publishes none)."""

    def __init__(self, roster: Sequence[str], stopped: Mapping[str, int], fp16: bool) -> None:
        super().__init__(roster, stopped, fp16)
        self.size: dict[str, int] = {}

    def begin(self, round_: int) -> None:
        super().begin(round_)
        self.size = {}

    def sat_out(self, agent: str) -> None:
        self.size[agent] = 0

    def _send(self, agent: str, round_: int, model: Published, base_round: int = -1) -> None:
        """Charge `agent`'s publish of the Model message carrying `model`, once for all."""
        self.size[agent], nonzeros = message_size(round_, agent, model, self.fp16, base_round)
        self.traffic[agent].sent += self.size[agent]
        self.traffic[agent].nonzeros_sent += nonzeros


class FullWire(ModelWire):
    """`--wire full`: each agent publishes its whole sparse model once a round; a receiver
    takes this round's from its prior neighbours and last round's from the others.

    A receiver is charged a model message once: a neighbour's round-t model that it took
    in round t (a prior neighbour) and uses again in round t + 1 (a posterior one there)
    came in once, as a networked agent, subscribed to that model's topic for both rounds,
    receives it once."""

    def __init__(self, roster: Sequence[str], stopped: Mapping[str, int], fp16: bool) -> None:
        super().__init__(roster, stopped, fp16)
        self.previous_size = dict.fromkeys(self.roster, 0)  # round-0 models: never sent
        self.held: set[tuple[str, str]] = set()
        """(receiver, sender) of this round's models delivered: held for the next round."""
        self.previous_held: set[tuple[str, str]] = set()

    def begin(self, round_: int) -> None:
        super().begin(round_)
        self.held = set()

    def receive(self, agent: str, topology: RoundTopology, inbox: Models) -> Models:
        prior, _ = topology.prior_posterior(agent)
        for j in inbox:
            if j in prior:
                self.held.add((agent, j))
                self.traffic[agent].received += self.size[j]
            elif (agent, j) not in self.previous_held:
                self.traffic[agent].received += self.previous_size[j]
        return inbox

    def publish(
        self, agent: str, round_: int, result: RoundResult, previous: Published
    ) -> Published:
        self._send(agent, round_, result.published)
        return as_received(result.published, self.fp16)

    def end(self, round_: int) -> dict[str, Traffic]:
        self.previous_size, self.previous_held = self.size, self.held
        return self.traffic


class DeltaWire(ModelWire):
    """`--wire delta`: each agent sends, to everyone, a delta on what everyone holds of it
    (its reconstruction, which is what its receivers then hold); every running agent follows
    every peer."""

    def __init__(
        self, roster: Sequence[str], stopped: Mapping[str, int], fp16: bool, fraction: float
    ) -> None:
        super().__init__(roster, stopped, fp16)
        self.fraction = fraction

    def publish(
        self, agent: str, round_: int, result: RoundResult, previous: Published
    ) -> Published:
        values, value_masks, held = delta.encode_delta(
            result.published, previous, self.fraction, fp16=self.fp16
        )
        sent = Published(values, value_masks, result.published.num_samples)
        self._send(agent, round_, sent, base_round=round_ - 1)
        return held

    def end(self, round_: int) -> dict[str, Traffic]:
        for k in self.roster:
            if running(k, round_, self.stopped):
                self.traffic[k].received += sum(self.size[j] for j in self.roster if j != k)
        return self.traffic


@dataclass(frozen=True)
class Announced:
    """A divergence vector an agent published (`--wire layers`): its round, values, size."""

    round: int
    values: dict[str, float]
    size: int


class LayersWire(LocalWire):
    """`--wire layers`: agents announce divergence vectors; a receiver picks per layer the
    `ldf_n` most diverged neighbours and fetches those layers from them.

    A layer that fits one frame goes out once, retained, for all who ask in any round
    (`retained`); a bigger one once per round for all who ask (`published`: agents batch
    requests, so in emulate a neighbour asking much later costs another publish). A receiver
    never fetches a layer it `held`. Whether a layer fits one frame is judged on the
    simulator's unsigned message; an agent's header (run id, signature) is a few dozen bytes
    longer."""

    def __init__(
        self,
        roster: Sequence[str],
        stopped: Mapping[str, int],
        fp16: bool,
        learner: Learner,
        ldf_n: int,
    ) -> None:
        super().__init__(roster, stopped, fp16)
        self.learner = learner
        self.ldf_n = ldf_n
        self.divergence: dict[str, Announced] = {}
        self.previous_divergence: dict[str, Announced] = {}
        self.held: set[tuple[str, str, int, str]] = set()
        """(receiver, sender, round, layer) delivered."""
        self.retained: set[tuple[str, int, str]] = set()
        """(sender, round, layer) published retained: the broker hands it to every asker."""
        self.published: set[tuple[str, int, str]] = set()
        """(sender, round, layer) published this round, not retained (too big for a frame)."""

    def begin(self, round_: int) -> None:
        super().begin(round_)
        self.divergence, self.published = {}, set()

    def receive(self, agent: str, topology: RoundTopology, inbox: Models) -> Models:
        """`agent` receives its neighbours' divergence vectors (round-0 models are derivable
        and taken whole), and asks each for the layers it picked; each neighbour's vector is
        the one for the round `agent` needs."""
        prior, posterior = topology.prior_posterior(agent)
        t = topology.round
        announced = {j: self.divergence[j] for j in prior if j in inbox}  # round 0: derivable
        if t > 1:
            announced |= {j: self.previous_divergence[j] for j in posterior if j in inbox}
        for a in announced.values():
            self.traffic[agent].received += a.size
        vectors = {j: a.values for j, a in announced.items()}
        chosen = layers_to_fetch(vectors, self.ldf_n)
        received = {j: m for j, m in inbox.items() if j not in announced}
        for j, layers in chosen.items():
            if layers:
                r = announced[j].round
                received[j] = self.learner.layer_part(inbox[j], layers)
                self._fetch(agent, j, r, inbox[j], layers)
        return received

    def _fetch(
        self, agent: str, sender: str, round_: int, model: Published, layers: list[str]
    ) -> None:
        """Charge `agent`'s request to `sender` and the layers of its round-`round_` model
        that `agent` does not hold yet."""
        fetch = [layer for layer in layers if (agent, sender, round_, layer) not in self.held]
        if not fetch:
            return
        ask = messages.Request(
            fleet=FLEET, sender=agent, run_id=RUN_ID, round=round_, target=sender, layers=fetch
        )
        request = len(messages.encode(ask))
        self.traffic[agent].sent += request
        self.traffic[sender].received += request
        for layer in fetch:
            part = self.learner.layer_part(model, [layer])
            size, values = message_size(round_, sender, part, self.fp16)
            self.held.add((agent, sender, round_, layer))
            self.traffic[agent].received += size
            served = self.retained if fits_one_frame(size) else self.published
            if (sender, round_, layer) not in served:
                served.add((sender, round_, layer))
                self.traffic[sender].sent += size
                self.traffic[sender].nonzeros_sent += values

    def publish(
        self, agent: str, round_: int, result: RoundResult, previous: Published
    ) -> Published:
        """Announce `agent`'s round divergence vector, once for all; its layers go out when
        asked for."""
        assert result.divergence is not None
        size = divergence_size(round_, agent, result.divergence)
        self.traffic[agent].sent += size
        self.divergence[agent] = Announced(round_, result.divergence, size)
        return as_received(result.published, self.fp16)

    def end(self, round_: int) -> dict[str, Traffic]:
        self.previous_divergence = self.divergence
        return self.traffic


def wire_traffic(
    cfg: StrategyConfig, roster: Sequence[str], stopped: Mapping[str, int], learner: Learner
) -> LocalWire:
    """The traffic model of a decentralized run's wire format."""
    if learner.traits.alone:
        return LocalWire(roster, stopped, cfg.fp16)
    if cfg.wire == "delta":
        return DeltaWire(roster, stopped, cfg.fp16, cfg.delta_fraction)
    if cfg.wire == "layers":
        return LayersWire(roster, stopped, cfg.fp16, learner, cfg.ldf_n)
    return FullWire(roster, stopped, cfg.fp16)


class CentralTraffic:
    """A centralized round's messages: requests and downloads, uploads (FedLDF: divergence
    vectors, the coordinator's requests, the selected layers), one broadcast."""

    def __init__(self, roster: Sequence[str], fp16: bool) -> None:
        self.roster = list(roster)
        self.fp16 = fp16

    def _payload_size(
        self, kind: type[messages.Message], round_: int, sender: str, payload: Payload
    ) -> int:
        body = encode_state(payload.weights, payload.masks, fp16=self.fp16)
        if kind is messages.Global:
            message: messages.Message = messages.Global(
                fleet=FLEET, sender=sender, run_id=RUN_ID, round=round_, tensors=body
            )
        else:
            message = messages.Update(
                fleet=FLEET, sender=sender, run_id=RUN_ID, round=round_, tensors=body, num_samples=1
            )
        return len(messages.encode(message))

    def round(
        self,
        round_: int,
        fits: dict[str, Fit],
        uploads: dict[str, Upload],
        downloads: dict[str, Payload],
        requests: dict[str, list[str]],
        aggregate: Aggregate,
    ) -> dict[str, Traffic]:
        """Every node's traffic in round `round_` (agents that did not take part: none)."""
        traffic = {k: Traffic() for k in [*self.roster, COORDINATOR]}
        coordinator = traffic[COORDINATOR]
        broadcast = 0
        if aggregate.broadcast.weights:
            payload = aggregate.broadcast
            broadcast = self._payload_size(messages.Global, round_, COORDINATOR, payload)
            coordinator.sent += broadcast
            coordinator.nonzeros_sent += values_sent(payload.weights, payload.masks)
        for k, fit in fits.items():
            up = self._upload(round_, k, fit, uploads[k], k in downloads, traffic)
            down = broadcast + self._download(round_, k, downloads, requests, coordinator)
            traffic[k].sent += up
            traffic[k].received += down
            coordinator.received += up
        return traffic

    def _upload(
        self,
        round_: int,
        k: str,
        fit: Fit,
        upload: Upload,
        downloads: bool,
        traffic: dict[str, Traffic],
    ) -> int:
        """Bytes participant k sends: its update, divergence vector, download request."""
        up = 0
        sent = upload.payload
        if sent.weights:
            up += self._payload_size(messages.Update, round_, k, sent)
            traffic[k].nonzeros_sent += values_sent(sent.weights, sent.masks)
        if fit.divergence is not None:
            up += divergence_size(round_, k, fit.divergence)
        if downloads:
            asked = messages.Request(
                fleet=FLEET, run_id=RUN_ID, round=round_, sender=k, target=COORDINATOR, fraction=1.0
            )
            up += len(messages.encode(asked))
        return up

    def _download(
        self,
        round_: int,
        k: str,
        downloads: dict[str, Payload],
        requests: dict[str, list[str]],
        coordinator: Traffic,
    ) -> int:
        """Bytes participant k receives besides the broadcast: its download and the
        coordinator's layer request."""
        down = 0
        if k in downloads:
            size = self._payload_size(messages.Global, round_, COORDINATOR, downloads[k])
            down += size
            coordinator.sent += size
            coordinator.nonzeros_sent += values_sent(downloads[k].weights, downloads[k].masks)
        if k in requests:
            request = messages.Request(
                fleet=FLEET,
                run_id=RUN_ID,
                round=round_,
                sender=COORDINATOR,
                target=k,
                layers=requests[k],
            )
            size = len(messages.encode(request))
            down += size
            coordinator.sent += size
        return down
