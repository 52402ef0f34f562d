"""What a simulated round under `--secure-aggregation` would put on the wire, counted as the
agents and the aggregator send it (`agent.runtime.secure_rounds`, `coordinator.secure_sum`),
in place of the plain round's `Update`s: so that simulate's byte figures are emulate's, as
`coordinator.traffic` keeps them for the plain rounds. Each message is built at its real size
(keys, ciphertexts and shares of their fixed lengths) and encoded, as the plain uploads are;
a member's shares, relays and reveals are among its neighbours in the round's SecAgg+ graph
(`protocol.secagg.round_graph`; all of the round's members in a fleet under about 40).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from agent.report import COORDINATOR, Traffic
from coordinator.traffic import FLEET, RUN_ID
from protocol import messages, secagg
from protocol.masks import pack_mask

KEY_BYTES = 32
"""A raw X25519 public key."""
SEALED_BYTES = 12 + 48 + 16
"""A pair of shares for one holder: AES-GCM's nonce, the holder's index and two shares, tag."""
SHARE_BYTES = 16
"""One revealed Shamir share."""
SIGNATURE_BYTES = 64
"""An Ed25519 signature on the survivor list (the consistency check)."""


def _size(message: messages.Message) -> int:
    return len(messages.encode(message))


def secure_round(
    round_: int,
    members: Sequence[str],
    survivors: Sequence[str],
    length: int,
    traffic: dict[str, Traffic],
    supports: Mapping[str, np.ndarray] | None = None,
    union: np.ndarray | None = None,
) -> None:
    """Add round `round_`'s secure-aggregation messages to `traffic`: every member's keys and
    shares (to its neighbours), the survivors' masked vectors (`length` values), signatures
    on the survivor list and reveals, the aggregator's key list, relays, survivors list and
    forwarded signatures; with `supports` (FedAdam-Top, -SSM) each member's `Support` and
    the aggregator's `union` to every member."""
    header: dict[str, Any] = {"fleet": FLEET, "run_id": RUN_ID, "round": round_}
    coordinator = traffic[COORDINATOR]
    keys = {
        k: messages.encode(
            messages.Keys(**header, sender=k, cipher_key=b"\0" * KEY_BYTES,
                          mask_key=b"\0" * KEY_BYTES, num_samples=1,
                          sign_key=b"\0" * KEY_BYTES)
        )
        for k in members
    }  # fmt: skip
    listed = _size(messages.KeyList(**header, sender=COORDINATOR, keys=list(keys.values())))
    survived = _size(messages.Survivors(**header, sender=COORDINATOR, survivors=list(survivors)))
    signature = [b"\0" * SIGNATURE_BYTES]
    forward = _size(
        messages.Consent(
            **header,
            sender=COORDINATOR,
            signers=list(survivors),
            signatures=signature * len(survivors),
        )
    )
    graph = secagg.round_graph(secagg.Context(RUN_ID, round_), members)
    coordinator.sent += listed + survived + forward
    if supports and union is not None:
        _supports(header, members, supports, union, traffic)
    for k in members:
        neighbours = list(graph[k])
        sealed = [b"\0" * SEALED_BYTES] * len(neighbours)
        shares = messages.Shares(
            **header, sender=k, target=COORDINATOR, peers=neighbours, sealed=sealed
        )
        relay = messages.Shares(
            **header, sender=COORDINATOR, target=k, peers=neighbours, sealed=sealed
        )
        up = len(keys[k]) + _size(shares)
        if k in survivors:
            masked = messages.Masked(**header, sender=k, values=b"\0" * (4 * length))
            reveal = messages.Reveal(
                **header,
                sender=k,
                owners=neighbours,
                shares=[b"\0" * SHARE_BYTES] * len(neighbours),
            )
            consent = messages.Consent(**header, sender=k, signers=[k], signatures=signature)
            up += _size(masked) + _size(consent) + _size(reveal)
            traffic[k].nonzeros_sent += length
        traffic[k].sent += up
        traffic[k].received += listed + _size(relay) + survived + forward
        coordinator.received += up
        coordinator.sent += _size(relay)


def _supports(
    header: dict[str, Any],
    members: Sequence[str],
    supports: Mapping[str, np.ndarray],
    union: np.ndarray,
    traffic: dict[str, Traffic],
) -> None:
    """Each member's `Support` to the aggregator, and the union it publishes to them all."""
    agreed = _size(messages.Support(**header, sender=COORDINATOR, mask=pack_mask(union)))
    coordinator = traffic[COORDINATOR]
    coordinator.sent += agreed
    for k in members:
        size = _size(messages.Support(**header, sender=k, mask=pack_mask(supports[k])))
        traffic[k].sent += size
        traffic[k].received += agreed
        coordinator.received += size
