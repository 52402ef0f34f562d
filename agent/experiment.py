"""An experiment's configuration: what to learn on and how, its checks, and its form on the
wire. Plain data without torch, so a command builds its flags from it (`agent.options`) and
starts in a fraction of a second; the learning workload a config implies is
`agent.workload`'s.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agent.data import PYTHON_SOURCE
from agent.device.availability import SPEC_SYNTAX, FleetAvailability, Pattern
from agent.learning import robust_rules
from agent.learning.asynchronous import ASYNCHRONOUS_STRATEGIES
from agent.learning.buffering import MIN_COHORT, buffer_size
from agent.learning.config import (
    BATCHNORM_MODES,
    DECENTRALIZED,
    DETECTION_SCALES,
    DISTANCES,
    DP_CLIENT,
    DP_MODES,
    FALLBACKS,
    MASK_UNITS,
    MODEL_NAMES,
    OPTIMIZERS,
    REDUCE_MODES,
    TASKS,
    WIRE_FORMATS,
    StrategyConfig,
    param,
)
from agent.learning.config import default_model as default_dataset_model
from agent.learning.early_stop import StopRule
from agent.learning.reductions import CHANNEL_MODES
from agent.learning.staleness import STALENESS_WEIGHTS
from agent.learning.strategies import LOCAL, TABLE, fingerprint, names, strategy
from protocol import extras
from protocol.limits import MAX_MEMBERS, MAX_ROUNDS, WEEK_S

if TYPE_CHECKING:
    from agent.learning.tasks import Task
    from firmware_profiles import DeviceProfile


DEVICE_DATA = "device"
"""The `dataset` of a run in which every agent learns from its own data."""
DEFAULT_MIN_SAMPLES = 10
INIT_CHOICES = ("seed", "previous")
"""Where a run's model starts: the fleet's seeded weights, or each device's current model."""
KEEP_POLICIES = ("latest", "best")
"""Which finished run's model a device makes current (`agent.model_store.choose`)."""
DEFAULT_KEEP_MARGIN = 0.02


MAX_AGENTS = MAX_MEMBERS
"""The largest fleet a run may name (a roster message lists every member)."""
MAX_EPOCHS = 10_000
MAX_BATCH = 1_000_000
MAX_SECONDS = WEEK_S
"""The longest timeout or per-round time: a week."""
MAX_SEED = 2**32 - 1
"""numpy's legacy generator (MNIST-1D) takes seeds up to 2^32 - 1."""
MAX_SAMPLE_VALUES = 1 << 24
"""The most values one sample may hold (input_shape's product): a 3x2048x2048 image fits."""


@dataclass(frozen=True)
class Range:
    """The values a numeric option may take: finite, within [low, high], an end left out
    where `open_low` / `open_high` say so; a `whole` number for a count."""

    low: float
    high: float
    open_low: bool = False
    open_high: bool = False
    whole: bool = False

    def problem(self, name: str, value: object) -> str | None:
        """Why `value` is refused for option `name` (its flag or run-file key), or None."""
        number = int if self.whole else int | float
        if not isinstance(value, number) or isinstance(value, bool):
            return f"{name} must be {'an integer' if self.whole else 'a number'}, got {value!r}"
        if not math.isfinite(value):
            return f"{name} must be a finite number, got {value}"
        low_ok = value > self.low if self.open_low else value >= self.low
        high_ok = value < self.high if self.open_high else value <= self.high
        if low_ok and high_ok:
            return None
        if self.whole:
            bound = f">= {self.low:,.0f}" if not low_ok else f"<= {self.high:,.0f}"
            return f"{name} must be {bound}, got {value:,}"
        left, right = "(" if self.open_low else "[", ")" if self.open_high else "]"
        return f"{name} must be in {left}{self.low:g}, {self.high:g}{right}, got {value}"


def count(low: int, high: int) -> Range:
    """The range of a count option: a whole number in [low, high]."""
    return Range(low, high, whole=True)


UNIT = Range(0, 1)
FRACTION = Range(0, 1, open_low=True)
RANGES: dict[str, Range] = {
    # ExperimentConfig
    "agents": count(1, MAX_AGENTS),
    "seed": count(0, MAX_SEED),
    "test_size": count(1, 10**7),
    "threads": count(1, 1024),
    "round_time_s": Range(0, MAX_SECONDS, open_low=True),
    "classes": count(1, 100_000),
    "targets": count(1, 100_000),
    "min_samples": count(3, 10**9),
    "keep_margin": UNIT,
    # StrategyConfig
    "rounds": count(1, MAX_ROUNDS),
    "neighbours": count(0, MAX_AGENTS),
    "max_wait": count(0, MAX_AGENTS),
    "epochs": count(1, MAX_EPOCHS),
    "batch_size": count(1, MAX_BATCH),
    "lr": Range(0, 10),
    "lr_decay": FRACTION,
    "weight_decay": UNIT,
    "momentum": Range(0, 1, open_high=True),
    "clip_norm": Range(0, 1e9),
    "density": FRACTION,
    "rigl_a": UNIT,
    "rigl_batches": count(1, 10_000),
    "delta_pr": Range(0, 1e6),
    "delta_v": UNIT,
    "schedule_b": Range(0, MAX_ROUNDS),
    "schedule_c": Range(0, 100, open_low=True),
    "pqi_p": Range(0, 100, open_low=True),
    "pqi_q": Range(0, 100, open_low=True),
    "pqi_eta_c": Range(0, 1e6),
    "pqi_gamma": Range(0, 1e6),
    "pqi_beta": UNIT,
    "target_sparsity": Range(0, 1, open_high=True),
    "stop_patience": count(0, MAX_ROUNDS),
    "stop_delta": Range(0, 1, open_high=True),
    "ssm_fraction": FRACTION,
    "ldf_n": count(1, MAX_AGENTS),
    "buffer_size": count(0, 100_000),
    "max_staleness": count(0, MAX_ROUNDS),
    "delta_fraction": FRACTION,
    "dp_noise": Range(0, 1e6, open_low=True),
    "dp_clip": Range(0, 1e9, open_low=True),
    "dp_delta": Range(0, 1, open_low=True, open_high=True),
    "dp_average": Range(0, 1, open_high=True),
    "max_epsilon": Range(0, 1e9, open_low=True),
}
"""The range of every numeric option of ExperimentConfig and StrategyConfig (a test checks
that none is left out): a typo (epochs = 1e9, lr = -1e300, nan) is refused before a run
starts, while lr 0 (a frozen model) and lr 10 with weight decay 1 (a model driven to NaN on
purpose, as tests do) are taken."""


def check_ranges(config: ExperimentConfig) -> None:
    """Every numeric option within its `RANGES`: one line naming the option otherwise."""
    flagged = {f.name: f.metadata.get("flag", True) for f in dataclasses.fields(config)}
    values = {**vars(config.learning), **vars(config)}
    for name, allowed in RANGES.items():
        value = values[name]
        if value is None:
            continue
        shown = name if not flagged.get(name, True) else "--" + name.replace("_", "-")
        problem = allowed.problem(shown, value)
        if problem is not None:
            raise ValueError(problem)


def run_param(default: Any, help: str) -> Any:
    """A config field that a run file sets but no command-line flag does."""
    return field(default=default, metadata={"help": help, "flag": False})


@dataclass(frozen=True)
class ExperimentConfig:
    """What to learn on and how: data, fleet size, seed, and the strategy's hyper-parameters."""

    dataset: str = param(
        "mnist1d",
        "Dataset: digits, mnist1d, synthetic[:ALPHA,BETA], npz:PATH, imagefolder:PATH or "
        "cifar10:PATH, partitioned over the fleet; 'device' in a run file: each agent's own "
        "data (edge-agent --data).",
    )
    model: str | None = param(
        None,
        f"Model: {', '.join(MODEL_NAMES)}, or your own as MODULE:FUNCTION or "
        "./FILE.py:FUNCTION, a function (input_shape, num_outputs) -> torch.nn.Module "
        "[default: per dataset].",
    )
    task: str = param(
        "classification",
        f"What the model learns: {', '.join(TASKS)} (losses: cross-entropy; MSE or L1; MSE of "
        "the reconstruction).",
    )
    loss: str = param(
        "",
        "Loss: mse or l1 for regression, or MODULE:FUNCTION taking (output, target) and "
        "returning the batch's mean loss [default: the task's].",
    )
    metric: str = param(
        "",
        "Metric reports give: MODULE:FUNCTION taking (output, target) and returning per-sample "
        "values [default: accuracy, mae or reconstruction_error, by task].",
    )
    metric_goal: str = param(
        "", "max or min: whether a higher --metric is better [default: max for accuracy only]."
    )
    agents: int = param(20, "Number of agents K.")
    partition: str = param(
        "dirichlet:0.3", "Data partition: iid, dirichlet:ALPHA, pathological:CLASSES or natural."
    )
    test_size: int | None = param(
        None,
        "Test samples per agent, drawn from the held-out pool with the agent's own label mix "
        "(larger sets make per-device figures steadier) [default: in proportion to the "
        "agent's data; all of its groups' under partition natural with a source's own test "
        "samples].",
    )
    seed: int = param(1, "Fleet seed: data split, initial weights, masks, neighbours, order.")
    threads: int = param(1, "Torch threads (results are reproducible for a given count).")
    profiles: str = param(
        "",
        "Device profile of every agent, or 'mixed' for the bundled profiles in turn; sets each "
        "agent's budget p_k, which caps the density of its sparse model [default: none, p_k=1].",
    )
    availability: str = param(
        "",
        f"Devices that come and go: {SPEC_SYNTAX}, the share of the fleet that sleeps (awake "
        "ONLINE of every PERIOD seconds, its wake time moved by JITTER in [0, 1]) and whose "
        "link drops for FOR seconds every EVERY seconds (with PROBABILITY); e.g. 0.3:0.33:60 "
        "[default: none; each device as its profile's [availability] says, else always online].",
    )
    round_time_s: float = param(60.0, "Seconds of local training a device may spend per round.")
    input_shape: tuple[int, ...] | None = run_param(
        None, "Input shape of one sample (channels first) under dataset 'device'."
    )
    classes: int | None = run_param(
        None, "Number of classes under dataset 'device' (task classification)."
    )
    targets: int = run_param(
        1, "Target values per sample under dataset 'device' with task regression."
    )
    min_samples: int = param(
        DEFAULT_MIN_SAMPLES,
        "Fewest samples (train + validation) an agent holds: the partition gives every agent at "
        "least this many; under dataset 'device', fewest an agent's own data may hold to join.",
    )
    attackers: int = param(
        0,
        "Research: the first N agents of the sorted roster send poisoned (well-formed) models.",
    )
    attack: str = param(
        "scale",
        f"What attackers send: scale (x {robust_rules.SCALE_FACTOR:g}), noise (+ N(0, "
        f"{robust_rules.NOISE_STD:g}^2)), signflip (negated), huge (3e37 in every entry), nan, "
        "inflate (centralized: an update-sized step the wrong way claiming "
        f"{robust_rules.INFLATED_SAMPLES:,} samples), ipm ({robust_rules.IPM_EPSILON:g} of "
        "its step the wrong way), alie (the honest mean less z standard deviations; in "
        "coordinator simulate the attackers pool their honest models), labelflip (trains on "
        "labels C-1-y), backdoor (trains on its data plus copies with a 2x2 trigger labelled "
        "class 0, and sends that model) or replace (the backdoored step boosted "
        f"x{robust_rules.REPLACE_BOOST:g}).",
    )
    init: str = run_param(
        "seed",
        "Where each device's model starts: 'seed' (the fleet's seeded weights) or 'previous' "
        "(the device's current model, where it has a fitting one).",
    )
    keep: str = run_param(
        "latest",
        "Which model a device keeps current: 'latest' (the newest run's, unless it is less "
        "accurate than the current one by more than keep_margin) or 'best' (the most accurate).",
    )
    keep_margin: float = run_param(
        DEFAULT_KEEP_MARGIN,
        "Under keep = 'latest': how much lower (absolute accuracy) a new run's model may be "
        "and still become current.",
    )
    model_fingerprint: str = field(
        default="",
        metadata={"flag": False, "internal": True, "help": "Set by the coordinator."},
    )
    """A digest of the user model's parameter names and shapes (`user_code.fingerprint`),
    set by the coordinator of a run on devices' own data: a device whose copy of the model
    builds something else is rejected with its reason."""
    strategy_fingerprint: str = field(
        default="",
        metadata={"flag": False, "internal": True, "help": "Set by the coordinator."},
    )
    """A digest of a user strategy's source (`strategies.fingerprint`), set wherever a run
    is configured (`agent.options.experiment_config`): a device whose copy of the strategy's
    code differs refuses the run with its reason."""
    learning: StrategyConfig = field(default_factory=StrategyConfig)

    def learning_task(self) -> Task:
        """The run's `Task` (its loss and metric), checked: ValueError with one line."""
        from agent.learning.tasks import Task  # checking a run loads torch, describing it not

        return Task(self.task, self.loss, self.metric, self.metric_goal)

    @property
    def on_devices(self) -> bool:
        """Each agent learns from its own data (a run of real devices), not from a share
        of one dataset partitioned over the roster (simulate and emulate)."""
        return self.dataset == DEVICE_DATA

    def validate(self) -> None:
        """Reject impossible configurations with one clear sentence each."""
        cfg = self.learning
        check_ranges(self)
        self.learning_task()  # imports and checks a custom loss or metric
        if self.on_devices:
            check_device_data(self)
        check_strategy_code(self)
        decentralized = strategy(cfg.strategy).decentralized
        if decentralized and cfg.topology == "random" and not 1 <= cfg.neighbours < self.agents:
            raise ValueError(
                f"--neighbours must be between 1 and agents - 1 = {self.agents - 1} "
                f"for {cfg.strategy}, got {cfg.neighbours}"
            )
        if cfg.reduce not in REDUCE_MODES:
            raise ValueError(f"--reduce must be one of {', '.join(REDUCE_MODES)}, got {cfg.reduce}")
        check_mask_unit(cfg)
        if cfg.detection_scale not in DETECTION_SCALES:
            raise ValueError(
                f"--detection-scale must be one of {', '.join(DETECTION_SCALES)}, "
                f"got {cfg.detection_scale}"
            )
        if cfg.detection_distance not in DISTANCES:
            raise ValueError(
                f"--detection-distance must be one of {', '.join(DISTANCES)}, "
                f"got {cfg.detection_distance}"
            )
        StopRule.of(cfg)
        if cfg.batchnorm not in BATCHNORM_MODES:
            raise ValueError(f"--batchnorm must be local or shared, got {cfg.batchnorm!r}")
        if cfg.fallback not in FALLBACKS:
            raise ValueError(
                f"--fallback must be one of {', '.join(FALLBACKS)}, got {cfg.fallback!r}"
            )
        if cfg.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {cfg.optimizer!r}"
            )
        if cfg.wire not in WIRE_FORMATS:
            raise ValueError(f"--wire must be one of {', '.join(WIRE_FORMATS)}, got {cfg.wire}")
        if self.profiles:
            profile_names(self.profiles)
        if self.availability:
            FleetAvailability.parse(self.availability)
            if self.on_devices:
                raise ValueError(
                    "--availability emulates devices that come and go: real devices (dataset "
                    "'device') come and go by themselves"
                )
        check_robustness(self)
        check_model_keeping(self)
        check_buffered(self)
        check_privacy(self.learning)
        check_secure_aggregation(self)
        check_asynchronous(self.learning)


def check_buffered(config: ExperimentConfig) -> None:
    """FedBuff (`agent.learning.central.fedbuff`): what its asynchronous versions do not take
    yet, one clear sentence each (its server step is an unweighted, unscreened mean of
    deltas, and a version is no round every device takes part in)."""
    cfg = config.learning
    if not strategy(cfg.strategy).buffered:
        return
    name = cfg.strategy
    if cfg.secure_aggregation:
        check_secure_cohorts(config)
    if cfg.max_epsilon is not None:
        raise ValueError(
            f"--max-epsilon with {name} is not built yet: its devices would stop at different "
            "versions than its server (docs/asynchronous.md)"
        )
    if cfg.aggregation not in (robust_rules.SCREENED, "mean") or cfg.clip not in (
        robust_rules.CLIP_AUTO,
        robust_rules.CLIP_OFF,
    ):
        raise ValueError(
            f"{name} applies the staleness-weighted mean of its buffered updates: leave "
            f"--aggregation and --clip at their defaults (got --aggregation {cfg.aggregation} "
            f"--clip {cfg.clip})"
        )
    if config.attackers:
        raise ValueError(f"--attackers (research) does not run with {name} yet")
    if cfg.early_stop:
        raise ValueError(
            f"--early-stop does not apply to {name}: its run ends when the server has applied "
            "--rounds versions"
        )


def check_secure_cohorts(config: ExperimentConfig) -> None:
    """FedBuff under `--secure-aggregation` (`agent.learning.central.secure_buffer`): a cohort
    of K distinct devices a version, K at least `MIN_COHORT`; one clear sentence for what it
    does not take."""
    cfg = config.learning
    name = cfg.strategy
    if strategy(name).adam:
        raise ValueError(
            f"--secure-aggregation with {name} is not built: its devices upload Adam's "
            "moments beside the weights, and its versions are whole states, not a mean of "
            "models (fedbuff takes it)"
        )
    if cfg.dp == DP_CLIENT:
        raise ValueError(
            f"--dp client with --secure-aggregation is not built for {name}: its noise would "
            "have to be shared among each cohort's members (fedavg takes both)"
        )
    size = buffer_size(cfg.buffer_size, config.agents, secure=True)
    if size < MIN_COHORT:
        raise ValueError(
            f"--buffer-size {size} with --secure-aggregation: a member of a cohort of K learns "
            f"the sum of the other K - 1 updates, so K must be at least {MIN_COHORT}"
        )
    if size > config.agents:
        raise ValueError(
            f"--secure-aggregation with {name} runs cohorts of K = {size} distinct devices "
            f"(--buffer-size, at least {MIN_COHORT}); the fleet has {config.agents}"
        )


def check_privacy(cfg: StrategyConfig) -> None:
    """`--dp`: sample-level DP-SGD, client-level DP (`check_client_dp`), or off. Its settings
    without `--dp` are refused by their flag scopes (`agent.options`)."""
    if cfg.dp not in DP_MODES:
        raise ValueError(f"--dp must be one of {', '.join(DP_MODES)}, got {cfg.dp!r}")
    if cfg.dp == "off" and cfg.max_epsilon is not None:
        raise ValueError(
            "--max-epsilon needs --dp sample or client: without DP there is no epsilon"
        )
    if cfg.dp == DP_CLIENT:
        check_client_dp(cfg)
    if cfg.dp != "off":
        extras.require(extras.PRIVACY_EXTRA, extras.ACCOUNTANT, f"--dp {cfg.dp}")


CLIENT_DP_REFUSALS = {
    "decentralized": "has no aggregator to add the noise (--dp sample protects each "
    "device's records from its neighbours)",
    "adam": "uploads Adam's moments too, whose noised second moment would go negative",
    "other": "does not upload models trained from the server's alone (FedLDF sends each "
    "device's per-layer divergence in the clear and picks layers by it)",
}
"""Why `--dp client` does not apply to a strategy, by its kind (`check_client_dp`)."""


def check_client_dp(cfg: StrategyConfig) -> None:
    """`--dp client` (`agent.learning.central.client_dp`): a strategy whose uploads are models
    trained from the server's, averaged unweighted and unscreened (a sample-count weight or a
    robust rule would unbound one device's sway over the aggregate, which the noise is sized
    to), sent at full precision (fp16 rounding would move a clipped update past its bound)."""
    record = strategy(cfg.strategy)
    if not record.client_dp:
        kind = "other"
        if not record.centralized:
            kind = "decentralized"
        elif record.adam:
            kind = "adam"
        supported = ", ".join(s.name for s in TABLE if s.client_dp)
        raise ValueError(
            f"--dp client is for {supported}: {cfg.strategy} {CLIENT_DP_REFUSALS[kind]}"
        )
    # under --secure-aggregation the default is the plain mean, of weight 1 each (`secure_dp`)
    unweighted = "mean" if cfg.secure_aggregation else robust_rules.SCREENED
    if cfg.aggregation != unweighted or cfg.clip != robust_rules.CLIP_OFF:
        raise ValueError(
            "--dp client averages the clipped updates unweighted: leave --aggregation and "
            f"--clip at their defaults (got --aggregation {cfg.aggregation} --clip {cfg.clip})"
        )
    if cfg.fp16:
        raise ValueError("--dp client sends updates at full precision: drop --fp16")
    if cfg.secure_aggregation:
        if strategy(cfg.strategy).budgets:
            raise ValueError(
                f"--dp client with --secure-aggregation is built for fedavg and fedavg-ft: "
                f"{cfg.strategy}'s devices train parts of the model, whose entries the "
                "devices' noise shares would not cover evenly"
            )
        check_noise_range(cfg)


def check_noise_range(cfg: StrategyConfig) -> None:
    """`--dp client --secure-aggregation`: a device's clipped change plus its noise share,
    over |U1| >= 2 members, must fit the secure sum's fixed-point range (`protocol.secagg`)
    up to 6 standard deviations of the noise, or quantization would clip it."""
    from protocol.secagg import CLIP_RANGE  # cryptography: only for secure runs

    reach = cfg.dp_clip * (1 + 6 * cfg.dp_noise)
    if reach > 2 * CLIP_RANGE:
        raise ValueError(
            f"--dp-clip {cfg.dp_clip:g} with --dp-noise {cfg.dp_noise:g} reaches {reach:.3g} "
            f"per entry, past the secure sum's range of {2 * CLIP_RANGE:g}: lower --dp-clip"
        )


def check_mask_unit(cfg: StrategyConfig) -> None:
    """`--mask-unit`: channel masks are a form of the sparse strategies' masks, and their
    budget is their own density cap (one clear sentence otherwise)."""
    if cfg.mask_unit not in MASK_UNITS:
        raise ValueError(
            f"--mask-unit must be one of {', '.join(MASK_UNITS)}, got {cfg.mask_unit!r}"
        )
    if cfg.mask_unit == "channel" and not strategy(cfg.strategy).sparse:
        sparse = " and ".join(s.name for s in TABLE if s.sparse)
        raise ValueError(
            f"--mask-unit channel is for the sparse strategies {sparse}, not {cfg.strategy}"
        )
    if cfg.mask_unit == "channel" and cfg.reduce not in CHANNEL_MODES:
        raise ValueError(
            f"--mask-unit channel cuts a budgeted round by its density cap (--reduce "
            f"{' or '.join(CHANNEL_MODES)}), which saves real time with channel masks; "
            f"got --reduce {cfg.reduce}"
        )


def check_strategy_code(config: ExperimentConfig) -> None:
    """A user strategy's code here is the run's (its fingerprint), as a user model's is
    (`agent.workload.check_user_model`): two versions compute different rounds."""
    name, wanted = config.learning.strategy, config.strategy_fingerprint
    if wanted and (here := fingerprint(name)) != wanted:
        raise ValueError(
            f"strategy {name!r} has different code here (fingerprint {here}) than the run's "
            f"({wanted}): every device needs the same version of the strategy's code"
        )


def check_robustness(config: ExperimentConfig) -> None:
    """The robust-aggregation and attack options, one clear sentence for a bad value."""
    rule = robust_rules.parse_rule(config.learning.aggregation)
    robust_rules.parse_clip(config.learning.clip)
    voting = [s.name for s in TABLE if s.votes_signs]
    if rule.kind == robust_rules.SIGNS and not strategy(config.learning.strategy).votes_signs:
        raise ValueError(
            "--aggregation signs votes on the steps of models trained from one global model: "
            f"it takes {', '.join(voting)}, not {config.learning.strategy}"
        )
    if not 0 <= config.attackers < config.agents:
        raise ValueError(
            f"--attackers must be between 0 and agents - 1 = {config.agents - 1}, "
            f"got {config.attackers}"
        )
    if config.attack not in robust_rules.ATTACKS:
        raise ValueError(
            f"--attack must be one of {', '.join(robust_rules.ATTACKS)}, got {config.attack!r}"
        )


def check_secure_aggregation(config: ExperimentConfig) -> None:
    """`--secure-aggregation`: where the coordinator can take a round from the masked sum
    alone (one clear sentence for where it cannot)."""
    cfg = config.learning
    if not cfg.secure_aggregation:
        return
    record = strategy(cfg.strategy)
    built = ", ".join(s.name for s in TABLE if s.secure_sum)
    if not record.centralized:
        raise ValueError(
            f"--secure-aggregation is for the centralized strategies ({built}): a "
            f"{cfg.strategy} agent averages its neighbours' models itself, so each neighbour "
            "receives its model (docs/privacy.md)"
        )
    if not record.secure_sum:
        raise ValueError(f"--secure-aggregation is built for {built}; {_unsummed(cfg.strategy)}")
    if cfg.aggregation != "mean" or cfg.clip != robust_rules.CLIP_OFF:
        raise ValueError(
            "--secure-aggregation needs --aggregation mean and no --clip: the coordinator "
            "learns only the sum, so it cannot screen, clip or vote on single models"
        )
    if config.attackers:
        raise ValueError("--attackers (research) does not run with --secure-aggregation yet")


def _unsummed(name: str) -> str:
    """Why strategy `name`'s round cannot be taken from a masked sum, in a few words: the
    built strategy left out is FedBuff-SSM (`check_buffered` says why first), so this is a
    user's strategy, whose round the coordinator cannot know to be a weighted mean."""
    return f"{name}'s round is not known to be a weighted mean of what its devices upload"


def check_asynchronous(cfg: StrategyConfig) -> None:
    """`--asynchronous`: the strategies and wire format it runs with, one sentence each."""
    if not cfg.asynchronous:
        return
    if cfg.strategy not in ASYNCHRONOUS_STRATEGIES:
        raise ValueError(
            f"--asynchronous runs {', '.join(ASYNCHRONOUS_STRATEGIES)} only, not {cfg.strategy}"
        )
    if cfg.wire != "full":
        raise ValueError(
            f"--asynchronous sends whole models: --wire {cfg.wire} builds on models every "
            "receiver holds in step; use --wire full"
        )
    if robust_rules.parse_rule(cfg.aggregation).robust:
        raise ValueError(
            f"--asynchronous weights models by staleness, which --aggregation "
            f"{cfg.aggregation} does not take; use --aggregation mean"
        )
    if cfg.staleness_weight not in STALENESS_WEIGHTS:
        raise ValueError(
            f"--staleness-weight must be one of {', '.join(STALENESS_WEIGHTS)}, "
            f"got {cfg.staleness_weight!r}"
        )
    if cfg.max_staleness < 0:
        raise ValueError(f"--max-staleness must be >= 0, got {cfg.max_staleness}")


def check_model_keeping(config: ExperimentConfig) -> None:
    """How a device starts a run and keeps its models: one clear sentence for a bad value."""
    if config.init not in INIT_CHOICES:
        raise ValueError(f"init must be one of {', '.join(INIT_CHOICES)}, got {config.init!r}")
    if config.keep not in KEEP_POLICIES:
        raise ValueError(f"keep must be one of {', '.join(KEEP_POLICIES)}, got {config.keep!r}")


def attackers(config: ExperimentConfig, roster: list[str]) -> list[str]:
    """The agents of this run that poison what they send (`robust_rules.attackers`)."""
    return robust_rules.attackers(roster, config.attackers)


def check_device_data(config: ExperimentConfig) -> None:
    """A run on the devices' own data must fix what every agent's model is built for."""
    shape = config.input_shape
    if not shape or any(not isinstance(d, int) or d < 1 for d in shape):
        raise ValueError(f"dataset 'device' needs an input_shape of positive sizes, got {shape}")
    if math.prod(shape) > MAX_SAMPLE_VALUES:
        raise ValueError(
            f"input_shape {list(shape)} holds {math.prod(shape):,} values a sample, more than "
            f"the {MAX_SAMPLE_VALUES:,} allowed"
        )
    if config.task == "classification" and (config.classes is None or config.classes < 2):
        raise ValueError(f"dataset 'device' needs classes >= 2, got {config.classes}")


def device_outputs(config: ExperimentConfig) -> int:
    """The model's outputs in a run on devices' own data: a logit per class, the regression
    targets, or a reconstruction of the input."""
    assert config.input_shape is not None  # validated
    if config.task == "regression":
        return config.targets
    if config.task == "reconstruction":
        return math.prod(config.input_shape)
    return config.classes or 0


def default_model(dataset: str, input_shape: tuple[int, ...]) -> str:
    """The bundled model of a dataset; on the devices' own data or a python: source's, by the
    shape of a sample: features (an MLP), a signal with channels (1-D CNN) or an image
    (2-D CNN)."""
    if dataset == DEVICE_DATA or dataset.startswith(PYTHON_SOURCE):
        return {1: "mlp", 2: "cnn1d", 3: "cnn2d"}.get(len(input_shape), "mlp")
    return default_dataset_model(dataset.split(":")[0])


def profile_names(spec: str) -> list[str]:
    """The profiles agents take in turn (by their place in the sorted roster)."""
    from firmware_profiles import ProfileError, list_profiles, load_profile

    names = list_profiles() if spec == "mixed" else [spec]
    try:
        return [load_profile(name).name for name in names]
    except ProfileError as exc:
        raise ValueError(str(exc)) from None


def agent_profiles(config: ExperimentConfig, roster: list[str]) -> dict[str, DeviceProfile]:
    """Each agent's board in a run with `profiles` (in turn, by place in the sorted roster);
    empty without: the agents are not emulated boards."""
    from firmware_profiles import load_profile

    if not config.profiles:
        return {}
    names = profile_names(config.profiles)
    return {
        agent_id: load_profile(names[index % len(names)])
        for index, agent_id in enumerate(sorted(roster))
    }


def agent_availability(config: ExperimentConfig, roster: list[str]) -> dict[str, Pattern]:
    """Each agent's availability in this run, for those not always online: the run's
    `availability` spec for the share it draws, else the `[availability]` of the agent's
    profile; the same in simulate and emulate (drawn from the seed and the agent's id)."""
    chosen = {}
    if config.availability:
        chosen = FleetAvailability.parse(config.availability).patterns(roster, config.seed)
    for agent_id, profile in agent_profiles(config, roster).items():
        if agent_id not in chosen and profile.availability is not None:
            chosen[agent_id] = Pattern(profile.availability, config.seed, agent_id)
    return {agent: pattern for agent, pattern in chosen.items() if not pattern.always_online}


def check_networked(config: ExperimentConfig, *, aggregator: bool) -> None:
    """Reject what networked agents cannot run, with one clear sentence: a centralized
    strategy needs a coordinator to aggregate (its run message names it)."""
    config.validate()
    if strategy(config.learning.strategy).centralized and not aggregator:
        raise ValueError(
            f"{config.learning.strategy} is centralized: it needs a coordinator to aggregate "
            f"(coordinator emulate, or a coordinator's run message); without one, agents run "
            f"the decentralized strategies ({', '.join(DECENTRALIZED)}) and "
            f"{' and '.join(names(LOCAL))}"
        )


def config_to_dict(config: ExperimentConfig) -> dict[str, Any]:
    """The config as plain data for a message (tuples as lists); `config_from_dict` reads it."""
    plain = dataclasses.asdict(config)
    if plain["input_shape"] is not None:
        plain["input_shape"] = list(plain["input_shape"])
    return plain


def config_from_dict(data: dict) -> ExperimentConfig:
    """Rebuild a config sent as plain data (the coordinator's run message); ValueError if bad."""
    try:
        learning = StrategyConfig(**data.get("learning", {}))
        shape = data.get("input_shape")
        config = ExperimentConfig(
            **{**data, "learning": learning, "input_shape": tuple(shape) if shape else None}
        )
    except TypeError as exc:
        raise ValueError(f"bad run configuration: {exc}") from None
    config.validate()
    return config
