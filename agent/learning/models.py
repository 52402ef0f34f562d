"""The bundled models, seeded construction, prunable tensors and FLOP counting.

Every conv model uses GroupNorm, never BatchNorm, so a model is fully described by its
parameters: there are no running statistics to average, send or keep personal. Models are
written here (no torchvision) and take any input shape and class count.

The rules below also serve a user's own ``nn.Module`` (``check_supported`` says up front when
one breaks them): the prunable tensors are the weights of Conv1d, Conv2d (depthwise and
grouped included) and Linear layers and the weight matrices of RNN, GRU and LSTM layers (and
their cells); everything else (biases, norms, embeddings, other modules) stays dense. FLOPs
are read from one forward pass with hooks, so no architecture needs a table of its own.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy
from torch.nn.utils.rnn import PackedSequence

from agent.learning.config import MODEL_NAMES
from agent.user_code import build_user_model, is_import_path

# Layers whose `weight` is prunable: one weight applied at every output position. Other
# modules (agent/learning/freezing.py) rely on exactly these types, which have that layout.
PRUNABLE_TYPES = (nn.Conv1d, nn.Conv2d, nn.Linear)
# Recurrent layers: every weight matrix (`_RECURRENT_MATRIX`) is prunable and applied once per
# time step and sample. Cells are one step per call.
RECURRENT_TYPES = (nn.RNN, nn.GRU, nn.LSTM, nn.RNNCell, nn.GRUCell, nn.LSTMCell)
# weight_ih_l{k}, weight_hh_l{k}, LSTM's projection weight_hr_l{k}, each with `_reverse` for
# the second direction; weight_ih and weight_hh of the cells. Biases are never matched.
_RECURRENT_MATRIX = re.compile(r"weight_(ih|hh|hr)(_l\d+(_reverse)?)?")


def group_norm(channels: int) -> nn.GroupNorm:
    """GroupNorm with 32 groups where a layer is wide enough (the DisPFL / DA-DPFL reference
    models), otherwise the largest divisor of `channels` that leaves at least 2 channels per
    group: a single channel per group would normalize a 1x1 feature map to zero."""
    return nn.GroupNorm(math.gcd(channels, min(32, max(1, channels // 2))), channels)


def _pooled(size: Sequence[int]) -> tuple[bool, list[int]]:
    """Whether a 2x2 max-pool fits, and the spatial size after it. Pools are skipped on maps
    smaller than 2x2 so the deep models also run on small inputs such as 8x8 digits."""
    if min(size) < 2:
        return False, list(size)
    return True, [s // 2 for s in size]


class MLP(nn.Module):
    """Flatten, then Linear-ReLU per hidden width, then a Linear classifier."""

    def __init__(
        self, input_shape: Sequence[int], num_classes: int, hidden: Sequence[int] = (128, 64)
    ) -> None:
        super().__init__()
        widths = [math.prod(input_shape), *hidden]
        layers: list[nn.Module] = [nn.Flatten()]
        for w_in, w_out in zip(widths[:-1], widths[1:], strict=True):
            layers += [nn.Linear(w_in, w_out), nn.ReLU()]
        layers.append(nn.Linear(widths[-1], num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return cast(Tensor, self.net(x))


class CNN1D(nn.Module):
    """Three strided Conv1d-GroupNorm-ReLU blocks and a Linear classifier over the flattened
    features (after the MNIST-1D paper's CNN), for C x L signals."""

    def __init__(self, input_shape: Sequence[int], num_classes: int, width: int = 32) -> None:
        super().__init__()
        channels, length = input_shape
        layers: list[nn.Module] = []
        for i, k in enumerate((5, 3, 3)):
            layers += [
                nn.Conv1d(
                    channels if i == 0 else width, width, k, stride=2, padding=k // 2, bias=False
                ),
                group_norm(width),
                nn.ReLU(),
            ]
            length = (length - 1) // 2 + 1
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(width * length, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return cast(Tensor, self.classifier(self.features(x).flatten(1)))


class CNN2D(nn.Module):
    """Two Conv2d(3x3)-GroupNorm-ReLU-MaxPool blocks (16 and 32 channels by default) and a
    Linear classifier over the flattened map, for C x H x W images. The widths are the fastest
    to 98% on digits on a 2-core CPU (measured against 8/16 and 32/64)."""

    def __init__(
        self, input_shape: Sequence[int], num_classes: int, widths: Sequence[int] = (16, 32)
    ) -> None:
        super().__init__()
        channels, size = input_shape[0], list(input_shape[1:])
        layers: list[nn.Module] = []
        for w in widths:
            layers += [nn.Conv2d(channels, w, 3, padding=1, bias=False), group_norm(w), nn.ReLU()]
            pool, size = _pooled(size)
            if pool:
                layers.append(nn.MaxPool2d(2))
            channels = w
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(channels * math.prod(size), num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return cast(Tensor, self.classifier(self.features(x).flatten(1)))


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 convs with GroupNorm, identity or 1x1-conv shortcut."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.norm1 = group_norm(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.norm2 = group_norm(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), group_norm(c_out)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = torch.relu(self.norm1(self.conv1(x)))
        return torch.relu(self.norm2(self.conv2(out)) + self.shortcut(x))


class ResNet18(nn.Module):
    """CIFAR-style ResNet-18 (3x3 stem, no stem pooling, stages of 64-128-256-512 channels,
    global average pooling), as in the DisPFL / DA-DPFL experiments; ~11.2M parameters for
    3x32x32 input and 10 classes."""

    def __init__(self, input_shape: Sequence[int], num_classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(input_shape[0], 64, 3, padding=1, bias=False), group_norm(64), nn.ReLU()
        )
        blocks: list[nn.Module] = []
        c_in = 64
        for c_out, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            blocks += [BasicBlock(c_in, c_out, stride), BasicBlock(c_out, c_out, 1)]
            c_in = c_out
        self.layers = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(512, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return cast(Tensor, self.classifier(self.pool(self.layers(self.stem(x))).flatten(1)))


class VGG11(nn.Module):
    """CIFAR-style VGG-11 (configuration A: eight 3x3 convs with GroupNorm, five max-pools,
    one Linear classifier on 512 features), as in the DisPFL reference. Global average pooling
    before the classifier makes it independent of the input size."""

    CONFIG = (
        (64, True),
        (128, True),
        (256, False),
        (256, True),
        (512, False),
        (512, True),
        (512, False),
        (512, True),
    )  # (width, max-pool after)

    def __init__(self, input_shape: Sequence[int], num_classes: int) -> None:
        super().__init__()
        channels, size = input_shape[0], list(input_shape[1:])
        layers: list[nn.Module] = []
        for width, pool_after in self.CONFIG:
            layers += [
                nn.Conv2d(channels, width, 3, padding=1, bias=False),
                group_norm(width),
                nn.ReLU(),
            ]
            channels = width
            if pool_after:
                pool, size = _pooled(size)
                if pool:
                    layers.append(nn.MaxPool2d(2))
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(512, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return cast(Tensor, self.classifier(self.pool(self.features(x)).flatten(1)))


class AlexNet(nn.Module):
    """The small-image AlexNet of the DA-DPFL reference code (five 3x3 convs, the first with
    stride 2, three max-pools, a 2x2 adaptive average pool and a 4096-4096 classifier with
    dropout 0.5), with GroupNorm added after each conv."""

    def __init__(self, input_shape: Sequence[int], num_classes: int) -> None:
        super().__init__()
        channels, size = input_shape[0], list(input_shape[1:])
        layers: list[nn.Module] = []
        for i, (width, pool_after) in enumerate(
            ((64, True), (192, True), (384, False), (256, False), (256, True))
        ):
            stride = 2 if i == 0 else 1
            layers += [
                nn.Conv2d(channels, width, 3, stride=stride, padding=1, bias=False),
                group_norm(width),
                nn.ReLU(),
            ]
            size = [(s - 1) // stride + 1 for s in size]
            if pool_after:
                pool, size = _pooled(size)
                if pool:
                    layers.append(nn.MaxPool2d(2))
            channels = width
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.classifier = nn.Sequential(
            nn.Dropout(0.5),
            nn.Linear(256 * 4, 4096),
            nn.ReLU(),
            nn.Dropout(0.5),
            nn.Linear(4096, 4096),
            nn.ReLU(),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return cast(Tensor, self.classifier(self.pool(self.features(x)).flatten(1)))


_BUILDERS: dict[str, Callable[[tuple[int, ...], int], nn.Module]] = {
    "mlp": MLP,
    "cnn1d": CNN1D,
    "cnn2d": CNN2D,
    "resnet18": ResNet18,
    "vgg11": VGG11,
    "alexnet": AlexNet,
}
_INPUT_DIMS = {"cnn1d": 2, "cnn2d": 3, "resnet18": 3, "vgg11": 3, "alexnet": 3}


def build_model(
    name: str, input_shape: tuple[int, ...], num_classes: int, *, seed: int
) -> nn.Module:
    """Build model `name` (a bundled one, or a user's builder as MODULE:FUNCTION or
    ./FILE.py:FUNCTION, `user_code`) with weights drawn from `seed` alone, so every agent of a
    fleet starts from the same weights. The global torch RNG is forked, not reseeded."""
    if is_import_path(name):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return build_user_model(name, tuple(input_shape), num_classes)
    if name not in _BUILDERS:
        raise ValueError(
            f"unknown model {name!r}; known: {', '.join(MODEL_NAMES)}, or your own as "
            "MODULE:FUNCTION or ./FILE.py:FUNCTION"
        )
    dims = _INPUT_DIMS.get(name)
    if dims is not None and len(input_shape) != dims:
        raise ValueError(
            f"model {name!r} needs a {dims}-D input shape (channels first), got {input_shape}"
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _BUILDERS[name](tuple(input_shape), num_classes)


def _key(module_name: str, tensor_name: str) -> str:
    """The state-dict key of a module's own tensor (the root module's have no prefix)."""
    return f"{module_name}.{tensor_name}" if module_name else tensor_name


def _prunable_of(module: nn.Module) -> list[str]:
    """The module's own prunable tensor names: `weight` of a conv/linear layer, the weight
    matrices of a recurrent layer, nothing for any other module."""
    if isinstance(module, PRUNABLE_TYPES):
        return ["weight"]
    if isinstance(module, RECURRENT_TYPES):
        return [
            n for n, _ in module.named_parameters(recurse=False) if _RECURRENT_MATRIX.fullmatch(n)
        ]
    return []


def prunable_names(model: nn.Module) -> list[str]:
    """State-dict keys of the prunable tensors, in state-dict order: the weights of Conv1d,
    Conv2d (depthwise and grouped too) and Linear layers and the weight matrices of RNN, GRU
    and LSTM layers and cells. Biases, norms, embeddings and any other module's tensors stay
    dense: they are small, or (embeddings) a pruned row would silently drop a token."""
    names = {_key(n, t) for n, m in model.named_modules() for t in _prunable_of(m)}
    return [k for k in model.state_dict() if k in names]


def count_params(model: nn.Module, masks: dict[str, Tensor] | None = None) -> int:
    """Number of parameters; with masks, a masked tensor counts only its kept entries."""
    masks = masks or {}
    return sum(
        int(masks[n].count_nonzero()) if n in masks else p.numel()
        for n, p in model.named_parameters()
    )


def check_supported(model: nn.Module) -> None:
    """Raise ValueError, in one sentence, when `model` breaks the rules every strategy relies
    on; call it before a run starts, so a user's module fails there and not in round 3.

    The rules: the model has parameters, all of them real floating point (they are averaged,
    pruned and sent as floats), no tensor is reachable under two names (tied weights, or one
    module registered twice: the state dict would carry it twice, agents would average and
    send both copies and loading would untie them), no lazy parameter is left uninitialized
    (its shape is unknown), and every state-dict entry is a tensor. Integer buffers (such as
    BatchNorm's `num_batches_tracked`) are allowed: aggregation copies them instead of
    averaging (agent/learning/sparse.py).
    """
    kind = type(model).__name__
    params = list(model.named_parameters(remove_duplicate=False))
    if not params:
        raise ValueError(f"the model ({kind}) has no parameters, so there is nothing to train")
    seen: dict[int, str] = {}
    for name, tensor in [*params, *model.named_buffers(remove_duplicate=False)]:
        if id(tensor) in seen:
            raise ValueError(
                f"{name!r} is the same tensor as {seen[id(tensor)]!r} (tied or shared weights), "
                "which the state dict would carry twice; give each module its own tensor"
            )
        seen[id(tensor)] = name
        if is_lazy(tensor):
            raise ValueError(f"{name!r} is uninitialized (lazy); run one forward pass first")
        if tensor.is_complex():
            raise ValueError(
                f"{name!r} is complex ({tensor.dtype}); only real tensors are supported"
            )
    for name, param in params:
        if not param.is_floating_point():
            raise ValueError(f"parameter {name!r} is {param.dtype}, not floating point")
    for key, value in model.state_dict().items():
        if not isinstance(value, Tensor):
            raise ValueError(f"state-dict entry {key!r} is a {type(value).__name__}, not a tensor")


def _steps(module: nn.Module, inputs: tuple[object, ...], output: object) -> int:
    """How many times one forward call applies each prunable tensor of `module`.

    Conv: the output positions (all channels of one position share the weight count, grouped
    and depthwise convs included, since each output channel reads in_channels / groups of the
    input). Linear: the output rows. Recurrent: the (time step, sample) pairs of its input,
    since every layer's matrices, both directions', run once per step: T x N for (T, N, I),
    N x T for batch_first (N, T, I) (the product is layout-free), T for unbatched (T, I), the
    packed row count for a PackedSequence, N for a cell.
    """
    if isinstance(module, nn.Conv1d | nn.Conv2d):
        return cast(Tensor, output).numel() // module.out_channels
    if isinstance(module, nn.Linear):
        return cast(Tensor, output).numel() // module.out_features
    x = inputs[0]
    if isinstance(x, PackedSequence):
        return int(x.data.shape[0])
    x = cast(Tensor, x)
    return x.numel() // x.shape[-1]


def _probe(model: nn.Module, input_shape: tuple[int, ...]) -> Tensor:
    """One all-zero sample for counting: token ids (int64 zeros) when the model has an
    Embedding (it takes ids, not values), else zeros in the first parameter's float dtype."""
    param = next(model.parameters(), None)
    device = param.device if param is not None else None
    if any(isinstance(m, nn.Embedding | nn.EmbeddingBag) for m in model.modules()):
        return torch.zeros((1, *input_shape), dtype=torch.long, device=device)
    floating = param is not None and param.is_floating_point()
    dtype = param.dtype if param is not None and floating else None
    return torch.zeros((1, *input_shape), dtype=dtype, device=device)


def output_positions(model: nn.Module, input_shape: tuple[int, ...]) -> dict[str, int]:
    """For each prunable tensor (by state-dict name), the number of positions it is applied
    at in one forward pass of one sample, read with forward hooks (`_steps`): output
    positions for Conv1d, Conv2d and Linear, time steps for recurrent matrices. A module
    called several times sums its calls.

    A tensor's MACs are its kept weight count times this number (a conv's output position
    costs one MAC per weight, a recurrent step one per matrix entry), so FLOPs under any mask
    follow from it without running the model again (`flops_from_positions`). A prunable
    tensor the forward pass never reaches gets 0.
    """
    positions = dict.fromkeys(prunable_names(model), 0)

    def hook(keys: list[str]) -> Callable[[nn.Module, tuple[object, ...], object], None]:
        def record(module: nn.Module, inputs: tuple[object, ...], output: object) -> None:
            steps = _steps(module, inputs, output)
            for key in keys:
                positions[key] += steps

        return record

    handles = []
    for name, module in model.named_modules():
        keys = [_key(name, t) for t in _prunable_of(module)]
        if keys:
            handles.append(module.register_forward_hook(hook(keys)))
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            model(_probe(model, input_shape))
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return positions


def flops_from_positions(
    positions: dict[str, int],
    shapes: dict[str, tuple[int, ...]],
    masks: dict[str, Tensor] | None = None,
) -> int:
    """`forward_flops` from `output_positions` and the weights' shapes: 2 x sum over prunable
    tensors of kept weights x positions (all weights of an unmasked tensor are kept)."""
    masks = masks or {}
    unknown = set(masks) - set(positions)
    if unknown:
        raise ValueError(f"masks for non-prunable or unknown tensors: {sorted(unknown)}")
    macs = 0
    for name, count in positions.items():
        mask, shape = masks.get(name), shapes[name]
        if mask is not None and tuple(mask.shape) != tuple(shape):
            raise ValueError(
                f"mask {name} has shape {tuple(mask.shape)}, weight has {tuple(shape)}"
            )
        kept = int(mask.count_nonzero()) if mask is not None else math.prod(shape)
        macs += kept * count
    return 2 * macs


def forward_flops(
    model: nn.Module, input_shape: tuple[int, ...], masks: dict[str, Tensor] | None = None
) -> int:
    """FLOPs of one forward pass of one sample, counting a multiply-accumulate as 2 FLOPs.

    Only the prunable tensors are counted (Conv1d, Conv2d and Linear weights, recurrent
    weight matrices); norms, activations, pooling, embeddings lookups, recurrent gate
    arithmetic, residual additions and bias additions are a small fraction and are ignored. A
    tensor's MACs are its weight count times the number of positions it is applied at (read
    with forward hooks, `output_positions`); under a mask only kept weights count (dense MACs
    x layer density).
    """
    masks = masks or {}
    unknown = set(masks) - set(prunable_names(model))
    if unknown:
        raise ValueError(f"masks for non-prunable or unknown tensors: {sorted(unknown)}")
    positions = output_positions(model, input_shape)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters() if name in positions}
    return flops_from_positions(positions, shapes, masks)
