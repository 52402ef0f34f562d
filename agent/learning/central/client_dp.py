"""Client-level differential privacy of a centralized round (`--dp client`): DP-FedAvg with
fixed clipping (McMahan et al. 2018; Flower's DifferentialPrivacyClientSideFixedClipping).

Each participant clips its update, the model it uploads minus the global model it trained
from, to L2 norm C (`--dp-clip`) on the device (`clipped_fit`), so one device moves the sum
of the round's updates by at most C whatever its data; the aggregator adds Gaussian noise
N(0, sigma^2 C^2) (sigma: `--dp-noise`) to that sum before dividing it by the count of
participants (`noised_sum`, `noised_aggregate`). The mean is unweighted: a sample-count
weight would let one device's weight (and so its sensitivity) grow without bound, so the
run's `--aggregation` must be the default `screened` (one weight each) with `--clip off`
(checked in `agent.experiment`). Clipping on the device is what lets the noise move to the
devices under secure aggregation, where the aggregator never sees an update: each adds its
share `noise_share`, N(0, sigma^2 C^2 / n) for n expected participants, and the shares sum
to the same noise (`agent.learning.central.secure_dp`).

The accountant (`agent.learning.privacy.Accountant`, dp-accounting's RDP accountant) counts
one Gaussian event per round a device uploaded in (its `dp_steps`); every running agent takes
part in every round (edgefl samples no clients), so the sampling rate is 1.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import torch

from agent.learning.central.base import (
    Aggregate,
    CentralStrategy,
    Fit,
    Payload,
    ServerState,
    Upload,
)
from agent.learning.config import DP_CLIENT, StrategyConfig
from agent.learning.model_facts import ModelFacts
from agent.learning.sparse import Masks, State

NOISE_PURPOSE = "client-dp"
"""The aggregator's noise generator is seeded by (fleet seed, this, "aggregator", round), so
the simulator and the coordinator draw the same noise for the same round."""


def held(payload: Payload) -> Masks:
    """The entries a payload carries: its masks (FedSPU's active part), all of a tensor it
    sends whole."""
    masks = payload.masks or {}
    return {
        n: masks[n] if n in masks else torch.ones_like(t, dtype=torch.bool)
        for n, t in payload.weights.items()
    }


def update_norm(payload: Payload, reference: State) -> float:
    """The L2 norm of an upload's update: its floating entries minus `reference`'s, over the
    entries it carries."""
    squares = 0.0
    carried = held(payload)
    for name, t in payload.weights.items():
        if torch.is_floating_point(t):
            diff = (t.double() - reference[name].double()) * carried[name]
            squares += float(diff.pow(2).sum())
    return math.sqrt(squares)


def clip_update(payload: Payload, reference: State, clip: float) -> Payload:
    """`payload` with its update (`update_norm`) scaled down to norm `clip` where longer:
    reference + (upload - reference) x min(1, C / norm) on the entries it carries, the rest
    as it was. The device's side of DP-FedAvg."""
    norm = update_norm(payload, reference)
    if norm <= clip:
        return payload
    scale = clip / norm
    carried = held(payload)
    weights = {}
    for name, t in payload.weights.items():
        if not torch.is_floating_point(t):
            weights[name] = t
            continue
        ref = reference[name].to(t.dtype)
        weights[name] = torch.where(carried[name], ref + (t - ref) * scale, t)
    return Payload(weights, payload.masks)


def clipped_fit(config: StrategyConfig, fit: Fit, view: ServerState) -> Fit:
    """Under `--dp client`: the participant's fit with its upload clipped around the global
    model it trained from (`view`), and one more release counted by its accountant (its
    `dp_steps`); as it is otherwise."""
    if config.dp != DP_CLIENT:
        return fit
    upload = clip_update(fit.upload, view.weights, config.dp_clip)
    state = dataclasses.replace(fit.state, dp_steps=fit.state.dp_steps + 1)
    return dataclasses.replace(fit, upload=upload, state=state)


def gaussian(like: State, std: float, generator: torch.Generator) -> State:
    """Independent N(0, std^2) noise shaped as each floating tensor of `like` (in its order),
    drawn in fp32 on the CPU from `generator`, so every process draws the same."""
    return {
        n: torch.normal(0.0, std, t.shape, generator=generator).to(t.dtype)
        for n, t in like.items()
        if torch.is_floating_point(t)
    }


def noised_sum(summed: State, noise: float, clip: float, generator: torch.Generator) -> State:
    """The sum of the round's clipped updates with Gaussian noise N(0, sigma^2 C^2) added to
    each entry (sigma = `noise`, C = `clip`): the aggregator's release of DP-FedAvg."""
    drawn = gaussian(summed, noise * clip, generator)
    return {n: t + drawn[n] if n in drawn else t for n, t in summed.items()}


def noise_share(
    like: State, noise: float, clip: float, expected: int, generator: torch.Generator
) -> State:
    """One device's share of the round's noise under secure aggregation: N(0, sigma^2 C^2 / n)
    for `expected` (n) participants, added to its clipped update before masking, so that the
    n shares sum to the N(0, sigma^2 C^2) the aggregator would add (fewer participants than
    expected leave less noise: n should be the fewest a round may close with). `generator`
    must be the device's secret (seeded from `secrets`, not the fleet seed): a share the
    aggregator could draw again, it could subtract."""
    return gaussian(like, noise * clip / math.sqrt(max(expected, 1)), generator)


def update_sums(
    reference: State, uploads: Mapping[str, Upload]
) -> tuple[State, dict[str, torch.Tensor]]:
    """The sum of the uploads' updates (each minus `reference`, in float64, over the entries
    it carries) per floating tensor, and per entry how many uploads carried it."""
    sums: State = {}
    counts: dict[str, torch.Tensor] = {}
    for upload in uploads.values():
        carried = held(upload.payload)
        for name, t in upload.payload.weights.items():
            if not torch.is_floating_point(t):
                continue
            diff = (t.double() - reference[name].double()) * carried[name]
            sums[name] = sums[name] + diff if name in sums else diff
            counts[name] = counts.get(name, torch.zeros(t.shape)) + carried[name]
    return {n: sums[n] for n in reference if n in sums}, counts


def noised_aggregate(
    facts: ModelFacts,
    server: ServerState,
    aggregate: Aggregate,
    uploads: Mapping[str, Upload],
    round_: int,
) -> Aggregate:
    """The strategy's `aggregate` of the clipped `uploads` with each entry anyone carried
    replaced by the server's value plus the noised sum of the updates (`noised_sum`) over
    the count that carried it: the unweighted mean, noised before the division (the
    strategy's own mean under `--aggregation screened`, `--clip off`). The rest (entries
    nobody carried, integer tensors) is the strategy's; so is the broadcast's form."""
    sums, counts = update_sums(server.weights, uploads)
    generator = facts.generator(NOISE_PURPOSE, "aggregator", round_)
    noised = noised_sum(sums, facts.config.dp_noise, facts.config.dp_clip, generator)
    weights = dict(aggregate.server.weights)
    for name, total in noised.items():
        count, reference = counts[name], server.weights[name]
        mean = reference.double() + total / count.clamp(min=1)
        weights[name] = torch.where(count > 0, mean, weights[name].double()).to(reference.dtype)
    broadcast = Payload(weights) if aggregate.broadcast.weights else aggregate.broadcast
    return Aggregate(dataclasses.replace(aggregate.server, weights=weights), broadcast)


def aggregate(
    strategy: CentralStrategy,
    facts: ModelFacts,
    server: ServerState,
    uploads: Mapping[str, Upload],
    round_: int,
) -> Aggregate:
    """The aggregator's round: the strategy's `aggregate`, and under `--dp client` of the
    uploads clipped again around the server's model (an honest device's update is within
    the clip already; one that skipped it moves the mean no more than the others), noised
    (`noised_aggregate`). With secure aggregation the aggregator sees no single update to
    clip: the devices clipped and noised theirs (`secure_dp`), and the one upload, the secure
    sum's mean, is taken as it is."""
    if facts.config.dp != DP_CLIENT or facts.config.secure_aggregation:
        return strategy.aggregate(facts, server, uploads)
    clip = facts.config.dp_clip
    bounded = {
        k: dataclasses.replace(u, payload=clip_update(u.payload, server.weights, clip))
        for k, u in uploads.items()
    }
    combined = strategy.aggregate(facts, server, bounded)
    return noised_aggregate(facts, server, combined, bounded, round_)
