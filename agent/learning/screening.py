"""What the defence in front of the aggregation (`--clip`, `robust.clip`) did in a round: which
received models it screened out and which it clipped, for the round's record and its log.

`robust.clip` runs deep inside a round, where a strategy's contract returns tensors alone (a
decentralized strategy's `aggregate`, a central one's `Aggregate`, both a user may write), so
its verdicts do not travel back through return values: the two places that call it
(`Learner.aggregate`'s `combine`, `central.base.clipped_uploads`) add each verdict (`noted`)
to the tally their round has open (`tallied`, a context variable: per thread, so agents that
train side by side keep their own). A decentralized round opens one around its aggregate
(`Learner.local_round`), a centralized one around the aggregator's (`central.server.conclude`);
a call outside a tally (a test, a study) is not counted. A round that clips several times
(FedAdam's three deltas, a neighbour's layers apart from the rest under `--wire layers`)
counts a sender screened if any of its parts was, clipped if any was and none was screened.

`ScreeningLog` says it in the run's log, once per run and cause at the level that cause
deserves: a round that screened out every model it received is a WARNING (the global model,
or the agent's aggregate, did not move: under `--dp sample` at a high `--lr` every honest
upload lands beyond the screen), one that screened out some is INFO; the same cause again
later in the run is DEBUG, since the round records list every one (`screened`, `clipped`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

from agent.learning import robust
from agent.learning.config import DP_CLIENT, DP_SAMPLE, StrategyConfig
from agent.learning.robust import OWN_FACTOR, SCREEN_FACTOR
from agent.learning.robust_rules import CLIP_AUTO
from agent.learning.sparse import State

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Screening:
    """A round's verdicts: the senders whose models the defence received, those it screened
    out (a stand-in took their place) and those it clipped (pulled in to its bound), each
    sorted."""

    received: tuple[str, ...] = ()
    screened: tuple[str, ...] = ()
    clipped: tuple[str, ...] = ()

    @classmethod
    def of(cls, clipped: robust.Clipped) -> Screening:
        """The verdicts of one `robust.clip` call."""
        return cls(tuple(sorted(clipped.models)), clipped.screened, clipped.clipped)

    def merged(self, other: Screening) -> Screening:
        """Both calls' verdicts: a sender screened out in either is screened, one clipped
        in either and screened in neither is clipped."""
        screened = set(self.screened) | set(other.screened)
        clipped = (set(self.clipped) | set(other.clipped)) - screened
        received = set(self.received) | set(other.received)
        return Screening(tuple(sorted(received)), tuple(sorted(screened)), tuple(sorted(clipped)))

    @property
    def everything(self) -> bool:
        """Whether it screened out every model it received (and received some)."""
        return bool(self.received) and len(self.screened) == len(self.received)


NOTHING = Screening()
"""A round whose defence received nothing, or that ran none (`--clip off`)."""


@dataclass
class Tally:
    """The verdicts of the `robust.clip` calls of one round so far."""

    screening: Screening = NOTHING


_OPEN: ContextVar[Tally | None] = ContextVar("edgefl_screening", default=None)


@contextlib.contextmanager
def tallied() -> Iterator[Tally]:
    """A tally that every `noted` verdict in this thread adds to while it is open."""
    tally = Tally()
    token = _OPEN.set(tally)
    try:
        yield tally
    finally:
        _OPEN.reset(token)


def noted(clipped: robust.Clipped) -> dict[str, State]:
    """`clipped`'s models, its verdicts added to the open tally (if any)."""
    tally = _OPEN.get()
    if tally is not None:
        tally.screening = tally.screening.merged(Screening.of(clipped))
    return clipped.models


class ScreeningLog:
    """Says a run's screenings in its log, each cause at its level the first time in the
    run (`centralized`: the coordinator's uploads; else the models an agent received)."""

    def __init__(self, config: StrategyConfig, centralized: bool) -> None:
        self.config = config
        self.centralized = centralized
        self._said: set[str] = set()

    def say(self, round_: int, screening: Screening) -> None:
        """Round `round_`'s verdicts in the log, if it screened out or clipped any."""
        if screening.everything:
            self._say("all", logging.WARNING, f"round {round_}: {self._all(screening)}")
        elif screening.screened or screening.clipped:
            self._say("some", logging.INFO, f"round {round_}: {self._some(screening)}")

    def _say(self, cause: str, level: int, line: str) -> None:
        """`line` at `level` the first time its cause comes up in the run, else at DEBUG."""
        log.log(level if cause not in self._said else logging.DEBUG, line)
        self._said.add(cause)

    def _all(self, screening: Screening) -> str:
        count, spec = len(screening.received), self.config.clip
        if self.centralized:
            what = f"all {count} uploads, so the global model did not move"
        else:
            what = f"all {count} models it received, so it aggregated its own model alone"
        return (
            f"the defence (--clip {spec}) screened out {what} ({self._why()}): {self._hint()}; "
            "said once per run, the round records list every one (screened)"
        )

    def _some(self, screening: Screening) -> str:
        of = f"of {len(screening.received)} {'uploads' if self.centralized else 'received'}"
        verdicts = (("screened out", screening.screened), ("clipped", screening.clipped))
        parts = [
            f"{verb} {len(names)} {of} ({', '.join(names)})" for verb, names in verdicts if names
        ]
        return f"the defence (--clip {self.config.clip}) " + " and ".join(parts)

    def _why(self) -> str:
        """What screens a model out under the run's `--clip`."""
        if self.config.clip != CLIP_AUTO:
            return "screened out: not finite"
        own = "the global model" if self.centralized else "the agent's own model"
        return (
            f"screened out: not finite, or farther from {own} than {SCREEN_FACTOR:g}x the "
            f"median distance or than {OWN_FACTOR:g}x its norm"
        )

    def _hint(self) -> str:
        """What a user whose uploads are honest can do about it."""
        if self.config.dp == DP_SAMPLE:
            return (
                "under --dp sample each noised step moves an upload, so its distance grows "
                "with --lr and the round's steps: lower --lr, or pass --clip off"
            )
        if self.config.dp == DP_CLIENT:
            return "under --dp client, if the uploads are honest, pass --clip off"
        return "if the models are honest, lower --lr, or pass --clip off"
