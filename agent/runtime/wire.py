"""What every `--wire` format offers the decentralized rounds, and what the whole-model formats
(`full`, `delta`) share: a receiver gathers whole models of its neighbours.

A wire object owns the state its format needs across rounds (the reconstruction peers hold
of our deltas, the models whose layers we serve) and checkpoints it itself; the round driver
(`agent.runtime.decentralized`) only says when to publish, gather, serve and forget.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from agent.learning import Masks, Need, Published, RoundResult, State
from agent.runtime.codec import model_message
from agent.runtime.session import Session
from protocol import messages

log = logging.getLogger(__name__)

Handler = Callable[[str, bytes], None]
Have = Callable[[int, str], object]
"""Whether (round, sender)'s announcement is here: the inbox's `model` or `divergence`."""
Wait = Callable[[set[Need], float], set[Need]]
"""Wait for announcements, returning the missing: the inbox's `wait_models` or
`wait_divergences`."""
Gathered = tuple[dict[str, Published], list[str]]
"""A round's inbox (sender -> model or part of it) and its stragglers."""


class Fetcher(Protocol):
    """The round driver's waiting, as a wire format's gathering uses it."""

    def await_needs(
        self, round_: int, needs: set[Need], deadline: float, have: Have, wait: Wait
    ) -> set[Need]:
        """Wait for what announces each live need (a neighbour that stopped early is left
        out); returns the live needs."""

    def request(self, missing: set[Need], layers: list[str] | None = None) -> None:
        """Ask each (round, target) for its announcement again, or for these layers."""


class Wire(Protocol):
    """One `--wire` format, as the decentralized round driver uses it."""

    announcement: str
    """The kind of message that announces an agent's round model."""

    def on_announcement(self, topic: str, payload: bytes) -> None:
        """The inbox handler of neighbours' announcements."""

    def wanted(self, round_: int, ahead: Callable[[int], set[Need]]) -> set[str]:
        """The announcement topics to hold from round `round_` on (`ahead`: the live needs
        of the next few rounds)."""

    def encode(self, round_: int, result: RoundResult) -> tuple[bytes, bytes, Published]:
        """What to publish after the round, what to re-send on request, and what the
        publish carries (for counting its values)."""

    def serve(self, request: messages.Request) -> bool:
        """Answer a request this format handles itself; False: re-send the announcement."""

    def gather(self, round_: int, needs: set[Need], deadline: float, fetch: Fetcher) -> Gathered:
        """The round's inbox and stragglers."""

    def forget(self, round_: int) -> None:
        """Round `round_` is no longer re-sent or served."""

    def take_served(self) -> int:
        """Values served since the last call besides the announcements."""

    def checkpoint(self) -> dict[str, Any]:
        """This format's state to persist with a round."""

    def restore(self, saved: dict[str, Any]) -> None:
        """Read back what `checkpoint` saved."""

    def resumed(self, done: int) -> None:
        """After a restart into round `done` + 1."""

    def close(self) -> None:
        """The run is over."""


def announced_topics(session: Session, kind: str, sources: Iterable[Need]) -> set[str]:
    """The topics on which these (round, sender)s announce their models."""
    return {session.topic(r, kind, j) for r, j in sources}


class WholeModels:
    """What the whole-model formats share: neighbours' models come whole (or rebuilt whole
    from deltas), stragglers fall back to the newest model held; nothing is served but the
    announcement and nothing is kept beyond it."""

    announcement = "model"

    def __init__(self, session: Session) -> None:
        self.session = session
        self.on_announcement: Handler = session.inbox.on_model

    def serve(self, request: messages.Request) -> bool:
        return False

    def gather(self, round_: int, needs: set[Need], deadline: float, fetch: Fetcher) -> Gathered:
        """Wait for every need's model; a straggler's stands in by its newest one held (its
        initial model if none). A neighbour gone offline is a straggler at once."""
        inbox = self.session.inbox
        for r, j in needs:
            if r == 0:
                inbox.put_model(0, j, self.session.round0_model(j))
        awaited = fetch.await_needs(round_, needs, deadline, inbox.model, inbox.wait_models)
        gone = inbox.gone()
        models: dict[str, Published] = {}
        stragglers = []
        for r, j in sorted(awaited | {need for need in needs if need[0] == 0}):
            model = inbox.model(r, j)
            if model is None:
                stragglers.append(j)
                fallback = inbox.latest(j, r)
                model = fallback[1] if fallback else self.session.round0_model(j)
                why = "is offline" if j in gone else "did not deliver in time"
                log.warning("round %d: %s %s: no round %d model", round_, j, why, r)
            models[j] = model
        return models, stragglers

    def forget(self, round_: int) -> None:
        """Nothing kept per round besides the announcement."""

    def take_served(self) -> int:
        return 0

    def checkpoint(self) -> dict[str, Any]:
        return {}

    def restore(self, saved: dict[str, Any]) -> None:
        """Nothing of its own to read back."""

    def resumed(self, done: int) -> None:
        """Nothing held on the broker to repair."""

    def close(self) -> None:
        """Nothing to clean up."""

    def message(
        self,
        round_: int,
        num_samples: int,
        weights: State,
        masks: Masks | None,
        base_round: int = -1,
    ) -> bytes:
        """A model message of this agent's round: a whole model, or a delta on `base_round`."""
        return model_message(
            **self.session.model_fields(round_, num_samples),
            weights=weights,
            masks=masks,
            base_round=base_round,
        )
