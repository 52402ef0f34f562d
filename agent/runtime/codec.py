"""Between torch state dicts and protocol messages: what an agent actually puts on the wire.

The simulator counts bytes with the same encoder the networked agent sends with, so reported
traffic is the size of real messages, not an estimate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch

from agent.learning import FLIP, Masks, State
from agent.learning.central import CentralStrategy, Layout, Payload, model_layout
from protocol import DEFAULT_LIMITS, Limits, ProtocolError, decode_tensors, encode_tensors, messages
from protocol.signing import Signer

if TYPE_CHECKING:
    from agent.learning.model_facts import ModelFacts

Shapes = dict[str, tuple[tuple[int, ...], str]]
"""Tensor name -> (shape, wire dtype name), what `decode_state` checks a message against."""


def encode_state(weights: State, masks: Masks | None = None, *, fp16: bool = False) -> bytes:
    """Encode weights, sending only the kept values of each masked tensor."""
    arrays = {name: tensor.detach().cpu().numpy() for name, tensor in weights.items()}
    mask_arrays = {name: mask.cpu().numpy() for name, mask in (masks or {}).items()}
    return encode_tensors(arrays, mask_arrays, fp16=fp16)


def decode_state(
    data: bytes,
    expected: Mapping[str, tuple[tuple[int, ...], str]] | None,
    *,
    limits: Limits = DEFAULT_LIMITS,
    partial: bool = False,
) -> tuple[State, Masks]:
    """Decode weights and the sender's masks, checked against the agreed model's shapes
    (None: a layout whose sizes the caller checks after decoding, within `limits`); with
    `partial`, a message may hold only some of them."""
    decoded = decode_tensors(
        data, limits=limits, expected=expected, require_finite=True, partial=partial
    )
    weights = {name: torch.from_numpy(t.values) for name, t in decoded.items()}
    masks = {name: torch.from_numpy(t.mask) for name, t in decoded.items() if t.mask is not None}
    return weights, masks


def values_sent(weights: State, masks: Masks | None = None) -> int:
    """How many values `encode_state(weights, masks)` carries: the kept entries of masked
    tensors, every entry of the others."""
    masks = masks or {}
    return sum(int(masks[n].sum()) if n in masks else t.numel() for n, t in weights.items())


def all_finite(weights: State) -> bool:
    """Whether every value is finite: receivers decode models with `require_finite`, so a
    diverged model is not worth sending."""
    return all(bool(torch.isfinite(w).all()) for w in weights.values())


def expected_shapes(weights: State) -> Shapes:
    """The (shape, dtype) of every tensor of a model, for `decode_state`'s validation."""
    return wire_shapes(model_layout(weights))


def wire_shapes(layout: Layout) -> Shapes:
    """A strategy's payload layout in the wire's terms (numpy dtype names)."""
    return {
        name: (shape, str(np.dtype(str(dtype).removeprefix("torch."))))
        for name, (shape, dtype) in layout.items()
    }


def delta_names(weights: State, masks: Masks | None) -> dict[str, str]:
    """Payload name -> model tensor name of a delta message: every tensor's delta, and each
    masked tensor's mask flips."""
    names = {n: n for n in weights}
    names |= {f"{FLIP}{n}": n for n in masks or {}}
    return names


def expected_delta_shapes(
    weights: State, masks: Masks | None
) -> dict[str, tuple[tuple[int, ...], str]]:
    """The (shape, dtype) of every tensor of a delta message (`agent.learning.delta`)."""
    shapes = expected_shapes(weights)
    return {
        name: shapes[tensor] if name == tensor else (shapes[tensor][0], "bool")
        for name, tensor in delta_names(weights, masks).items()
    }


def model_message(
    *,
    fleet: str,
    sender: str,
    run_id: str,
    round_: int,
    weights: State,
    masks: Masks | None,
    num_samples: int,
    fp16: bool = False,
    key: Signer | None = None,
    base_round: int = -1,
) -> bytes:
    """The `Model` message an agent publishes after a round: its full model, or with
    `base_round` >= 0 a delta on the model of that round (`agent.learning.delta`)."""
    body = encode_state(weights, masks, fp16=fp16)
    message = messages.Model(
        fleet=fleet,
        sender=sender,
        run_id=run_id,
        round=round_,
        tensors=body,
        num_samples=num_samples,
        base_round=base_round,
    )
    return messages.encode(message, key=key)


def divergence_message(
    *,
    fleet: str,
    sender: str,
    run_id: str,
    round_: int,
    divergence: Mapping[str, float],
    key: Signer | None = None,
) -> bytes:
    """The `Divergence` message carrying a FedLDF divergence vector (layer -> value)."""
    message = messages.Divergence(
        fleet=fleet,
        sender=sender,
        run_id=run_id,
        round=round_,
        layers=list(divergence),
        values=list(divergence.values()),
    )
    return messages.encode(message, key=key)


def decode_upload(
    strategy: CentralStrategy, facts: ModelFacts, data: bytes, layers: list[str] | None = None
) -> Payload:
    """A participant's upload (only `layers` of it, FedLDF) as the aggregator decodes it,
    validated; ProtocolError if malformed."""
    return _decode_payload(strategy, facts, data, strategy.upload_layout(facts, layers))


def decode_download(strategy: CentralStrategy, facts: ModelFacts, data: bytes) -> Payload:
    """A participant's own part of the global model (the FedSPU family), validated."""
    return _decode_payload(strategy, facts, data, strategy.upload_layout(facts))


def decode_broadcast(strategy: CentralStrategy, facts: ModelFacts, data: bytes) -> Payload:
    """A round's broadcast as a participant decodes it, validated."""
    return _decode_payload(strategy, facts, data, strategy.broadcast_layout(facts))


def _decode_payload(
    strategy: CentralStrategy, facts: ModelFacts, data: bytes, layout: Layout | None
) -> Payload:
    """A payload off the wire, validated; ProtocolError if it is not what `layout` (or, where
    it is None, the strategy's `check_payload`) says. Without a layout the decoder still
    refuses, before allocating, more values than three models' worth."""
    size = sum(t.numel() for t in facts.initial.values())
    limits = dataclasses.replace(DEFAULT_LIMITS, max_total_elements=3 * size)
    shapes = None if layout is None else wire_shapes(layout)
    weights, masks = decode_state(data, shapes, limits=limits)
    if layout is None:
        try:
            strategy.check_payload(facts, Payload(weights, masks or None))
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None
    # The model's order, whatever the sender's: aggregation sums in one fixed order.
    order = {name: i for i, name in enumerate(strategy.payload_order(facts))}
    weights = dict(sorted(weights.items(), key=lambda item: order[item[0]]))
    return Payload(weights, masks or None)
