"""`--wire delta`: after round 0 (derivable), each model goes out as a sparse delta on the
sender's previous one, as its peers rebuild it (ALGORITHMS.md, `agent.learning.delta`).

Deltas build on each other, so a receiver follows every peer's models from the start, not
only its neighbours' of the round; the sender keeps the reconstruction its peers hold (`recon`)
and re-sends that whole on request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agent.learning import Learner, Need, Published, RoundResult, encode_delta
from agent.runtime import checkpoint
from agent.runtime.codec import expected_delta_shapes
from agent.runtime.session import Session
from agent.runtime.wire import WholeModels
from protocol import topics


class DeltaWire(WholeModels):
    """Deltas on the previous round's reconstruction; whole models after a restart."""

    def __init__(self, session: Session) -> None:
        super().__init__(session)
        self.recon = session.learner.published(session.state, 0)
        """This agent's model as its peers rebuild it from its deltas."""
        self.whole_after_restart = 0 if session.warm_start is None else 1
        """Models to send whole: after a restart the round redone may differ from what went
        out before the crash, and peers keep the first copy they got; the round after it,
        sent whole too, puts sender and receivers back on one copy. Round 1 of an agent that
        started from its own model goes whole: its peers cannot derive the first base."""
        self.seeded = False

    @staticmethod
    def expects(learner: Learner, agent_id: str) -> dict[str, Any]:
        """The tensors of a delta message, for the inbox to check."""
        shapes = expected_delta_shapes(learner.facts.initial, learner.initial_masks(agent_id))
        return {"delta_shapes": shapes}

    def wanted(self, round_: int, ahead: Callable[[int], set[Need]]) -> set[str]:
        """Every peer's models; the first time, round 0's too, derived here: the first deltas'
        base."""
        session = self.session
        if not self.seeded:
            self.seeded = True
            for j in session.roster:
                session.inbox.put_model(0, j, session.round0_model(j))
        return {topics.round_topic(session.fleet, "+", "model")}

    def encode(self, round_: int, result: RoundResult) -> tuple[bytes, bytes, Published]:
        """The delta and, to re-send on request, the whole reconstruction it leads to."""
        published = result.published
        if self.whole_after_restart:
            data = self.message(round_, published.num_samples, published.weights, published.masks)
            self.recon = published
            self.whole_after_restart -= 1
            return data, data, published
        values, value_masks, self.recon = encode_delta(
            published, self.recon, self.session.cfg.delta_fraction, fp16=self.session.cfg.fp16
        )
        samples = published.num_samples
        data = self.message(round_, samples, values, value_masks, base_round=round_ - 1)
        resend = self.message(round_, samples, self.recon.weights, self.recon.masks)
        return data, resend, Published(values, value_masks, samples)

    def checkpoint(self) -> dict[str, Any]:
        return {"recon": checkpoint.saved_model(self.recon)}

    def restore(self, saved: dict[str, Any]) -> None:
        if saved.get("recon"):
            self.recon = checkpoint.restored_model(saved["recon"])
        self.whole_after_restart = 2
