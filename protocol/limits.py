"""Size limits that decoders check before they allocate anything, and the tight ones a run's
model implies.

The defaults fit models up to a few hundred million parameters, so they bound little: a
receiver that knows the run's model knows that no legitimate message exceeds the model's dense
encoding (a delta or a layer is smaller), and `limits_for_shapes` turns that into limits a
transport applies once the run is known (`MqttTransport.set_limits`). Until then an agent
needs no more than `PRE_RUN_LIMITS`: nothing it receives before its run is chunked, and a
connection that only follows the fleet never needs more (`FOLLOWER_LIMITS`). The bounds on a
fleet's size and on waits, which options and followers share, are here too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

KIB = 1 << 10
MIB = 1 << 20
WEEK_S = 7 * 86_400.0
"""The longest wait or timeout an option takes: longer ones are typos, not plans."""
MAX_MEMBERS = 10_000
"""The most members a fleet has: the largest roster a run may name, and how many members a
follower (`coordinator status`, `run` while it gathers its roster) keeps track of, so that
statuses under ever new names cannot grow it without end."""
MAX_ROUNDS = 100_000
"""The most rounds a run has: a run option beyond it is a typo, and a member's status
naming a later round no status of a real run."""


@dataclass(frozen=True)
class Limits:
    """Upper bounds on what a receiver accepts from the wire and holds for it.

    The defaults fit models up to a few hundred million parameters; a deployment with
    smaller devices can tighten them so a hostile peer cannot make an agent allocate
    more memory than it has.
    """

    max_message_bytes: int = 1 << 31
    max_tensors: int = 4096
    max_tensor_elements: int = 1 << 28
    max_total_elements: int = 1 << 29
    max_ndim: int = 8
    max_name_length: int = 256
    max_chunks: int = 1 << 16
    max_partial_bytes: int = 1 << 29
    """Payload bytes all incomplete (chunked) messages together may hold."""
    max_partials: int = 256
    """Incomplete messages at once, however small: each costs bookkeeping besides its bytes."""
    max_partials_per_source: int = 4
    """Incomplete messages one source (an MQTT topic) may have at once: a sender publishes
    its messages on a topic one after the other, a re-send at most overlapping the original."""
    max_queued_messages: int = 4096
    """Whole messages waiting for their handlers (the transport's delivery queue)."""
    max_queued_bytes: int = 1 << 30
    """Bytes of the whole messages waiting for their handlers."""
    max_num_samples: int = 10_000_000
    """The largest `num_samples` a model or update may claim: FedAvg weighs by it, and one
    hostile value would otherwise outweigh the whole fleet."""

    def samples_problem(self, num_samples: int) -> str | None:
        """Why a model or update claiming `num_samples` is refused, or None: it must weigh
        at least one sample and at most `max_num_samples`."""
        if 1 <= num_samples <= self.max_num_samples:
            return None
        return f"num_samples {num_samples:,} outside 1..{self.max_num_samples:,}"


DEFAULT_LIMITS = Limits()

PRE_RUN_LIMITS = Limits(
    max_message_bytes=1 * MIB,
    max_partial_bytes=4 * MIB,
    max_partials=16,
    max_queued_bytes=16 * MIB,
)
"""An agent's limits before its run is known (presence, statuses, the run: single frames)."""

FOLLOWER_LIMITS = PRE_RUN_LIMITS
"""The limits of a connection that only follows the fleet: `coordinator serve`, `status`,
`cancel`, `forget`, the dashboard's feed, and `coordinator run` until its run needs models
(the aggregator of a centralized run raises them to `run_limits` for the run's duration).
What it reads (presence, statuses, runs, votes, telemetry) is one frame each: a retained
message must be, and the others are small. So a first chunk declaring more than 1 MiB is
refused on its header, and no sender can make one such connection hold more than
`held_bytes(FOLLOWER_LIMITS)` (21 MiB) of what it sent, however long it floods.

So no sender can make `coordinator serve --http` (two such connections: its own and the
dashboard's) grow by more than 2 x 21 MiB through its connections, plus the allocator's
slack: 66 MiB in all (tests/test_bounded_memory.py floods it). Two things come on top: a
packet is read whole before its frame is checked, so the broker's packet limit bounds what
one packet costs (mosquitto as `broker-config` writes it: 1 MiB; MQTT itself: 256 MB); and
what the gateway keeps per member (its latest presence and status) for every name statuses
arrive under, which signing or a cap on members bounds."""


def held_bytes(limits: Limits) -> int:
    """The most a transport under `limits` holds of what others sent, in payload bytes:
    partial reassembly, the delivery queue, and the one whole message being joined from its
    chunks. What decoding a message costs, and what a handler keeps of it, comes on top."""
    return limits.max_partial_bytes + limits.max_queued_bytes + limits.max_message_bytes


MODEL_MARGIN = 1.5
"""A model message may exceed the model's dense encoding by this factor (envelope, masks in
their worst encoding, a signature)."""
HEADROOM_BYTES = 1 * MIB
"""Added to every model-derived message limit: covers the messages that are not models
(run, statuses, votes, requests: each fits one frame) for however small a model."""
CONCURRENT_MESSAGES = 4
"""Whole messages' worth of partial reassembly and of delivery queue a model-derived limit
allows: several neighbours' models arrive interleaved at the end of a round."""
_TENSOR_OVERHEAD = 64
"""Per tensor: its msgpack header (dtype, shape, mask kind, lengths) besides name and data."""
_ITEMSIZE = {"bool": 1, "float16": 2, "float64": 8, "int64": 8, "uint64": 8}


def dense_model_bytes(shapes: Mapping[str, tuple[tuple[int, ...], str]]) -> int:
    """An upper bound of a whole dense model's encoding: every value in its dtype, a bitmap
    mask (the largest mask encoding the codec picks: it takes the smallest), names, headers."""
    total = 0
    for name, (shape, dtype) in shapes.items():
        values = math.prod(shape)
        itemsize = _ITEMSIZE.get(dtype, 4 if dtype.endswith("32") else 2)
        total += values * itemsize + -(-values // 8) + len(name.encode()) + _TENSOR_OVERHEAD
        total += 9 * len(shape)
    return total


def limits_for_shapes(
    shapes: Mapping[str, tuple[tuple[int, ...], str]],
    *,
    margin: float = MODEL_MARGIN,
    headroom: int = HEADROOM_BYTES,
    concurrent: int = CONCURRENT_MESSAGES,
    base: Limits = DEFAULT_LIMITS,
) -> Limits:
    """`base` tightened to the run's model (`shapes`: tensor name -> (shape, dtype name), as
    `agent.runtime.codec.expected_shapes` gives them): a message may be the model's dense
    encoding x `margin` + `headroom`; partial reassembly and the delivery queue hold
    `concurrent` such messages. Never looser than `base`. The agent's memory for what peers
    send is then bounded by about 2 x concurrent x max_message_bytes plus what its inbox
    keeps (whole decoded models, a window of rounds)."""
    if margin < 1 or headroom < 0 or concurrent < 1:
        raise ValueError("margin must be >= 1, headroom >= 0 and concurrent >= 1")
    message = math.ceil(dense_model_bytes(shapes) * margin) + headroom
    message = min(message, base.max_message_bytes)
    return dataclasses.replace(
        base,
        max_message_bytes=message,
        max_partial_bytes=min(base.max_partial_bytes, concurrent * message),
        max_queued_bytes=min(base.max_queued_bytes, concurrent * message),
    )


def run_limits(shapes: Mapping[str, tuple[tuple[int, ...], str]], roster_size: int) -> Limits:
    """An agent's limits during a run: its model's (`limits_for_shapes`), with room for as
    many whole messages at once as the roster has members (each may be sending)."""
    return limits_for_shapes(shapes, concurrent=max(CONCURRENT_MESSAGES, roster_size))
