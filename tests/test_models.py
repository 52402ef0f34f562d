"""Models, seeded construction, prunable tensors and FLOP counting of agent.learning.models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from agent.learning.config import MODEL_NAMES, default_model
from agent.learning.models import (
    build_model,
    count_params,
    forward_flops,
    output_positions,
    prunable_names,
)

DEFAULT_INPUTS = {
    "mlp": (60,),
    "cnn1d": (1, 40),
    "cnn2d": (1, 8, 8),
    "resnet18": (3, 32, 32),
    "vgg11": (3, 32, 32),
    "alexnet": (3, 32, 32),
}
CONV_MODELS = ("cnn1d", "cnn2d", "resnet18", "vgg11", "alexnet")


@pytest.fixture(scope="module")
def models() -> dict[str, nn.Module]:
    return {name: build_model(name, DEFAULT_INPUTS[name], 10, seed=0) for name in MODEL_NAMES}


def tiny_model() -> nn.Module:
    """Conv2d(1->2, 3x3) on 1x5x5 gives 2x3x3; then Linear(18 -> 4)."""
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(18, 4))


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_models_run_forward_on_default_input(models: dict[str, nn.Module], name: str) -> None:
    out = models[name](torch.randn(2, *DEFAULT_INPUTS[name]))
    assert out.shape == (2, 10) and torch.isfinite(out).all()


@pytest.mark.parametrize("name", ["cnn2d", "resnet18", "vgg11", "alexnet"])
@pytest.mark.parametrize("shape", [(1, 8, 8), (3, 20, 28)])
def test_image_models_take_other_sizes_and_channels(name: str, shape: tuple) -> None:
    model = build_model(name, shape, 7, seed=0)
    assert model(torch.randn(2, *shape)).shape == (2, 7)


def test_mlp_takes_any_input_shape() -> None:
    assert build_model("mlp", (1, 8, 8), 3, seed=0)(torch.randn(4, 1, 8, 8)).shape == (4, 3)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_same_seed_same_weights(name: str) -> None:
    shape = DEFAULT_INPUTS[name] if name in ("mlp", "cnn1d", "cnn2d") else (3, 8, 8)
    rng_before = torch.get_rng_state()
    a = build_model(name, shape, 10, seed=5).state_dict()
    b = build_model(name, shape, 10, seed=5).state_dict()
    c = build_model(name, shape, 10, seed=6).state_dict()
    assert torch.equal(torch.get_rng_state(), rng_before)  # the global RNG is left alone
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_group_norm_only_and_no_running_statistics(models: dict[str, nn.Module], name: str) -> None:
    model = models[name]
    kinds = {type(m) for m in model.modules()}
    assert not any(issubclass(k, nn.modules.batchnorm._NormBase) for k in kinds)
    assert (nn.GroupNorm in kinds) == (name in CONV_MODELS)
    assert list(model.state_dict()) == [n for n, _ in model.named_parameters()]  # no buffers


def test_resnet18_size_and_flops(models: dict[str, nn.Module]) -> None:
    model = models["resnet18"]
    assert count_params(model) == 11_173_962  # the CIFAR ResNet-18 of the papers
    assert 1.0e9 < forward_flops(model, (3, 32, 32)) < 1.2e9  # ~0.56 GMAC


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_prunable_names_are_conv_and_linear_weights(
    models: dict[str, nn.Module], name: str
) -> None:
    model = models[name]
    names = prunable_names(model)
    modules = dict(model.named_modules())
    assert names and all(n.endswith(".weight") for n in names)
    assert all(
        isinstance(modules[n.removesuffix(".weight")], nn.Conv1d | nn.Conv2d | nn.Linear)
        for n in names
    )
    keys = list(model.state_dict())
    assert names == [k for k in keys if k in names]  # state-dict order
    assert len(names) == sum(
        isinstance(m, nn.Conv1d | nn.Conv2d | nn.Linear) for m in model.modules()
    )


def test_prunable_names_exclude_biases_and_norms() -> None:
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.Flatten(), nn.Linear(4, 2))
    assert prunable_names(model) == ["0.weight", "3.weight"]
    resnet = prunable_names(build_model("resnet18", (3, 8, 8), 10, seed=0))
    assert resnet[:2] == ["stem.0.weight", "layers.0.conv1.weight"]
    assert len(resnet) == 21  # 17 convs, 3 shortcut convs, 1 linear


def test_forward_flops_by_hand() -> None:
    model = tiny_model()
    conv_macs, linear_macs = (2 * 1 * 3 * 3) * (3 * 3), 18 * 4
    assert forward_flops(model, (1, 5, 5)) == 2 * (conv_macs + linear_macs)
    conv1d = nn.Sequential(
        nn.Conv1d(2, 3, 5, stride=2, padding=2), nn.Flatten(), nn.Linear(3 * 5, 2)
    )
    assert forward_flops(conv1d, (2, 10)) == 2 * ((3 * 2 * 5) * 5 + 15 * 2)


def test_forward_flops_with_half_mask() -> None:
    model = tiny_model()
    mask = torch.zeros(2, 1, 3, 3)
    mask.view(-1)[::2] = 1  # 9 of 18 weights kept
    dense = forward_flops(model, (1, 5, 5))
    sparse = forward_flops(model, (1, 5, 5), {"0.weight": mask})
    assert sparse == dense - 2 * (2 * 1 * 3 * 3) * (3 * 3) // 2
    both = forward_flops(model, (1, 5, 5), {"0.weight": mask, "3.weight": torch.ones(4, 18).tril()})
    assert both == 2 * (81 + sum(range(1, 5)))


def test_forward_flops_rejects_bad_masks_and_keeps_mode() -> None:
    model = tiny_model().train()
    with pytest.raises(ValueError, match="non-prunable"):
        forward_flops(model, (1, 5, 5), {"0.bias": torch.ones(2)})
    with pytest.raises(ValueError, match="shape"):
        forward_flops(model, (1, 5, 5), {"0.weight": torch.ones(18)})
    forward_flops(model, (1, 5, 5))
    assert model.training
    assert not any(m._forward_hooks for m in model.modules())


def test_count_params_with_masks() -> None:
    model = tiny_model()
    assert count_params(model) == 18 + 2 + 72 + 4
    assert count_params(model, {"3.weight": torch.zeros(4, 18)}) == 18 + 2 + 4


def test_default_models() -> None:
    assert default_model("digits") == "cnn2d"
    assert default_model("mnist1d") == "cnn1d"
    assert default_model("synthetic") == "mlp"
    assert default_model("cifar10") == "resnet18"
    for name in ("npz", "imagefolder"):
        assert default_model(name) in MODEL_NAMES
    with pytest.raises(ValueError, match="digits"):
        default_model("imagenet")


def test_build_model_errors() -> None:
    with pytest.raises(ValueError, match="resnet18"):
        build_model("resnet50", (3, 32, 32), 10, seed=0)
    with pytest.raises(ValueError, match="3-D"):
        build_model("cnn2d", (64,), 10, seed=0)


def test_output_positions_of_unused_layers_and_float64_models() -> None:
    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(3, 2)
            self.spare = nn.Linear(3, 2)  # never called: applied at no position

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)  # type: ignore[no-any-return]

    assert output_positions(Unused(), (3,)) == {"used.weight": 1, "spare.weight": 0}
    assert forward_flops(Unused(), (3,), {"spare.weight": torch.zeros(2, 3)}) == 2 * 6
    # The probe sample takes the parameters' dtype.
    assert forward_flops(tiny_model().double(), (1, 5, 5)) == forward_flops(tiny_model(), (1, 5, 5))


def test_grouped_conv_macs_are_weight_count_times_output_positions() -> None:
    # groups=2: each of the 4 output channels reads 6 / 2 = 3 input channels, k = 3, over
    # 8 output positions: 4 x 3 x 3 x 8 MACs, the weight's numel times the positions.
    conv = nn.Conv1d(6, 4, 3, groups=2)
    assert conv.weight.shape == (4, 3, 3)
    assert forward_flops(conv, (6, 10)) == 2 * 4 * 3 * 3 * 8
