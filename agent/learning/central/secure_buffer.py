"""FedBuff under secure aggregation (`--strategy fedbuff --secure-aggregation`), the math of a
cohort around the cryptography: buffered secure aggregation.

The buffer of K updates becomes a cohort of K devices that runs one secure sum (SecAgg+,
`protocol.secagg`). Cohort c makes version c: a device whose update is ready (trained from
version b) joins the open cohort, the one after the newest version it holds; the
coordinator closes it once K devices joined and runs the secure steps with them. A device
that finds the cohort closed without it joins the next one with the same update, a version
staler, or drops it past `--max-staleness`, as the plain buffer does. Every member knows
the version the server will be at when its cohort applies (c - 1), so it knows its update's
staleness s = c - 1 - b and masks its staleness-weighted delta

    w(s) (y - x_b)                                  (`member_change`)

itself, against the version it trained from, which it holds. The ring gives the
coordinator the sum over the survivors U3 and nothing else; FedBuff's step divides it by
their number (the plain rule's K, over those whose update the sum holds:
`fedbuff.Buffer.apply_summed`):

    x_c = x_{c-1} + (1 / |U3|) sum_{U3} w(s_i) (y_i - x_{b_i})

which is the plain buffer's version from the same updates, within the ring's quantization
(`protocol.secagg.quantization_bound`). A cohort needs `MIN_COHORT` (3) members, and as many
survivors for its sum to count: a member learns the sum of the others' updates from the
version its cohort makes (it knows its own), which for two is the other's update. Each
member advertises weight 1 (FedBuff's mean is unweighted): the ring scales its vector by
1/|U1| and the survivor mean undoes it.
"""

from __future__ import annotations

import numpy as np

from agent.learning.buffering import MIN_COHORT
from agent.learning.central.base import Payload, ServerState
from agent.learning.central.secure import flat_change, unflattened
from agent.learning.sparse import State
from agent.learning.staleness import staleness_weight

MEMBER_WEIGHT = 1
"""What each member advertises as its weight in the sum: FedBuff's mean is unweighted."""


def member_change(
    names: list[str], upload: Payload, base: ServerState, staleness: int, rule: str
) -> np.ndarray:
    """What a member of a cohort masks: its update's delta from the version it trained from
    (`base`), flattened over `names` (`central.secure.summed_names`), times the staleness
    weight of `staleness` versions under `rule` (`--staleness-weight`)."""
    return staleness_weight(staleness, rule) * flat_change(names, upload, base)


def cohort_sum(
    names: list[str], like: State, survivor_mean: np.ndarray, survivors: int
) -> ServerState | None:
    """The sum of what the `survivors` masked, as the buffer applies it
    (`fedbuff.Buffer.apply_summed`), from the ring's mean over them
    (`protocol.secagg.survivor_mean`, each of weight `MEMBER_WEIGHT`), shaped as `like`.
    None below `MIN_COHORT` survivors: each would learn the other's update from the version
    (it knows its own), so the version keeps the model, as a cohort whose sum failed."""
    if survivors < MIN_COHORT:
        return None
    return ServerState(unflattened(names, like, survivor_mean * survivors))
