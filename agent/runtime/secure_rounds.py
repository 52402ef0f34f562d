"""A participant's secure-aggregation steps of a centralized round (`--secure-aggregation`),
over the transport: the messages and waits around `protocol.secagg.Client`, whose
cryptography they move, and `agent.learning.central.secure`, which makes the vector masked.
`agent.runtime.centralized` calls them in place of the plain upload. Round t of agent k:

    advertise   at the round's start, before training: its keys and sample count on
                round/t/keys/k
    share       while it trains (a thread started by `advertise`): the aggregator's key list
                U1 on round/t/keylist/<aggregator>, each key checked as its sender signed
                it; its encrypted shares for its neighbours in the round's graph (derived
                from the key list) to the aggregator on round/t/shares/k/<aggregator>
    announce    (FedAdam-Top, -SSM; after training) the entries its upload covers, its
                top-k masks, on round/t/support/k (FedLDF's divergence vector goes in the
                clear as in the plain round)
    agree       the round's index set, where it has one (`agent.runtime.secure_vector`):
                FedLDF's request for layers (an empty one: none), or the union of the
                supports on round/t/support/<aggregator>
    mask        the shares U2 sent it, relayed on round/t/shares/<aggregator>/k (mostly in
                before training ends); its masked vector over the index set on
                round/t/masked/k
    check       the survivors U3 on round/t/survivors/<aggregator>; its signature on U3 on
                round/t/consent/k
    unmask      the survivors' signatures, forwarded on round/t/consent/<aggregator>; its
                reveal on round/t/reveal/k if t of its neighbours and 70% of U1 signed
                the same U3 (`protocol.secagg.Client.reveal`)

Sharing while training takes the key list's and the shares' round trips off the end of the
round: after training come the masked upload, the check and the reveal. Nothing is sent
twice: a step that does not come within the broadcast's patience leaves this agent out of
the round's sum (the others' sum survives it), and it still waits for the broadcast.
Handlers only validate and store.

FedBuff's cohorts (`agent.runtime.secure_cohorts`) take the same steps, a cohort's number
as the round's, the update already trained: `advertise` without sharing in the background,
`join` waits for the key list and says whether the cohort took this agent, `upload_joined`
takes the steps after it; a round is over (`closed`) once its version is out rather than
its broadcast.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np

from agent.learning.central import secure_dp
from protocol import ProtocolError, masks, messages, secagg, topics
from protocol.logs import claimed_sender

if TYPE_CHECKING:
    from agent.runtime.session import Session

log = logging.getLogger(__name__)

Vector = Callable[[int], np.ndarray | None]
"""The vector to mask, for a round of that many members (U1: under `--dp client` the noise
share is sized by it), once the round's index set is agreed; None: it has none to mask
(its index set never came, or leaves out entries it covers)."""


class SecureSteps:
    """One participant's secure-aggregation messages, for every round of its run."""

    def __init__(
        self,
        session: Session,
        aggregator: str,
        patience_s: float,
        closed: Callable[[int], bool] | None = None,
    ) -> None:
        """`closed`: whether a round is over, so that nothing more of it is worth waiting
        for (by default: its broadcast is in)."""
        self.session = session
        self.aggregator = aggregator
        self.patience_s = patience_s
        self.closed = closed or self._broadcast_in
        self.changed = threading.Condition()
        self.received: dict[tuple[int, str], messages.Message] = {}
        """(round, kind) -> the aggregator's key list, relayed shares, survivors or the
        signatures it forwards."""
        self.clients: dict[int, secagg.Client] = {}
        self.shared: dict[int, Future[bool]] = {}
        """round -> whether this agent's shares went out (`_share`, run while it trains)."""

    def subscribe(self) -> None:
        s, me, agg = self.session, self.session.me, self.aggregator
        s.transport.subscribe(topics.round_topic(s.fleet, "+", "keylist", agg), self._on_message)
        s.transport.subscribe(
            topics.round_topic(s.fleet, "+", "shares", agg, to=me), self._on_message
        )
        for kind in ("support", "survivors", "consent"):
            s.transport.subscribe(topics.round_topic(s.fleet, "+", kind, agg), self._on_message)

    def _on_message(self, topic: str, payload: bytes) -> None:
        s = self.session
        kind = topics.parse(topic)[1]
        try:
            message = messages.decode_on_topic(topic, payload, kind, s.fleet, s.key)
        except ProtocolError as exc:
            s.inbox.reject(kind, claimed_sender(topic), topic, exc)
            return
        if message.run_id != s.run_info.run_id or message.round not in self.clients:
            return
        with self.changed:
            self.received.setdefault((message.round, kind), message)
            self.changed.notify_all()

    def _broadcast_in(self, round_: int) -> bool:
        """Whether `round_`'s broadcast is in (the aggregator is done with its secure sum)."""
        return self.session.inbox.wait_global(round_, False, 0.0) is not None

    def _wait(self, round_: int, kind: str) -> Any:
        """The aggregator's `kind` of `round_`; None after the patience, or once the round is
        over (`closed`: the aggregator gave up on the secure sum)."""
        deadline = time.monotonic() + self.patience_s
        with self.changed:
            while (round_, kind) not in self.received and not self.session.stop.is_set():
                left = deadline - time.monotonic()
                if self.closed(round_):
                    return None
                if left <= 0:
                    log.warning(
                        "round %d: no secure-aggregation %s from %s; left out of the sum",
                        round_,
                        kind,
                        self.aggregator,
                    )
                    return None
                self.changed.wait(min(left, 0.5))
            return self.received.get((round_, kind))

    def _publish(
        self,
        round_: int,
        kind: str,
        message: messages.Message,
        to: str | None = None,
        throttled: bool = False,
    ) -> None:
        s = self.session
        data = messages.encode(message, key=s.key)
        topic = s.topic(round_, kind, s.me, to=to)
        (s.send if throttled else s.transport.publish)(topic, data)

    def advertise(
        self, round_: int, num_samples: int, base_version: int = -1, *, share: bool = True
    ) -> None:
        """The round's keys, before training; with `share`, the key list's wait and this
        agent's shares then go on while it trains, so the relayed shares are in when training
        ends (FedBuff's cohorts: once the update is trained, with the version it was trained
        from, and no sharing: `join` shares)."""
        s = self.session
        client = secagg.Client(s.me, secagg.Context(s.run_info.run_id, round_))
        self.clients = {round_: client}
        self.shared = {}
        with self.changed:
            self.received = {k: v for k, v in self.received.items() if k[0] >= round_}
        advert = client.advert(num_samples)
        keys = messages.Keys(
            **s.header(round_),
            cipher_key=advert.cipher_key,
            mask_key=advert.mask_key,
            num_samples=num_samples,
            sign_key=advert.sign_key,
            base_version=base_version,
        )
        self._publish(round_, "keys", keys)
        if share:
            self.shared[round_] = self._in_background(round_, client)

    def _in_background(self, round_: int, client: secagg.Client) -> Future[bool]:
        """`_share` on a thread of its own (a round whose key list never comes must not hold
        up the next round's), its outcome in the future returned."""
        shared: Future[bool] = Future()

        def share() -> None:
            try:
                shared.set_result(self._share(round_, client))
            except Exception as exc:  # SecAggError and the like: `upload` raises it
                shared.set_exception(exc)

        name = f"{self.session.me}-share-{round_}"
        threading.Thread(target=share, name=name, daemon=True).start()
        return shared

    def upload(self, round_: int, vector: Vector, noised: bool = False) -> int:
        """Once the shares are out (sent while training), upload the masked `vector` and
        reveal: the values sent (0: left out). Under `--dp client` (`noised`) no reveal goes
        out for a sum of fewer survivors than its noise is sized for."""
        client, shared = self.clients.get(round_), self.shared.get(round_)
        try:
            if client is None or shared is None or not shared.result():
                return 0
        except secagg.SecAggError as exc:
            log.warning("round %d: secure aggregation without this agent: %s", round_, exc)
            return 0
        return self.upload_joined(round_, vector, noised)

    def join(self, round_: int) -> bool | None:
        """(FedBuff's cohorts) Wait for `round_`'s key list and send this agent's shares if
        it lists this agent: True; False when the round went on without it (the list leaves
        it out, or the round is over); None when nothing came within the patience."""
        client = self.clients.get(round_)
        if client is None:
            return False
        listed = self._wait(round_, "keylist")
        if listed is None:
            return False if self.closed(round_) else None
        try:
            adverts = self._adverts(round_, listed)
            if self.session.me not in adverts:
                return False
            self._send_shares(round_, client, adverts)
        except secagg.SecAggError as exc:
            log.warning("round %d: secure aggregation without this agent: %s", round_, exc)
            return False
        return True

    def upload_joined(self, round_: int, vector: Vector, noised: bool = False) -> int:
        """The steps after the shares (`upload`): the masked `vector` out, the reveal; the
        values sent."""
        client = self.clients.get(round_)
        if client is None:
            return 0
        try:
            relayed = self._wait(round_, "shares")
            if relayed is None:
                return 0
            client.receive_shares(dict(zip(relayed.peers, relayed.sealed, strict=True)))
            log.debug("round %d: shares of %d members in", round_, len(relayed.peers))
            change = vector(len(client.adverts))
            if change is None:
                return 0
            masked, clipped = client.masked(change)
            if clipped:
                log.warning(
                    "round %d: %d changes clipped to the secure sum's range", round_, clipped
                )
            s = self.session
            body = messages.Masked(**s.header(round_), values=masked.astype("<u4").tobytes())
            self._publish(round_, "masked", body, throttled=True)
            log.debug("round %d: masked change sent", round_)
            survivors = self._wait(round_, "survivors")
            if survivors is None or s.me not in survivors.survivors:
                return masked.size
            if noised and not self._noised_enough(round_, survivors.survivors, client):
                return masked.size
            self._reveal(round_, client, survivors.survivors)
            return masked.size
        except secagg.SecAggError as exc:
            log.warning("round %d: secure aggregation without this agent: %s", round_, exc)
            return 0

    def announce(self, round_: int, support: np.ndarray) -> None:
        """(FedAdam-Top, -SSM) The entries this agent's upload covers, before it masks."""
        body = messages.Support(**self.session.header(round_), mask=masks.pack_mask(support))
        self._publish(round_, "support", body)

    def agreed(self, round_: int, length: int) -> np.ndarray | None:
        """(FedAdam-Top, -SSM) The union of the supports the aggregator sent, over a vector
        of `length`; None if it never came or is not one."""
        message = self._wait(round_, "support")
        if message is None:
            return None
        try:
            return masks.unpack_mask(message.mask, length)
        except ProtocolError as exc:
            log.warning("round %d: the aggregator's union of supports: %s", round_, exc)
            return None

    def _reveal(self, round_: int, client: secagg.Client, survivors: list[str]) -> None:
        """The consistency check, then the reveal: this agent's signature on `survivors`
        out, the aggregator's forward of the survivors' signatures in, checked."""
        s = self.session
        signature = client.consent(survivors)
        consent = messages.Consent(**s.header(round_), signers=[s.me], signatures=[signature])
        self._publish(round_, "consent", consent)
        forwarded = self._wait(round_, "consent")
        if forwarded is None:
            return
        signatures = dict(zip(forwarded.signers, forwarded.signatures, strict=True))
        shares = client.reveal(survivors, signatures)
        reveal = messages.Reveal(
            **s.header(round_), owners=list(shares), shares=list(shares.values())
        )
        self._publish(round_, "reveal", reveal)

    def _noised_enough(self, round_: int, survivors: list[str], client: secagg.Client) -> bool:
        """Whether a sum of `survivors` holds the noise the accountant counts
        (`secure_dp.survivors_floor`); said in the log when not."""
        floor = secure_dp.survivors_floor(len(client.adverts))
        if len(survivors) >= floor:
            return True
        log.warning(
            "round %d: %d survivors, fewer than the %d the noise is sized for; no reveal",
            round_,
            len(survivors),
            floor,
        )
        return False

    def _share(self, round_: int, client: secagg.Client) -> bool:
        """The key list checked, and this agent's shares sent; False if it never came."""
        listed = self._wait(round_, "keylist")
        if listed is None:
            return False
        self._send_shares(round_, client, self._adverts(round_, listed))
        return True

    def _adverts(self, round_: int, listed: messages.KeyList) -> dict[str, secagg.Advert]:
        """The key list's adverts, each key checked as its sender signed it."""
        s = self.session
        adverts = {}
        for data in listed.keys:
            try:
                keys = messages.decode(data, key=s.key)
            except ProtocolError as exc:
                raise secagg.SecAggError(f"a key in the key list: {exc}") from None
            if (
                not isinstance(keys, messages.Keys)
                or keys.run_id != s.run_info.run_id
                or keys.round != round_
                or keys.sender not in s.roster
            ):
                raise secagg.SecAggError("the key list holds a key of another round or member")
            adverts[keys.sender] = secagg.Advert(
                keys.cipher_key, keys.mask_key, keys.num_samples, keys.sign_key
            )
        return adverts

    def _send_shares(
        self, round_: int, client: secagg.Client, adverts: dict[str, secagg.Advert]
    ) -> None:
        """This agent's encrypted shares for its neighbours among `adverts`, to the
        aggregator."""
        s = self.session
        sealed = client.shares(adverts)
        out = messages.Shares(
            **s.header(round_),
            target=self.aggregator,
            peers=list(sealed),
            sealed=list(sealed.values()),
        )
        self._publish(round_, "shares", out, to=self.aggregator)
        log.debug("round %d: key list of %d members in, shares sent", round_, len(adverts))
