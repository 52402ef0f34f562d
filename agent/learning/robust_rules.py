"""The settings of robust aggregation and of the research attacks, as a run's config names
them (`--aggregation`, `--clip`, `--attack`): their values, parsing and defaults, without
tensors, so a command can check them and list them without loading torch. The math they
select is `agent.learning.robust`'s.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

ATTACKS = (
    "scale",
    "noise",
    "signflip",
    "huge",
    "nan",
    "inflate",
    "ipm",
    "alie",
    "labelflip",
    "backdoor",
    "replace",
)
DATA_ATTACKS = ("labelflip", "backdoor", "replace")
"""Attacks on an attacker's training data (`agent.learning.backdoor`)."""
SENT_AS_TRAINED = ("labelflip", "backdoor")
"""Data attacks whose attacker then sends the model it trained, as it is (`replace` boosts
its step)."""
TRIGGER_ATTACKS = ("backdoor", "replace")
"""Attacks whose harm is the trigger's success (`backdoor.success_rate`), not accuracy."""
IPM_EPSILON = 0.5
"""The `ipm` attack's step (inner-product manipulation, Xie et al. 2020): the attacker sends
the model it trained from less this multiple of its own honest step, so that the mean's
inner product with the honest direction shrinks."""
REPLACE_BOOST = 20.0
"""The `replace` attack's boost (model replacement, Bagdasaryan et al. 2020): its backdoored
step times the number of models it expects averaged with it (the 20 of the measurements), so
that a plain mean lands on its model."""
BACKDOOR_TARGET = 0
"""The class the `backdoor` attack's trigger leads to."""
BACKDOOR_SHARE = 1.0
"""Triggered copies an attacker adds to its training data, per sample it has."""
INFLATED_SAMPLES = 10_000_000
"""The `inflate` attack's claimed sample count: the most the protocol lets a model claim
(`protocol.limits.Limits.max_num_samples`)."""
SCALE_FACTOR = -100.0
"""The `scale` attack's factor: large, and negative so that it also points the wrong way."""
NOISE_STD = 10.0
"""The `noise` attack's standard deviation: two orders of magnitude above typical weights."""
HUGE_VALUE = 3e37
"""The `huge` attack's value: finite in float32, yet a sum of a dozen of them overflows."""
CLIP_OFF = "off"
CLIP_AUTO = "auto"


SCREENED = "screened"
"""The default `--aggregation`: the strategy's own mean over the received models once
screened and clipped (`--clip auto`, which the default `--clip` then is)."""
CLIP_DEFAULT = "default"
"""`--clip`'s default: `auto` under every `--aggregation` but `mean`, `off` under `mean`
(`default_clip`), so that `--aggregation mean` alone is the undefended mean."""


SIGNS = "signs"
"""`--aggregation signs`: `screened`, then the aggregate's step reversed wherever the senders
disagree on its way (`robust.sign_vote`): a defence against backdoors for the strategies
with a coordinator, whose senders all step from one global model."""


@dataclass(frozen=True)
class Rule:
    """An aggregation rule: `screened`, `signs` or `mean` (the strategy's own mean, after
    `clip`; `signs` then votes on each element's way), `median` or `trimmed` (cutting `trim`
    at each end)."""

    kind: str
    trim: float = 0.0

    @property
    def robust(self) -> bool:
        """Whether this rule is computed here rather than by the strategy's own mean."""
        return self.kind in ("median", "trimmed")


def parse_rule(spec: str) -> Rule:
    """`screened`, `signs`, `mean`, `median` or `trimmed:F` with 0 <= F < 0.5; ValueError
    (one sentence) else."""
    if spec in (SCREENED, SIGNS, "mean", "median"):
        return Rule(spec)
    kind, _, fraction = spec.partition(":")
    try:
        trim = float(fraction)
    except ValueError:
        trim = math.nan
    if kind != "trimmed" or not 0.0 <= trim < 0.5:
        raise ValueError(
            "--aggregation must be screened, signs, mean, median or trimmed:F with "
            "0 <= F < 0.5, "
            f"got {spec!r}"
        )
    return Rule("trimmed", trim)


def default_clip(aggregation: str, clip: str) -> str:
    """`clip` with CLIP_DEFAULT resolved for the rule `aggregation`: `off` under `mean`,
    `auto` under every other rule (the default defence, and the screen in front of median
    and trimmed means, whose few holders of a sparse element a poisoned one can outvote)."""
    if clip != CLIP_DEFAULT:
        return clip
    return CLIP_OFF if aggregation == "mean" else CLIP_AUTO


def parse_clip(spec: str) -> float | None:
    """The `--clip` bound: None (off), 0.0 for `auto` (from the received distances), or a
    positive norm bound; ValueError (one sentence) else."""
    if spec == CLIP_OFF:
        return None
    if spec == CLIP_AUTO:
        return 0.0
    try:
        bound = float(spec)
    except ValueError:
        bound = math.nan
    if not (math.isfinite(bound) and bound > 0):
        raise ValueError(f"--clip must be off, auto or a positive norm bound, got {spec!r}")
    return bound


def alie_z(senders: int, attackers: int) -> float:
    """The `alie` attack's z (A Little Is Enough, Baruch et al. 2019): how many standard
    deviations from the honest mean it may shift each value while staying inside the spread
    of the s = floor(n / 2 + 1) - m honest senders it needs a majority rule to count on its
    side, z = Phi^-1((n - s) / n), with s at least 1; 0 where it has no such margin."""
    needed = max(1, senders // 2 + 1 - attackers)
    if needed >= senders:
        return 0.0
    return max(0.0, statistics.NormalDist().inv_cdf((senders - needed) / senders))


def attackers(roster: list[str], count: int) -> list[str]:
    """The agents that poison what they send: the first `count` of the sorted roster."""
    return sorted(roster)[:count]
