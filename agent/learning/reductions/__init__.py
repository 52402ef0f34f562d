"""Every reduction in one table: how a round can be cut to a device's budget p_k
(ALGORITHMS.md 5), each kind's class in a file of its own.

Plain data without torch, so that `--help`, option parsing and config checks read the
`--reduce` modes in a fraction of a second; a kind's class (`base.ReductionKind`: its
levels, its FLOP rule, its training) is named by its import path and loaded only when a
round, a rule or a calibration needs it (`kind`), as `agent.learning.strategies` does for
strategies. The names the config, the rule and the calibration read (`REDUCE_MODES`,
`MODES_HELP`, `MEASURED_KINDS`, `MEASURED_MODES`, `CHANNEL_MODES`, `CALIBRATED`) are
derived from this table, never kept beside it: a new reduction is a file and a row here,
its own parameter carried in `Reduction.setting`, which only its class reads.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agent.learning.reductions.base import ReductionKind


@dataclass(frozen=True)
class Kind:
    """One reduction's record: what the config and the rule ask of it without torch."""

    name: str
    implementation: str
    """The import path of its `base.ReductionKind`, "module:Class"."""
    mode: bool = False
    """`--reduce NAME` chooses it (prune and freeze by counted FLOPs, the others by cost)."""
    summary: str = ""
    """What its mode does, for `--reduce`'s help."""
    measured: bool = False
    """It is chosen by the device's measured costs (`agent.learning.costs`), not counted
    FLOPs: its mode needs a cost table."""
    auto: int | None = None
    """Its place among `--reduce auto`'s choices (None: auto never takes it)."""
    calibrated: bool = True
    """The calibration measures rows of it (`agent.device.calibration`)."""
    sends_part: bool = False
    """A round it cuts publishes only what it trained (`ReductionKind.trainable`) where the
    wire sends whole models: the rest is what the agent had from its neighbours."""
    channel_masks: bool = False
    """Its mode budgets a model with channel masks (`--mask-unit channel`), whose cut then
    saves real time (`agent.learning.channels`)."""


TABLE: tuple[Kind, ...] = (
    Kind("none", "agent.learning.reductions.base:ReductionKind", calibrated=False),
    Kind(
        "prune",
        "agent.learning.reductions.prune:Prune",
        mode=True,
        summary="cap a sparse model's density: a FLOP and byte budget, the paper's",
        channel_masks=True,
    ),
    Kind(
        "freeze",
        "agent.learning.reductions.freeze:Freeze",
        mode=True,
        summary="train a fraction of the neurons, FedSPU-style",
        auto=0,
    ),
    Kind(
        "prefix",
        "agent.learning.reductions.prefix:Prefix",
        mode=True,
        summary="train a window of layers",
        measured=True,
        auto=2,
        sends_part=True,
    ),
    Kind(
        "width",
        "agent.learning.reductions.width:Width",
        mode=True,
        summary="train a narrower sub-model",
        measured=True,
        auto=1,
    ),
    Kind("channel", "agent.learning.reductions.channel:Channel", calibrated=False),
    Kind("checkpoint", "agent.learning.reductions.checkpoint:Checkpoint", measured=True),
)

NONE = "none"
"""The round trained whole, which no kind cuts: `base.ReductionKind` itself, whose cost is
the table's dense row."""

CHECKPOINT = "checkpoint"
"""Checkpointing the model's blocks, which the measured rule adds to any kind whose round
does not fit the memory at the configured batch (`reduction.measured_reduction`)."""

AUTO = "auto"
"""The mode that takes, of `MEASURED_KINDS`, the first that fits."""

REDUCE_MODES = (*(k.name for k in TABLE if k.mode), AUTO)
"""The `--reduce` choices, in the table's order."""

MEASURED_KINDS = tuple(
    k.name for k in sorted(TABLE, key=lambda k: k.auto or 0) if k.auto is not None
)
"""The reductions `auto` chooses among, least expected accuracy cost first: freezing trains
every layer a little (it fits only mild budgets: its weight gradients are a third of a
step); a narrower model trains every layer's rolling share of channels; a layer window
trains only the windows that fit, which at a low budget leaves the layers near the input
untrained on that device (studies/reduction_accuracy.py: at equal p_k width cost least on
digits, prefix on mnist1d; the order is a decision, easy to change)."""

MEASURED_MODES = (*(k.name for k in TABLE if k.mode and k.measured), AUTO)
"""The `--reduce` modes that choose by measured costs (the others by counted FLOPs)."""

_MODES = [k for k in TABLE if k.mode]
_AUTO = [k.name for k in _MODES if k.auto is not None]
MODES_HELP = (
    "How an agent cuts its round to its budget p_k: "
    + ", ".join(f"{k.name} ({k.summary})" for k in _MODES)
    + f" or {AUTO} (of {', '.join(_AUTO[:-1])} and {_AUTO[-1]}, what fits by measured cost)."
)
"""`--reduce`'s help: every mode with what it does."""

CHANNEL_MODES = tuple(k.name for k in TABLE if k.mode and k.channel_masks)
"""The `--reduce` modes that budget a model with channel masks."""

CALIBRATED = tuple(k.name for k in TABLE if k.calibrated)
"""Every kind a cost table can hold rows of: what a calibration measures by default."""

KINDS = {k.name: k for k in TABLE}


@functools.cache
def kind(name: str) -> ReductionKind:
    """The class of reduction `name`, imported (with torch) on first use; KeyError for a
    name the table does not hold."""
    module, _, attribute = KINDS[name].implementation.partition(":")
    implementation: type[ReductionKind] = getattr(importlib.import_module(module), attribute)
    return implementation()


def kinds() -> tuple[ReductionKind, ...]:
    """Every kind's class, in the table's order."""
    return tuple(kind(k.name) for k in TABLE)
