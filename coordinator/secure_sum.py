"""The aggregator's secure-aggregation steps of a centralized round (`--secure-aggregation`):
the messages and waits around `protocol.secagg.Server`, so that the coordinator learns the
round's weighted sum and no participant's model. `coordinator.aggregator` takes the round's
uploads from here instead of its `Update`s. Round t (the agents' side:
`agent.runtime.secure_rounds`):

    keys       collect the participants' `Keys` (U1: who advertised); publish the `KeyList`
    shares     collect each member's encrypted `Shares` (U2: who shared with its whole
               neighbourhood in the round's SecAgg+ graph, `protocol.secagg.round_graph`);
               relay to each member of U1 the shares its neighbours addressed to it
    agree      the round's index set, before anyone masks (`agent.learning.central.secure`):
               FedLDF collects the sharers' divergence vectors and asks each sharer for its
               layers (an empty ask included); FedAdam-Top and -SSM collect the sharers'
               `Support`s and publish their union, the entries every vector covers
    masked     collect the `Masked` vectors (U3: who uploaded); publish the `Survivors`
    check      collect the survivors' signatures on U3 (`Consent`); publish those collected
               in one `Consent` (each survivor reveals only if t of its neighbours and 70%
               of U1 signed the U3 it was sent, `protocol.secagg.Client.reveal`)
    unmask     collect the signers' `Reveal`s; the sum of U3, unmasked, becomes the
               round's one upload (`agent.learning.central.secure`)

Each wait ends when every member still expected delivered (one whose presence says it is
offline, or that stopped early, is not waited for), or a round timeout after the first
delivery (keys, shares) or after the step began (masked, consent, reveal). A round whose
cohort shrank below the threshold, or whose unmasking failed, has no upload: the server
keeps its model.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from agent.learning import CentralStrategy, Learner, ServerState, Upload
from agent.learning.central import secure_dp
from agent.learning.central.base import Payload
from agent.learning.central.secure import (
    SUM,
    chooses_entries,
    from_support,
    layer_parts,
    round_upload,
    union,
    vector_length,
)
from agent.learning.config import StrategyConfig
from protocol import ProtocolError, Transport, messages, secagg, topics
from protocol.limits import DEFAULT_LIMITS
from protocol.masks import pack_mask, unpack_mask
from protocol.signing import Signer

log = logging.getLogger(__name__)

KINDS = {
    "keys": messages.Keys,
    "shares": messages.Shares,
    "support": messages.Support,
    "masked": messages.Masked,
    "consent": messages.Consent,
    "reveal": messages.Reveal,
}
"""What a participant sends, by topic kind."""


class Intake(Protocol):
    """What the secure steps use of the aggregator's handlers (`coordinator.aggregator`)."""

    fleet: str
    me: str
    changed: threading.Condition
    offline: set[str]
    asks: dict[tuple[int, str], tuple[int, float]]
    divergences: dict[tuple[int, str], dict[str, float]]

    def decode(self, topic: str, payload: bytes, kind: str) -> Any: ...

    def reject(self, kind: str, sender: str, topic: str, reason: object) -> None: ...


class Aggregator(Protocol):
    """What the secure steps use of the aggregator (`coordinator.aggregator.Aggregator`)."""

    fleet: str
    run_id: str
    me: str
    key: Signer | None
    learner: Learner
    strategy: CentralStrategy
    server: ServerState
    stop: threading.Event
    round_timeout_s: float
    secure_intake: SecureIntake | None

    @property
    def intake(self) -> Intake: ...

    def header(self, round_: int) -> dict[str, Any]: ...

    def publish(self, round_: int, topic: str, data: bytes, nonzeros: int = 0) -> None: ...

    def expected(self, round_: int, candidates: list[str]) -> list[str]: ...

    def answer_downloads(self, round_: int) -> None: ...

    def ask_layers(self, round_: int, requests: Mapping[str, list[str]]) -> None: ...


def noised_sum_check(config: StrategyConfig, round_: int, members: int, survivors: int) -> None:
    """Under `--dp client`: SecAggError (no unmasking) when the survivors' noise shares fall
    short of what the accountant counts (`secure_dp.survivors_floor`), else the noise
    multiplier the sum holds, in the log."""
    if not secure_dp.distributed(config):
        return
    floor = secure_dp.survivors_floor(members)
    if survivors < floor:
        raise secagg.SecAggError(
            f"{survivors} of {members} uploaded; the noise is sized for at least {floor}"
        )
    sigma = secure_dp.effective_noise(config.dp_noise, members, survivors)
    log.info("round %d: the secure sum holds noise multiplier %.3g", round_, sigma)


class SecureIntake:
    """The aggregator's handlers for secure aggregation: validated and stored by round and
    sender under the `Intake`'s lock, as its own handlers store updates."""

    def __init__(self, intake: Intake) -> None:
        self.intake = intake
        self.stores: dict[str, dict[tuple[int, str], Any]] = {kind: {} for kind in KINDS}
        self.signed_keys: dict[tuple[int, str], bytes] = {}
        """Each `Keys` message as it arrived, signature and all."""

    def subscribe(self, transport: Transport) -> None:
        fleet = self.intake.fleet
        for kind in KINDS:
            to = self.intake.me if kind in topics.ADDRESSED_KINDS else None
            topic = topics.round_topic(fleet, "+", kind, to=to)
            transport.subscribe(topic, functools.partial(self._on_message, kind))

    def _on_message(self, kind: str, topic: str, payload: bytes) -> None:
        message: messages.Message | None = self.intake.decode(topic, payload, kind)
        if message is None or not isinstance(message, KINDS[kind]):
            return
        if isinstance(message, messages.Keys):
            problem = DEFAULT_LIMITS.samples_problem(message.num_samples)
            if problem is not None:
                self.intake.reject(kind, message.sender, topic, problem)
                return
        key = (message.round, message.sender)
        with self.intake.changed:
            self.stores[kind].setdefault(key, message)
            if isinstance(message, messages.Keys):  # the key list carries it as signed
                self.signed_keys.setdefault(key, payload)
            self.intake.changed.notify_all()

    def close_round(self, round_: int) -> None:
        """Forget what earlier rounds left behind (under the intake's lock)."""
        for store in [*self.stores.values(), self.signed_keys]:
            for key in [k for k in store if k[0] < round_]:
                del store[key]


class SecureRound:
    """One round's secure sum, over the aggregator's transport."""

    def __init__(self, aggregator: Aggregator, round_: int, candidates: list[str]) -> None:
        self.aggregator, self.round, self.candidates = aggregator, round_, candidates
        assert aggregator.secure_intake is not None
        self.intake = aggregator.secure_intake
        self.stores = self.intake.stores
        self.context = secagg.Context(aggregator.run_id, round_)
        self.asked: dict[str, list[str]] | None = None
        """(FedLDF) The layers asked of each sharer, once agreed (`_agree`)."""

    def gather(self) -> tuple[list[str], dict[str, Upload]]:
        """The survivors whose vectors the sum holds, and the round's one upload (none if the
        round could not complete)."""
        try:
            return self._steps()
        except secagg.SecAggError as exc:
            log.warning("round %d: no secure sum: %s", self.round, exc)
            return [], {}

    def _steps(self) -> tuple[list[str], dict[str, Upload]]:
        agg = self.aggregator
        u3, adverts, mean = self.unmasked()
        weights = {k: adverts[k].weight for k in u3}
        parts = self._parts(u3, self.asked)
        upload = round_upload(agg.strategy, agg.learner.facts, agg.server, mean, weights, parts)
        return u3, {SUM: upload}

    def unmasked(self) -> tuple[list[str], dict[str, secagg.Advert], np.ndarray]:
        """The round's steps up to the unmasked sum: the survivors U3, the adverts of U1 and
        the survivors' weighted mean vector over the whole model (`protocol.secagg.
        survivor_mean`, spread from the agreed support where there is one); SecAggError
        when the round cannot complete. FedBuff's cohorts (`coordinator.buffered_secure`)
        take their version from it."""
        agg, round_ = self.aggregator, self.round
        advertised = self._collect("keys", self.candidates, asked=False)
        keys = {k: self.stores["keys"][(round_, k)] for k in advertised}
        adverts = {
            k: secagg.Advert(m.cipher_key, m.mask_key, m.num_samples, m.sign_key)
            for k, m in keys.items()
        }
        server = secagg.Server(self.context, adverts)
        signed = [self.intake.signed_keys[(round_, k)] for k in advertised]
        listed = messages.KeyList(**agg.header(round_), keys=signed)
        self._publish("keylist", listed)
        log.debug("round %d: key list of %d sent", round_, len(advertised))
        shared = self._collect("shares", advertised, asked=False)
        sent = {k: self._shares_of(k) for k in shared}
        for member, sealed in server.relay(sent).items():
            relay = messages.Shares(
                **agg.header(round_),
                target=member,
                peers=list(sealed),
                sealed=list(sealed.values()),
            )
            self._publish("shares", relay, to=member)
        log.debug("round %d: shares of %d relayed", round_, len(server.sharers))
        asked, support = self._agree(server.sharers)
        self.asked = asked
        length = vector_length(agg.strategy, agg.learner.facts)
        if support is not None:
            length = int(support.sum())
        # the shares come while the devices train: the first message after training has its
        # timeout run from the first delivery, as a plain round's uploads do
        after_agreeing = asked is not None or support is not None
        uploaded = self._collect("masked", server.sharers, asked=after_agreeing)
        masked = {k: v for k in uploaded if (v := self._vector(k, length)) is not None}
        noised_sum_check(agg.learner.facts.config, round_, len(advertised), len(masked))
        self._publish(
            "survivors", messages.Survivors(**agg.header(round_), survivors=sorted(masked))
        )
        log.debug("round %d: %d masked changes in, survivors sent", round_, len(masked))
        signers = self._check(sorted(masked), len(advertised))
        revealed = self._collect("reveal", signers, asked=True)
        reveals = {k: self._reveal_of(k) for k in revealed}
        total, u3 = server.unmask(masked, reveals)
        log.debug("round %d: the sum of %d unmasked", round_, len(u3))
        mean = from_support(secagg.survivor_mean(total, adverts, u3), support)
        return u3, adverts, mean

    def _agree(self, sharers: list[str]) -> tuple[dict[str, list[str]] | None, np.ndarray | None]:
        """The round's index set, agreed before masking: (FedLDF) the layers asked of each
        sharer, (FedAdam-Top, -SSM) the union of the sharers' supports; None where the
        strategy has none."""
        agg = self.aggregator
        if agg.strategy.asks_layers:
            return self._ask_layers(sharers), None
        if chooses_entries(agg.strategy):
            return None, self._union(sharers)
        return None, None

    def _ask_layers(self, sharers: list[str]) -> dict[str, list[str]]:
        """(FedLDF) The sharers' divergence vectors in; each sharer asked for the layers it
        is among the most divergent of (`CentralStrategy.select`), for none where it is not."""
        agg = self.aggregator
        store = agg.intake.divergences
        sent = self._collect("divergence", sharers, asked=False, store=store)
        divergences = {k: store[(self.round, k)] for k in sent}
        selected = agg.strategy.select(agg.learner.facts, divergences) if divergences else {}
        asked = {k: selected.get(k, []) for k in sharers}
        agg.ask_layers(self.round, asked)
        log.debug("round %d: %d sharers asked for layers", self.round, len(asked))
        return asked

    def _union(self, sharers: list[str]) -> np.ndarray:
        """(FedAdam-Top, -SSM) The sharers' supports in; their union published. SecAggError
        when none came."""
        agg = self.aggregator
        length = vector_length(agg.strategy, agg.learner.facts)
        supports = {}
        for k in self._collect("support", sharers, asked=False):
            try:
                supports[k] = unpack_mask(self.stores["support"][(self.round, k)].mask, length)
            except ProtocolError as exc:
                agg.intake.reject("support", k, "", exc)
        if not supports:
            raise secagg.SecAggError("no sharer said which entries it uploads")
        agreed = union(supports, length)
        self._publish("support", messages.Support(**agg.header(self.round), mask=pack_mask(agreed)))
        log.debug("round %d: union of %d supports sent", self.round, len(supports))
        return agreed

    def _check(self, survivors: list[str], members: int) -> list[str]:
        """The consistency check: the survivors' signatures on their list collected and
        forwarded to all of them; who signed (they alone may reveal). SecAggError, with no
        wait for reveals that will not come, when fewer than the quorum of the round's
        `members` signed (`protocol.secagg.quorum`)."""
        signed = self._collect("consent", survivors, asked=True)
        consents = {k: self.stores["consent"][(self.round, k)] for k in signed}
        own = {k: m.signatures[0] for k, m in consents.items() if m.signers == [k]}
        if len(own) < secagg.quorum(members):
            raise secagg.SecAggError(
                f"{len(own)} members signed the survivors; revealing needs {secagg.quorum(members)}"
            )
        agg = self.aggregator
        forward = messages.Consent(
            **agg.header(self.round), signers=list(own), signatures=list(own.values())
        )
        self._publish("consent", forward)
        log.debug("round %d: %d signatures on the survivors forwarded", self.round, len(own))
        return list(own)

    def _parts(
        self, u3: list[str], asked: Mapping[str, list[str]] | None
    ) -> dict[str, Payload] | None:
        """What each survivor was sent (FedSPU family: drawn again from the fraction it asked
        for, `CentralStrategy.download`) or asked for (FedLDF: `layer_parts`); None where
        every survivor covers every entry."""
        agg = self.aggregator
        facts = agg.learner.facts
        if asked is not None:
            return layer_parts(facts, agg.server, {k: asked[k] for k in u3})
        if not agg.strategy.downloads:
            return None
        with agg.intake.changed:
            fractions = {k: agg.intake.asks.get((self.round, k)) for k in u3}
        unknown = sorted(k for k, ask in fractions.items() if ask is None)
        if unknown:
            raise secagg.SecAggError(f"no part was sent to {', '.join(unknown)} this round")
        return {
            k: agg.strategy.download(facts, agg.server, k, self.round, ask[1])
            for k, ask in fractions.items()
            if ask is not None
        }

    def _shares_of(self, agent: str) -> dict[str, bytes]:
        message = self.stores["shares"][(self.round, agent)]
        return dict(zip(message.peers, message.sealed, strict=True))

    def _reveal_of(self, agent: str) -> dict[str, bytes]:
        message = self.stores["reveal"][(self.round, agent)]
        return dict(zip(message.owners, message.shares, strict=True))

    def _vector(self, agent: str, length: int) -> np.ndarray | None:
        values = self.stores["masked"][(self.round, agent)].values
        if len(values) != 4 * length:
            self.aggregator.intake.reject(
                "masked", agent, "", f"{len(values)} bytes, not {4 * length}"
            )
            return None
        return np.frombuffer(values, dtype="<u4").astype(np.uint32)

    def _publish(self, kind: str, message: messages.Message, to: str | None = None) -> None:
        agg = self.aggregator
        topic = topics.round_topic(agg.fleet, self.round, kind, agg.me, to=to)
        agg.publish(self.round, topic, messages.encode(message, key=agg.key))

    def _collect(
        self,
        kind: str,
        cohort: list[str],
        *,
        asked: bool,
        store: Mapping[tuple[int, str], Any] | None = None,
    ) -> list[str]:
        """Wait for `kind` (in `store`, else the secure stores) from every member of `cohort`
        still expected (not offline, not stopped); the timeout runs from the first delivery,
        or from now when `asked`."""
        agg = self.aggregator
        store = self.stores[kind] if store is None else store
        intake = agg.intake
        deadline = time.monotonic() + agg.round_timeout_s if asked else math.inf
        while True:
            if agg.strategy.downloads:  # parts asked for (again) before the keys
                agg.answer_downloads(self.round)
            with intake.changed:
                got = [k for k in cohort if (self.round, k) in store]
                if got and deadline == math.inf:
                    deadline = time.monotonic() + agg.round_timeout_s
                expected = set(agg.expected(self.round, cohort)) - intake.offline
                waiting = expected - set(got)
                remaining = deadline - time.monotonic()
                if not waiting or remaining <= 0 or agg.stop.is_set():
                    if waiting:
                        log.warning(
                            "round %d: no secure-aggregation %s from %s",
                            self.round,
                            kind,
                            ", ".join(sorted(waiting)),
                        )
                    return got
                intake.changed.wait(min(remaining, 0.2))
