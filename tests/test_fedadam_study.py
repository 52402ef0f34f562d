"""studies/fedadam_study.py's accounting: the paper's uplink cost model (section VII-A) and the
uplink summed to a target accuracy, pinned on hand-worked numbers."""

from __future__ import annotations

import math

from studies.fedadam_study import paper_bits, to_target


def test_paper_cost_model_takes_the_cheaper_of_a_bitmap_and_log2_d_bit_indices() -> None:
    # d = 6138 (the digits cnn2d), k = round(0.05 d) = 307, q = 32, ceil(log2 d) = 13.
    d, k = 6138, 307
    ssm = paper_bits("fedadam-ssm", d, 0.05)
    top = paper_bits("fedadam-top", d, 0.05)
    assert ssm["paper"] == min(3 * k * 32 + d, k * (3 * 32 + 13)) == 33463
    assert top["paper"] == min(3 * (k * 32 + d), 3 * k * (32 + 13)) == 41445
    assert paper_bits("fedadam", d, 0.05) == {"paper": 3 * d * 32, "index32": 3 * d * 32}
    # with a 32-bit index per kept value one mask instead of three saves a third
    assert ssm["index32"] / top["index32"] == (3 * 32 + 32) / (3 * (32 + 32)) == 2 / 3


def test_uplink_to_target_sums_up_to_the_first_round_at_or_above_it() -> None:
    res = {
        "strategy": "fedadam-ssm",
        "params": 6138,
        "accuracy_per_round": [0.1, 0.5, 0.4, 0.7],
        "uplink_per_round": [100, 200, 300, 400],
        "agents_per_round": [2, 2, 2, 2],
    }
    hit = to_target(res, 0.5, 0.05)
    assert hit == {"rounds": 2, "bytes": 300, "paper": 4 * 33463 / 8, "index32": 4 * 39296 / 8}
    assert all(math.isinf(v) for v in to_target(res, 0.8, 0.05).values())
