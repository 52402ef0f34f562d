"""The hyper-parameters of a strategy (StrategyConfig), a preset's configuration (`preset`,
from the table of strategies, `agent.learning.strategies`), and the names a run chooses among
(models, tasks, distances). Plain data without torch, so that a command lists and checks them
without loading it."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from agent.learning import reductions, robust_rules, strategies
from agent.learning.staleness import STALENESS_WEIGHTS

DECENTRALIZED = strategies.names(strategies.DECENTRAL)
CENTRALIZED = strategies.names(strategies.CENTRAL)
PRESETS = tuple(strategies.STRATEGIES)
ADAM_FAMILY = tuple(s.name for s in strategies.TABLE if s.adam)
"""Names of the strategies by family, every strategy, and the FedAdam family, in the table's
order (`agent.learning.strategies`, which says what each is): for help texts and choices."""


STOP_LAMBDA = 0.7


STOP_RULES = {"progress": 20, "paper": 1, "scaled": 0}
"""Each early-stopping rule (`agent.learning.early_stop`) and its patience when
`--stop-patience` is 0 (`scaled`: 0, a share of the run's rounds, `SCALED_SHARE`)."""
SCALED_SHARE, SCALED_LEAST, SCALED_DELTA, SCALED_PRUNE_NOISE = 1 / 3, 5, 0.05, 2.0
"""The `scaled` rule: `progress` over a window of a third of the run's rounds (at least 5)
with delta 0.05, the best trade-off measured on 30-40-round runs (bench/early_stopping.py);
a pruning round (DA-DPFL) restarts its window only when L rose in it by more than 2 standard
deviations of L's round-to-round changes over the window (`StopWatch.jumped`)."""
SCALED_SMOOTH_SHARE, SCALED_SMOOTH_NOISE, SCALED_SMOOTH_ROUNDS = 0.2, 0.01, 40
"""`scaled`'s short window, a fifth of the run's rounds (at least 5: 6 on a 30-round run, 8
on a 40-round one), on runs of at most 40 rounds: an agent whose best L fell over it at no
more than the long window's pace (delta 0.05 over a third of the run), with L's
round-to-round changes there within 1% of its fall since round 1 (standard deviation), stops
then without waiting out the long window: a smooth plateau is no noise (`StopWatch.smooth`).
Measured on the grid: at 30-40 rounds it cut 25.3% of the agent-rounds at -0.19 points
(22.0% at -0.16 without it); at 60 rounds 47% at -0.56 against 40% at -0.40 without it, so
longer runs go without it (their long window already cuts 40%)."""
DEFAULT_STOP_RULE = "progress"
"""The rule of `--early-stop` without `--stop-rule`: the one measured best."""


REDUCE_MODES = reductions.REDUCE_MODES
"""How a round is cut to a budget (`agent.learning.reductions`, which says what each does)."""


MASK_UNITS = ("weight", "channel")
"""What a sparse model's mask keeps or drops: single weights (DA-DPFL's) or whole channels
(`agent.learning.channels`: a lower density is a smaller model to train)."""


WIRE_FORMATS = ("full", "delta", "layers")


FALLBACKS = ("local", "fleet", "off")
"""What a device may keep instead of the strategy's model (`agent.learning.fallback`)."""


OPTIMIZERS = ("auto", "sgd", "adam")
"""The local optimizers of the SGD strategies (`training.LocalOptimizer`); auto: Adam for a
model with recurrent layers, SGD otherwise (`StrategyConfig.local_training`)."""


SGD_LR = 0.1
ADAM_LR = 3e-3
"""The default learning rates of the two local optimizers (`StrategyConfig.local_training`)."""


def param(default: Any, help: str) -> Any:
    """A config field with its help text, so the CLI flags document themselves."""
    return field(default=default, metadata={"help": help})


MODEL_NAMES = ("mlp", "cnn1d", "cnn2d", "resnet18", "vgg11", "alexnet")
"""The bundled models (`agent.learning.models` builds them)."""


DEFAULT_MODELS = {
    "digits": "cnn2d",
    "mnist1d": "cnn1d",
    "synthetic": "mlp",
    "npz": "mlp",
    "imagefolder": "cnn2d",
    "cifar10": "resnet18",
}


def default_model(dataset_name: str) -> str:
    """The bundled model for a dataset: the one that learns it fastest on a small CPU, and
    the DA-DPFL paper's ResNet-18 for CIFAR-10.

    Measured centrally (SGD lr 0.1, batch 128, 2 threads, 3 seeds): on digits cnn2d reaches
    98% test accuracy in 13 epochs (~0.3 s) while mlp plateaus at 95% after 40; on MNIST-1D
    cnn1d reaches 89% in 40 epochs, mlp 57%. Synthetic data is a per-group logistic model,
    which an MLP fits (88%).
    """
    try:
        return DEFAULT_MODELS[dataset_name]
    except KeyError:
        raise ValueError(
            f"no default model for dataset {dataset_name!r}; known: {', '.join(DEFAULT_MODELS)}"
        ) from None


TASKS = ("classification", "regression", "reconstruction")
"""What a model learns (`agent.learning.tasks.Task`)."""


METRIC_GOALS = ("max", "min")


DETECTION_SCALES = ("peak", "first")
"""What the pruning-time score's change is measured against (`pruning.scaled_score`)."""


DISTANCES = ("squared", "norm")
"""How D_k^t measures an agent's distance from its initial model (`pruning.distance_from_init`)."""


BATCHNORM_MODES = ("local", "shared")
"""Where BatchNorm running statistics live: on each device (FedBN) or in the aggregate."""


DP_MODES = ("off", "sample", "client")
"""Differential privacy (`agent.learning.privacy`): none, sample-level DP-SGD on each device,
or client-level DP of a centralized round (`agent.learning.central.client_dp`)."""
DP_SAMPLE = "sample"
DP_CLIENT = "client"


@dataclass(frozen=True)
class SampleDP:
    """DP-SGD's two settings for a device's training step (`agent.learning.privacy`): each
    sample's gradient clipped to norm `clip` (C), Gaussian noise of standard deviation
    `noise` x C (sigma C) added to their sum. The batches are Poisson-sampled while it is on,
    as the accountant assumes."""

    noise: float
    clip: float


@dataclass(frozen=True)
class SGDConfig:
    """Local SGD of ALGORITHMS.md 1.5: lr 0.1 x 0.998^t, weight decay 5e-4, no momentum; or
    Adam (`optimizer`), and the gradient's norm clipped to `clip_norm` (0: never); DP-SGD's
    per-sample clipping and noise with `privacy`."""

    lr: float = 0.1
    lr_decay: float = 0.998
    momentum: float = 0.0
    weight_decay: float = 5e-4
    batch_size: int = 128
    epochs: int = 5
    optimizer: str = "sgd"
    clip_norm: float = 0.0
    privacy: SampleDP | None = None
    """Sample-level DP-SGD (`agent.learning.privacy`), or None: plain minibatches."""

    def lr_at(self, round_: int) -> float:
        return self.lr * self.lr_decay**round_


@dataclass(frozen=True)
class StrategyConfig:
    """Every hyper-parameter of a run; defaults are ALGORITHMS.md's decisions."""

    strategy: str = param(
        "dadpfl",
        "Algorithm preset: "
        + ", ".join(PRESETS)
        + "; or your own strategy class, MODULE:CLASS or ./FILE.py:CLASS (examples/own_strategy).",
    )
    rounds: int = param(30, "Communication rounds T.")
    neighbours: int = param(5, "Neighbours M per agent and round (decentralized strategies).")
    max_wait: int = param(2, "Max prior neighbours N an agent waits for (0: fully parallel).")
    topology: str = param("random", "Neighbour topology: random, ring or full.")
    epochs: int = param(5, "Local epochs E per round.")
    batch_size: int = param(128, "Local batch size (the local set if smaller).")
    lr: float | None = param(
        None,
        f"Initial learning rate [default: {SGD_LR} with SGD, {ADAM_LR} with Adam; the FedAdam "
        "presets 0.001].",
    )
    lr_decay: float = param(0.998, "Learning-rate decay per round: lr x decay^t (FedAdam: 1).")
    weight_decay: float = param(5e-4, "SGD weight decay.")
    momentum: float = param(0.9, "SGD momentum (the DA-DPFL and DisPFL papers used 0).")
    optimizer: str = param(
        "auto",
        "Local optimizer of the SGD strategies: sgd (with --momentum), adam (Adam with "
        "decoupled weight decay, moments restarted every round) or auto (adam for a model "
        "with recurrent layers, which plain SGD barely trains; sgd otherwise). The FedAdam "
        "presets keep their own Adam.",
    )
    clip_norm: float = param(
        2.0,
        "Clip each local step's gradient to this norm (0: never): a step that would jump "
        "far (a recurrent model's rare huge gradient, an aggregate's first minibatches) "
        "keeps its direction at a bounded length.",
    )
    density: float = param(0.5, "Initial ERK density of the sparse models (1 - sparsity).")
    mask_unit: str = param(
        "weight",
        "What the sparse strategies' masks keep or drop: weight (single weights, the paper's: "
        "a lower density saves counted FLOPs and bytes, not seconds on dense kernels) or "
        "channel (whole neurons and channels: the model trains narrower, so its density and "
        "a budget's density cap save real time and memory).",
    )
    rigl_a: float = param(0.3, "RigL drop fraction a: alpha_t = a/2 (1 + cos(pi t / T)).")
    rigl_batches: int = param(1, "Local batches for RigL's dense gradient.")
    delta_pr: float | None = param(
        None,
        "Pruning-time detection threshold delta_pr: an agent votes 'settled' once its score "
        "falls below it [default: 0.1 with --detection-scale peak, 0.02 with first, the "
        "paper's].",
    )
    detection_distance: str = param(
        "norm",
        "Distance D of the detection score: ||w - w0|| (norm, ALGORITHMS.md 1.7, as the "
        "DA-DPFL authors' code computes it) or ||w - w0||^2 (squared, as the paper prints it).",
    )
    detection_scale: str = param(
        "peak",
        "What the detection score's change |D^t - D^(t-1)| is divided by: the largest change "
        "so far (peak: 'the model moves at less than delta_pr of its fastest', free of D^1's "
        "own scale) or D^1 (first, the paper's).",
    )
    delta_v: float = param(0.5, "Fraction of votes that decides the first pruning time t*.")
    schedule_b: float = param(0.0, "Pruning schedule delay b: I_tau = ceil((t* + b) / c^(tau-1)).")
    schedule_c: float = param(1.3, "Pruning schedule factor c.")
    pqi_p: float = param(0.5, "PQI norm p.")
    pqi_q: float = param(1.0, "PQI norm q.")
    pqi_eta_c: float = param(0.0, "PQI compression hyper-parameter eta_c.")
    pqi_gamma: float = param(1.0, "PQI scaling factor gamma.")
    pqi_beta: float = param(0.9, "PQI cap beta on the fraction pruned per layer and event.")
    target_sparsity: float = param(0.8, "Target sparsity s* that further pruning stops at.")
    fp16: bool = param(False, "Send model values as fp16.")
    batchnorm: str = param(
        "local",
        "BatchNorm running statistics: local (each device keeps its own, FedBN) or shared "
        "(aggregated like the weights).",
    )
    reduce: str = param("prune", reductions.MODES_HELP)
    fallback: str = param(
        "local",
        "What each device may keep and serve instead of the strategy's model, judged on its "
        "own validation data after every round: local (the best of the strategy's model, the "
        "fleet's global model where there is one, and a local-only model trained beside them "
        "until it stops improving: extra local training, reported as fallback FLOPs), fleet "
        "(the best of the models it holds, no extra training) or off (the strategy's model, "
        "as the papers evaluate).",
    )
    early_stop: bool = param(
        False,
        "Stop an agent once L = 0.7 L_train + 0.3 L_val stops improving (see --stop-rule).",
    )
    stop_rule: str = param(
        DEFAULT_STOP_RULE,
        "Early stopping rule: progress (stop once the last --stop-patience rounds improved the "
        "best L by at most --stop-delta of its improvement since round 1; measured best, "
        "studies/early_stopping.py), scaled (progress over the last third of the run's "
        "rounds, at least 5, with delta 0.05, or on runs of at most 40 rounds over the last "
        "fifth at that pace where L's round-to-round changes there stay within 1% of its fall "
        "since round 1, a smooth plateau; a pruning round restarts the window only when L "
        "rose beyond its noise: more cut on 30-60-round runs, bench/early_stopping.py) or "
        "paper (stop after "
        "--stop-patience consecutive rises of "
        "L, the FedSPU paper's rule with patience 1).",
    )
    stop_patience: int = param(
        0,
        "Early stopping: progress: the window of rounds (0: 20); scaled: the window (0: a "
        "third of --rounds, at least 5); paper: the consecutive rises of L that stop an "
        "agent (0: 1).",
    )
    stop_delta: float = param(
        0.1,
        "Early stopping, progress rule: the share of the agent's improvement of L since round "
        "1 that its last --stop-patience rounds must exceed to go on (0: any new best L).",
    )
    ssm_fraction: float = param(0.05, "FedAdam-SSM/-Top: fraction alpha of deltas kept (top-k).")
    ldf_n: int = param(
        4,
        "FedLDF: participants n uploading each layer (top-n divergence); with --wire layers, "
        "the neighbours each layer is fetched from.",
    )
    wire: str = param(
        "full",
        "What decentralized agents send: full (their sparse model), delta (the top-k of its "
        "change since what receivers hold; every agent follows every peer) or layers (a "
        "divergence vector, then the layers each receiver asks for: FedLDF between neighbours).",
    )
    delta_fraction: float = param(0.1, "--wire delta: fraction of the kept entries sent (top-k).")
    aggregation: str = param(
        robust_rules.SCREENED,
        "How received models combine: screened (the strategy's mean, sample-weighted where it "
        "weights, with --clip auto in front: the default defence), signs (screened, then the "
        "step reversed wherever fewer than 30% of the senders, on balance, step the same way: "
        "against backdoors, for the strategies with a coordinator but the Adam family), mean "
        "(the same without a defence unless --clip asks for one), or element-wise over the "
        "senders that hold each "
        "element, unweighted: median or trimmed:F (the mean without the largest and smallest "
        "fraction F, 0 <= F < 0.5), each after dropping non-finite and absurdly large models.",
    )
    clip: str = param(
        robust_rules.CLIP_DEFAULT,
        "Screening and norm clipping of each received model's difference to the receiver's "
        "own model: off, auto (non-finite models and those beyond 3x the median distance of "
        "the received models, or beyond the own model's norm, are screened out, the rest "
        "clipped to 2x it), a norm bound, or default (auto, but off with --aggregation mean). "
        "Each round's record lists the models it screened out and clipped; a round that "
        "screens out every one is a warning in the log.",
    )
    secure_aggregation: bool = param(
        False,
        "Secure aggregation (the centralized strategies but fedbuff-ssm; the default "
        "--aggregation becomes the plain mean, as the coordinator sees no single model to "
        "screen): each device uploads its update masked over an index set agreed before "
        "masking (fedspu, feddrop: the whole model, 0 outside its part; fedldf: 0 outside the "
        "layers asked of it; fedadam-top, -ssm: the union of the devices' top-k masks, which "
        "each sends first) so that the coordinator learns only the fleet's weighted sum and "
        "that index set, and the round survives 30% of the devices dropping "
        "(docs/privacy.md). fedbuff: each version is one secure sum over a cohort of K = "
        "--buffer-size devices (at least 3), each masking its staleness-weighted delta "
        "(docs/asynchronous.md).",
    )

    dp: str = param(
        "off",
        "Differential privacy: off, or sample (DP-SGD on each device: every sample's gradient "
        "clipped to --dp-clip and Gaussian noise of --dp-noise x --dp-clip added, batches "
        "Poisson-sampled, epsilon at --dp-delta tracked by an accountant; docs/privacy.md), "
        "or client (centralized strategies: each device's update clipped to --dp-clip, "
        "Gaussian noise of --dp-noise x --dp-clip added to their sum at the aggregator).",
    )
    dp_noise: float = param(1.0, "DP noise multiplier sigma (with --dp sample or client).")
    dp_clip: float = param(
        1.0,
        "DP clip norm C: of each sample's gradient (--dp sample) or each device's update "
        "(--dp client).",
    )
    dp_delta: float = param(1e-5, "DP delta the reported epsilon is at (with --dp).")
    dp_average: float = param(
        0.0,
        "--dp sample: the model a device keeps, serves and reports is a moving average of "
        "its strategy's models over the rounds, this share of the previous average and the "
        "rest of the round's model (0: the round's model alone); it trains and sends the "
        "strategy's own. Post-processing: no privacy cost (docs/privacy.md).",
    )
    dp_seeded_noise: bool = param(
        False,
        "(research) --dp client --secure-aggregation: each device draws its noise share from "
        "the run's seed (fleet seed, agent, round), so an emulated run reproduces a simulated "
        "one; a coordinator that knows the seed could then subtract the noise, so for the lab "
        "only. Off: each device draws it from the operating system's randomness.",
    )
    max_epsilon: float | None = param(
        None,
        "With --dp: a device whose next round would take its epsilon past this stops "
        "and shares nothing more (none: no limit).",
    )

    asynchronous: bool = param(
        False,
        "Asynchronous rounds (dadpfl, dispfl, dfedavgm): an agent never waits for a neighbour; "
        "it aggregates the freshest model each neighbour has published, weighted by its "
        "staleness (--staleness-weight), and ignores one more than --max-staleness rounds old.",
    )
    staleness_weight: str = param(
        STALENESS_WEIGHTS[0],
        "How much a model or update s rounds stale counts (asynchronous rounds, fedbuff): "
        "polynomial ((1+s)^-0.5, FedBuff's), constant (1) or hinge (1 up to 4 rounds, then "
        "1/(10(s-4)+1)).",
    )
    max_staleness: int = param(
        5,
        "Asynchronous rounds, fedbuff: a model or update more than this many rounds stale is "
        "ignored (bounded staleness).",
    )

    buffer_size: int = param(
        0,
        "FedBuff: updates K the server buffers before it applies them as a new version "
        "(0: a third of the fleet, at least 1: about three versions a pass of the fleet; "
        "with --secure-aggregation, K distinct devices a cohort, at least 3).",
    )

    def __post_init__(self) -> None:
        # `--clip default` is resolved here, once, so that every reader sees off or auto;
        # under --dp client it is off: the device's clip to --dp-clip bounds every update
        # the default screened mean is the plain mean under --secure-aggregation: the
        # coordinator learns only the sum, so it has no single model to screen
        clip = self.clip
        if self.dp == DP_CLIENT and clip == robust_rules.CLIP_DEFAULT:
            clip = robust_rules.CLIP_OFF
        if (
            self.secure_aggregation
            and self.aggregation == robust_rules.SCREENED
            and self.clip == robust_rules.CLIP_DEFAULT
        ):
            object.__setattr__(self, "aggregation", "mean")
        object.__setattr__(self, "clip", robust_rules.default_clip(self.aggregation, clip))

    @property
    def pruning_threshold(self) -> float:
        """delta_pr, or its default for the detection scale: 0.1 of the peak change (measured
        on the examples, digits and mnist1d: bench/learning_quality.py), the paper's 0.02 of
        D^1."""
        if self.delta_pr is not None:
            return self.delta_pr
        return 0.1 if self.detection_scale == "peak" else 0.02

    def local_training(self, recurrent: bool = False) -> SGDConfig:
        """How an agent trains locally: the optimizer (`auto`: Adam for a `recurrent` model,
        else SGD) and its learning rate (the optimizer's default unless given)."""
        optimizer = self.optimizer
        if optimizer == "auto":
            optimizer = "adam" if recurrent else "sgd"
        default_lr = ADAM_LR if optimizer == "adam" else SGD_LR
        return SGDConfig(
            lr=default_lr if self.lr is None else self.lr,
            lr_decay=self.lr_decay,
            momentum=self.momentum,
            weight_decay=self.weight_decay,
            batch_size=self.batch_size,
            epochs=self.epochs,
            optimizer=optimizer,
            clip_norm=self.clip_norm,
            privacy=self.sample_dp,
        )

    @property
    def sample_dp(self) -> SampleDP | None:
        """DP-SGD's settings with `--dp sample`, else None."""
        if self.dp != DP_SAMPLE:
            return None
        return SampleDP(noise=self.dp_noise, clip=self.dp_clip)


def preset(name: str, **overrides: Any) -> StrategyConfig:
    """The configuration of a named preset, with explicit overrides applied on top.

    A preset fixes what defines its method (DisPFL never waits, DFedAvgM uses momentum 0.9);
    an override that contradicts it is an error rather than silently ignored.
    """
    record = strategies.strategy(name)
    fixed, defaults = record.fixed, record.defaults
    unknown = set(defaults) - {f.name for f in fields(StrategyConfig)}
    if unknown:  # a user strategy's `preset` (the table's are checked by the tests)
        raise ValueError(f"{name}: its preset sets unknown options {', '.join(sorted(unknown))}")
    for key, value in fixed.items():
        if key in overrides and overrides[key] != value:
            flag = "--" + key.replace("_", "-")
            raise ValueError(f"{name} fixes {flag} to {value}; got {overrides[key]}")
    return StrategyConfig(**{**defaults, **overrides, **fixed, "strategy": name})


def round_steps(
    samples: int, batch_size: int, epochs: int, step_fraction: float | None = None
) -> int:
    """The minibatch steps of a round of `epochs` over `samples` in batches of `batch_size`
    (the last one short, as `training` splits them), or `step_fraction` of them (at least
    one). Torch-free, so the privacy accountant counts a round's steps without torch."""
    steps = epochs * -(-samples // max(min(batch_size, samples), 1))
    return steps if step_fraction is None else max(1, int(step_fraction * steps))
