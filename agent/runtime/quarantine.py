"""Members that keep sending invalid models, quarantined for the run (issue 34 point 4).

A model (or layer) that fails its checks after its envelope passed them (the signature, in a
signed fleet: a forged or unsigned message says nothing of its claimed sender) is not finite,
not of the agreed shapes or not decodable. Its sender would only re-send it when asked, so
its receivers do not wait for that round's model any longer (they go on with the straggler
fallback); once QUARANTINE_AFTER rounds of a sender failed, it is quarantined for the rest of
the run: its models are ignored and nobody waits for them, where before every receiver
waited out the round timeout for it every round (11 times the wall time of a clean run).
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)

QUARANTINE_AFTER = 3
"""Rounds of invalid models after which a sender is quarantined for the run: one broken
message may be a glitch of its sender's, three rounds of them a broken or hostile member."""


class Quarantine:
    """The senders of invalid models, and those quarantined. At most QUARANTINE_AFTER - 1
    rounds are held per roster member. Thread-safe (its own lock)."""

    def __init__(self, after: int = QUARANTINE_AFTER) -> None:
        self.after = after
        self._lock = threading.Lock()
        self._rounds: dict[str, set[int]] = {}
        """Sender -> the rounds of its invalid models, while not quarantined."""
        self._held: set[str] = set()

    def invalid(self, sender: str, round_: int, problem: object) -> None:
        """Record an invalid model of `sender`'s round (`problem`: what was wrong with it);
        quarantine `sender` if that makes QUARANTINE_AFTER rounds."""
        with self._lock:
            if sender in self._held:
                return
            rounds = self._rounds.setdefault(sender, set())
            rounds.add(round_)
            if len(rounds) < self.after:
                return
            del self._rounds[sender]
            self._held.add(sender)
        log.warning(
            "quarantined %s for the rest of the run: invalid models in rounds %s (%s)",
            sender,
            ", ".join(map(str, sorted(rounds))),
            problem,
        )

    def holds(self, sender: str) -> bool:
        """Whether `sender` is quarantined."""
        with self._lock:
            return sender in self._held

    def members(self) -> set[str]:
        """The senders quarantined: their models are ignored, never waited for."""
        with self._lock:
            return set(self._held)

    def skips(self, round_: int, sender: str) -> bool:
        """Whether `sender`'s model of `round_` is not worth waiting for: it came invalid,
        or `sender` is quarantined."""
        with self._lock:
            return sender in self._held or round_ in self._rounds.get(sender, ())
