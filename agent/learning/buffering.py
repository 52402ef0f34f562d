"""How many updates make a FedBuff version (K, `--buffer-size`), and under secure aggregation
how few devices a cohort may have (`agent.learning.central.secure_buffer`). Torch-free: plain
numbers, so that the config checks (`agent.experiment`), the buffer, the coordinator and the
simulator share them without loading torch.
"""

from __future__ import annotations

import math

AUTO_BUFFER_FRACTION = 3
"""`--buffer-size 0` (auto): K is a third of the fleet, at least 1."""
MIN_COHORT = 3
"""Under `--secure-aggregation` K is at least 3 (`central.secure_buffer`): a member of a cohort of K
learns the sum of the other K - 1 updates (the version its cohort makes, less its own);
with K = 2 that is the other member's update itself."""


def buffer_size(configured: int, agents: int, secure: bool = False) -> int:
    """K for a fleet of `agents`: the configured size, or (0, auto) a third of the fleet,
    and under secure aggregation (`secure`) at least `MIN_COHORT`.

    A third keeps updates of devices of equal speed about 2-3 versions stale (each pass of
    the fleet makes about three versions), well inside the default `--max-staleness` 5 and
    where the polynomial weight is still 0.5-0.6, from 5 devices (K = 2) to 100 (K = 34); a
    fixed K of the paper's 10 would make a 5-device fleet wait for two passes per version
    and leave a 100-device fleet's updates ten versions stale, past the bound."""
    if configured > 0:
        return configured
    auto = max(1, math.ceil(agents / AUTO_BUFFER_FRACTION))
    return max(auto, MIN_COHORT) if secure else auto
