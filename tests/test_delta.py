"""`--wire delta`: top-k deltas on what receivers hold, and their reconstruction."""

from __future__ import annotations

import pytest
import torch

from agent.learning import FLIP, Published, apply_delta, encode_delta
from agent.runtime import (
    Expected,
    Inbox,
    decode_state,
    expected_delta_shapes,
    expected_shapes,
    model_message,
)
from protocol import messages, topics


def model(seed: int, density: float = 0.5) -> Published:
    generator = torch.Generator().manual_seed(seed)
    weights = {
        "fc.weight": torch.randn(6, 8, generator=generator),
        "fc.bias": torch.randn(6, generator=generator),
    }
    mask = torch.rand(6, 8, generator=generator) < density
    weights["fc.weight"] = weights["fc.weight"] * mask
    return Published(weights, {"fc.weight": mask}, 10)


def test_the_largest_changes_among_kept_entries_are_sent() -> None:
    base, new = model(0), model(1)
    values, masks, _ = encode_delta(new, base, 0.25)
    kept = int(new.masks["fc.weight"].sum()) + 6
    sent = int(masks["fc.weight"].sum() + masks["fc.bias"].sum())
    assert sent == round(0.25 * kept)
    assert not (masks["fc.weight"] & ~new.masks["fc.weight"]).any(), "only kept entries"
    diff = {n: (new.weights[n] - base.weights[n]).abs() for n in new.weights}
    smallest_sent = min(diff[n][masks[n]].min() for n in new.weights if masks[n].any())
    unsent = max(
        diff["fc.weight"][new.masks["fc.weight"] & ~masks["fc.weight"]].max(),
        diff["fc.bias"][~masks["fc.bias"]].max(),
    )
    assert smallest_sent >= unsent


def test_mask_flips_travel_and_the_reconstruction_stays_masked() -> None:
    base, new = model(0), model(1)
    values, masks, recon = encode_delta(new, base, 0.1)
    changed = new.masks["fc.weight"] != base.masks["fc.weight"]
    assert torch.equal(masks[f"{FLIP}fc.weight"], changed)
    assert torch.equal(recon.masks["fc.weight"], new.masks["fc.weight"])
    assert (recon.weights["fc.weight"][~new.masks["fc.weight"]] == 0).all()


def test_what_is_not_sent_goes_out_later_until_the_copy_is_exact() -> None:
    base, target = model(0), model(1)
    recon = base
    for _ in range(10):  # 10% a round: every kept entry has been sent after ten rounds
        _, _, recon = encode_delta(target, recon, 0.1)
    for name, t in target.weights.items():
        assert torch.allclose(recon.weights[name], t, atol=1e-6), name


def test_at_fraction_one_the_copy_equals_the_model_up_to_rounding() -> None:
    base, new = model(0), model(1)
    _, _, recon = encode_delta(new, base, 1.0)
    for name, t in new.weights.items():
        assert torch.allclose(recon.weights[name], t, atol=1e-6, rtol=0)


@pytest.mark.parametrize("fp16", [False, True])
def test_receivers_rebuild_exactly_what_the_sender_keeps(fp16: bool) -> None:
    base, new = model(0), model(1)
    values, masks, recon = encode_delta(new, base, 0.3, fp16=fp16)
    data = model_message(
        fleet="f", sender="a", run_id="r", round_=2, weights=values, masks=masks,
        num_samples=10, fp16=fp16, base_round=1,
    )  # fmt: skip
    message = messages.decode(data)
    weights, got_masks = decode_state(
        message.tensors, expected_delta_shapes(new.weights, new.masks)
    )
    rebuilt = apply_delta(base, weights, got_masks, message.num_samples)
    for name in new.weights:
        assert torch.equal(rebuilt.weights[name], recon.weights[name]), name
    assert torch.equal(rebuilt.masks["fc.weight"], recon.masks["fc.weight"])


def test_a_bad_fraction_is_refused() -> None:
    with pytest.raises(ValueError, match="fraction"):
        encode_delta(model(1), model(0), 0.0)


def inbox(deltas: bool) -> Inbox:
    m = model(0)
    return Inbox(
        Expected(
            fleet="f",
            run_id="r",
            roster=frozenset({"a", "b"}),
            shapes=expected_shapes(m.weights),
            delta_shapes=expected_delta_shapes(m.weights, m.masks) if deltas else None,
        )
    )


def delta_message(round_: int, new: Published, base: Published) -> tuple[bytes, Published]:
    values, masks, recon = encode_delta(new, base, 0.2)
    data = model_message(
        fleet="f", sender="a", run_id="r", round_=round_, weights=values, masks=masks,
        num_samples=10, base_round=round_ - 1,
    )  # fmt: skip
    return data, recon


def test_deltas_arriving_before_their_base_are_applied_once_it_is_here() -> None:
    box = inbox(deltas=True)
    m0, m1, m2 = model(0), model(1), model(2)
    first, recon1 = delta_message(1, m1, m0)
    second, recon2 = delta_message(2, m2, recon1)
    box.on_model(topics.round_topic("f", 2, "model", "a"), second)
    box.on_model(topics.round_topic("f", 1, "model", "a"), first)
    assert box.model(2, "a") is None, "no base yet"
    box.put_model(0, "a", m0)
    for round_, want in ((1, recon1), (2, recon2)):
        got = box.model(round_, "a")
        assert got is not None
        assert all(torch.equal(got.weights[n], want.weights[n]) for n in want.weights)


def test_a_delta_in_a_run_of_whole_models_is_rejected() -> None:
    box = inbox(deltas=False)
    data, _ = delta_message(1, model(1), model(0))
    box.on_model(topics.round_topic("f", 1, "model", "a"), data)
    box.put_model(0, "a", model(0))
    assert box.model(1, "a") is None
    assert box.rejected == 1
