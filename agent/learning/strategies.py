"""Every strategy in one table: its name, its family, the class that computes its rounds,
its preset, the traits the rest of the code asks of it and the options it reads.

Plain data without torch (it imports only `agent.user_code`, itself torch-free), so that
`--help`, option parsing and config checks read it in a fraction of a second; the class of a
strategy is named by its import path and loaded only when a round needs it (`implementation`).

A user's own strategy is named like a model, by its class's import path (``mypkg.mod:Class``
or ``./file.py:Class``, `user_code`); its record is read from the class (`user_strategy`),
so it is imported (with torch) as soon as a run names it. The
constants the config and the options expose (`DECENTRALIZED`, `CENTRALIZED`, `ADAM_FAMILY`,
`PRESETS`, `FLAG_SCOPES`, ...) are derived from this table, never kept beside it, and code
asks a strategy's record for a trait rather than comparing its name.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from agent.user_code import is_import_path, load_callable, source_fingerprint

CENTRAL = "centralized"
"""A coordinator aggregates what participants upload (`agent.learning.central`)."""
DECENTRAL = "decentralized"
"""Agents aggregate their neighbours' models, without a server (`agent.learning.decentral`)."""
LOCAL = "local"
"""Each agent trains alone and exchanges nothing (the baseline every strategy must beat)."""


@dataclass(frozen=True)
class Strategy:
    """One strategy's record: what the code asks of it instead of its name."""

    name: str
    family: str
    """CENTRAL, DECENTRAL or LOCAL: who aggregates, if anyone."""
    implementation: str
    """The import path of the class that computes its rounds, "module:Class"."""
    fixed: Mapping[str, Any] = field(default_factory=dict)
    """Config values its preset fixes: what defines the method (an override that contradicts
    one is an error, `preset`)."""
    defaults: Mapping[str, Any] = field(default_factory=dict)
    """Config defaults of its preset that a run may override."""
    options: frozenset[str] = frozenset()
    """The options of `SCOPES` it reads; given to a strategy that does not read one, it is
    an error (`Scope.applies`)."""
    sparse: bool = False
    """Each agent trains a sparse model under its own mask (ERK-drawn, moved by RigL)."""
    prunes_further: bool = False
    """Agents vote on the pruning time (pruning-time detection) and prune further (PQI) at
    the voted times; its rounds publish votes."""
    adam: bool = False
    """The FedAdam family: local Adam with moments of its own, kept on the CPU."""
    budgets: bool = False
    """Its rounds are cut to the agent's budget p_k: a sparse model's density or a share of
    its neurons (`--reduce`), or FedSPU's active fraction. The others train the full model
    whatever a device affords, so their records, logs and screens carry no p_k."""
    client_dp: bool = False
    """`--dp client` applies: it uploads models (or parts of them) trained from the server's,
    which each device clips around the server's and the aggregator averages unweighted, with
    noise (`agent.learning.central.client_dp`)."""
    buffered: bool = False
    """Asynchronous buffered aggregation (FedBuff): participants train whenever they can and
    the server applies every `--buffer-size` updates as they arrive, each weighted by its
    staleness (`agent.learning.central.fedbuff`); its runs go by versions, not rounds."""
    secure_sum: bool = False
    """`--secure-aggregation` applies: its round is a weighted mean over an index set agreed
    before masking, which the coordinator can take from the masked sum alone
    (`protocol.secagg`, `central.secure`): of whole models; per entry over the parts it chose
    and sent each device (FedSPU, federated dropout) or the layers it asked each for (FedLDF,
    from divergence vectors sent in the clear); of Adam's three deltas, over the union of the
    devices' top-k masks, sent before masking, for FedAdam-Top and -SSM; (FedBuff) of a
    cohort's staleness-weighted deltas (`central.secure_buffer`). Not FedBuff-SSM, whose
    buffered versions carry Adam's moments."""

    @property
    def centralized(self) -> bool:
        return self.family == CENTRAL

    @property
    def decentralized(self) -> bool:
        return self.family == DECENTRAL

    @property
    def alone(self) -> bool:
        """Its agents train alone: no neighbours, nothing sent, its model the local one."""
        return self.family == LOCAL

    @property
    def votes_signs(self) -> bool:
        """`--aggregation signs` applies: it votes on the steps of models trained from one
        global model, which the centralized strategies' uploads are, but the Adam family's
        (whose moments move the global model, not the steps) are not."""
        return self.centralized and not self.adam


_SGD = frozenset({"optimizer"})
"""The options of every strategy that trains with the local SGD (`--optimizer`)."""
_DECENTRAL = _SGD | {"wire"}
_SPARSE = _DECENTRAL | {"reduce"}
_ADAM = {"lr": 1e-3, "lr_decay": 1.0}  # ALGORITHMS.md 3: Adam at lr 1e-3
_NEVER_WAITS = {"max_wait": 0}

TABLE: tuple[Strategy, ...] = (
    Strategy(
        "dadpfl",
        DECENTRAL,
        "agent.learning.decentral.dadpfl:DADPFL",
        options=_SPARSE | {"detection_scale", "detection_distance"},
        sparse=True,
        prunes_further=True,
        budgets=True,
    ),
    Strategy(
        "dispfl",
        DECENTRAL,
        "agent.learning.decentral.dispfl:DisPFL",
        fixed=_NEVER_WAITS,
        options=_SPARSE,
        sparse=True,
        budgets=True,
    ),
    Strategy(
        "dfedavgm",
        DECENTRAL,
        "agent.learning.decentral.dfedavgm:DFedAvgM",
        fixed={**_NEVER_WAITS, "momentum": 0.9},
        options=_DECENTRAL,
    ),
    Strategy("local", LOCAL, "agent.learning.decentral.local:Local", options=_SGD),
    Strategy(
        "fedavg",
        CENTRAL,
        "agent.learning.central.fedavg:FedAvg",
        options=_SGD,
        client_dp=True,
        secure_sum=True,
    ),
    Strategy(
        "fedavg-ft",
        CENTRAL,
        "agent.learning.central.fedavg:FedAvgFineTuned",
        options=_SGD,
        client_dp=True,
        secure_sum=True,
    ),
    Strategy(
        "fedspu",
        CENTRAL,
        "agent.learning.central.fedspu:FedSPU",
        options=_SGD,
        budgets=True,
        client_dp=True,
        secure_sum=True,
    ),
    Strategy(
        "feddrop",
        CENTRAL,
        "agent.learning.central.fedspu:FedDropout",
        options=_SGD,
        budgets=True,
        client_dp=True,
        secure_sum=True,
    ),
    Strategy(
        "fedadam",
        CENTRAL,
        "agent.learning.central.fedadam:FedAdam",
        defaults=_ADAM,
        adam=True,
        secure_sum=True,
    ),
    Strategy(
        "fedadam-top",
        CENTRAL,
        "agent.learning.central.fedadam:FedAdamTop",
        defaults=_ADAM,
        options=frozenset({"ssm_fraction"}),
        adam=True,
        secure_sum=True,
    ),
    Strategy(
        "fedadam-ssm",
        CENTRAL,
        "agent.learning.central.fedadam:FedAdamSSM",
        defaults=_ADAM,
        options=frozenset({"ssm_fraction"}),
        adam=True,
        secure_sum=True,
    ),
    Strategy(
        "fedbuff",
        CENTRAL,
        "agent.learning.central.fedbuff:FedBuff",
        options=_SGD | {"buffer_size", "staleness_weight", "max_staleness"},
        buffered=True,
        client_dp=True,
        secure_sum=True,
    ),
    Strategy(
        "fedbuff-ssm",
        CENTRAL,
        "agent.learning.central.fedbuff_ssm:FedBuffSSM",
        defaults=_ADAM,
        options=frozenset({"ssm_fraction", "buffer_size", "staleness_weight", "max_staleness"}),
        adam=True,
        buffered=True,
    ),
    Strategy(
        "fedldf",
        CENTRAL,
        "agent.learning.central.fedldf:FedLDF",
        options=_SGD | {"ldf_n"},
        secure_sum=True,
    ),
)
"""The strategies, in the order help texts and `PRESETS` list them."""

STRATEGIES: Mapping[str, Strategy] = MappingProxyType({s.name: s for s in TABLE})


def strategy(name: str) -> Strategy:
    """The record of strategy `name`, or of the user's class it names (MODULE:CLASS,
    ./FILE.py:CLASS); ValueError naming the known ones otherwise."""
    if is_import_path(name):
        return user_strategy(name).record
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}") from None


def names(family: str) -> tuple[str, ...]:
    """The strategies of `family`, in the table's order."""
    return tuple(s.name for s in TABLE if s.family == family)


def implementation(name: str) -> type:
    """The class that computes strategy `name`'s rounds, imported now (it loads torch)."""
    if is_import_path(name):
        return user_strategy(name).cls
    module, _, attribute = strategy(name).implementation.partition(":")
    cls: type = getattr(importlib.import_module(module), attribute)
    return cls


CONTRACTS = {
    "agent.learning.central.base.CentralStrategy": CENTRAL,
    "agent.learning.decentral.base.DecentralizedStrategy": DECENTRAL,
}
"""The two contracts a user's strategy may implement, by qualified name (importing them
here would import torch and the learner, which imports this table), with its family."""
_FAMILY_OPTIONS = {CENTRAL: _SGD, DECENTRAL: _DECENTRAL}
"""What a user's strategy reads when it derives from a contract directly: the local SGD
every round trains with, and a decentralized one's wire format (none of the options only
a shipped strategy's own method reads)."""


@dataclass(frozen=True)
class UserStrategy:
    """A user's strategy as this process loaded it: its record, its class, and the digest of
    the code that class was loaded from."""

    record: Strategy
    cls: type
    fingerprint: str
    """`user_code.source_fingerprint`, taken when the class was loaded: a long-lived agent
    whose file was edited since still runs the code it loaded, and says that code's digest,
    not the file's new one."""


@functools.cache
def user_strategy(spec: str) -> UserStrategy:
    """The user's strategy `spec` names, loaded once a process; ValueError with one line if
    it cannot be imported or implements neither contract.

    The record is the class's: its family is its contract's; a class derived from a shipped
    strategy's takes that one's record (traits, options, preset), a class derived from a
    contract directly is dense, reads only the options of its family and has no preset. Class
    attributes `sparse`, `prunes_further`, `adam`, `budgets` override the traits, and a
    ``preset`` dict adds config defaults a run may override (``preset = {"lr": 0.05}``).
    """
    cls = load_callable(spec, "strategy")
    if not isinstance(cls, type):
        raise ValueError(f"strategy {spec!r}: {type(cls).__name__} is not a class")
    shipped = {s.implementation: s for s in TABLE}
    record = None
    for base in cls.__mro__:
        if (path := f"{base.__module__}:{base.__qualname__}") in shipped:
            record = shipped[path]
            break
        if (qualified := f"{base.__module__}.{base.__qualname__}") in CONTRACTS:
            family = CONTRACTS[qualified]
            record = Strategy(spec, family, spec, options=_FAMILY_OPTIONS[family])
            break
    if record is None:
        raise ValueError(
            f"strategy {spec!r}: {cls.__name__} derives from neither contract, "
            "agent.learning.central.CentralStrategy nor agent.learning.decentral."
            "DecentralizedStrategy"
        )
    preset = getattr(cls, "preset", {})
    if not isinstance(preset, Mapping):
        raise ValueError(f"strategy {spec!r}: {cls.__name__}.preset must be a dict of options")

    def trait(name: str) -> bool:
        return bool(getattr(cls, name, getattr(record, name)))

    own = dataclasses.replace(
        record,
        name=spec,
        implementation=spec,
        defaults={**record.defaults, **preset},
        sparse=trait("sparse"),
        prunes_further=trait("prunes_further"),
        adam=trait("adam"),
        budgets=trait("budgets"),
    )
    if own.decentralized and own.sparse and not _draws_masks(cls):
        raise ValueError(
            f"strategy {spec!r}: {cls.__name__} says sparse but draws no masks: derive it from "
            "agent.learning.decentral.sparse.SparseStrategy, as DisPFL does, or give it an "
            "initial_masks that draws them"
        )
    return UserStrategy(own, cls, source_fingerprint(cls))


def _draws_masks(cls: type) -> bool:
    """Whether a decentralized class has a first mask of its own: anything but the contract's
    `initial_masks`, which draws none (a sparse trait without masks would train dense)."""
    contract = next(
        base for base in cls.__mro__ if f"{base.__module__}.{base.__qualname__}" in CONTRACTS
    )
    return getattr(cls, "initial_masks", None) is not getattr(contract, "initial_masks", None)


def fingerprint(name: str) -> str:
    """A digest of the code of strategy `name` this process runs when it is the user's
    (`UserStrategy.fingerprint`), "" for a shipped one (the installed version's)."""
    return user_strategy(name).fingerprint if is_import_path(name) else ""


@dataclass(frozen=True)
class Scope:
    """An option that only some runs read: those of the strategies whose `options` name it,
    and those whose other flags `given` says read it."""

    option: str
    where: str
    """Who reads it, for the error: formatted with `names` (the strategies that read it,
    joined by commas) and `names_and` (joined by "and")."""
    given: Callable[[dict[str, Any]], bool] | None = None

    def applies(self, name: str, flags: dict[str, Any]) -> bool:
        """Whether a run of strategy `name` with these given `flags` reads the option."""
        return self.option in strategy(name).options or bool(self.given and self.given(flags))

    def readers(self) -> str:
        """Who reads it, in words."""
        readers = [s.name for s in TABLE if self.option in s.options]
        return self.where.format(names=", ".join(readers), names_and=" and ".join(readers))


SCOPES: tuple[Scope, ...] = (
    Scope("reduce", "the sparse strategies {names_and}"),
    Scope("ssm_fraction", "{names}"),
    Scope("buffer_size", "{names}, the buffered asynchronous strategies"),
    Scope("ldf_n", "{names_and} and runs with --wire layers", lambda f: f.get("wire") == "layers"),
    Scope("wire", "the decentralized strategies"),
    Scope("optimizer", "the SGD strategies (the FedAdam presets keep their own Adam)"),
    Scope("detection_scale", "{names}, the strategy that prunes further"),
    Scope("detection_distance", "{names}, the strategy that prunes further"),
)
"""The options that only some strategies read (`Strategy.options`); the options that only
some other flags make read are `agent.options`'."""
