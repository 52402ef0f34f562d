"""A training step's memory format and precision (agent/learning/precision.py): measured on
the device, used only where it measured faster, and plain fp32 everywhere else. The GPU is
where it pays (a Jetson's); these tests run the same code on the CPU, which has channels-last
and bf16 autocast too, by naming the candidates."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from agent.device import calibration
from agent.device.calibration import cached_costs, candidate_formats, measure_costs
from agent.learning.config import SGDConfig, StrategyConfig
from agent.learning.learner import LocalData
from agent.learning.model_facts import ModelFacts
from agent.learning.models import build_model, prunable_names
from agent.learning.precision import FP32, ComputeFormat, LossScale
from agent.learning.training import train_local

SHAPE = (1, 12, 12)


def model_facts() -> ModelFacts:
    model = build_model("cnn2d", SHAPE, 10, seed=1)
    config = StrategyConfig(strategy="dfedavgm", batch_size=16, epochs=1)
    return ModelFacts(model, SHAPE, prunable_names(model), config, seed=1)


def data(n: int = 48) -> LocalData:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, *SHAPE, generator=generator)
    y = torch.randint(0, 10, (n,), generator=generator)
    return LocalData(x, y, x[:8], y[:8], x[:8], y[:8])


@pytest.mark.parametrize(
    "name", ["fp32", "fp16", "bf16", "channels-last", "channels-last+fp16", "channels-last+bf16"]
)
def test_a_format_is_named_as_it_parses(name: str) -> None:
    assert ComputeFormat.parse(name).name == name


@pytest.mark.parametrize("name", ["fp8", "", "fp16+bf16", "channels-first"])
def test_an_unknown_format_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="unknown compute format"):
        ComputeFormat.parse(name)


def train(compute: ComputeFormat) -> tuple[dict[str, torch.Tensor], float, nn.Module]:
    lrn, local = model_facts(), data()
    sgd = SGDConfig(batch_size=16, epochs=1)
    result = train_local(
        lrn.model,
        lrn.initial,
        None,
        local.x_train,
        local.y_train,
        sgd,
        0,
        torch.Generator().manual_seed(2),
        compute=compute,
    )
    return result.state, result.mean_loss, lrn.model


def test_channels_last_trains_what_fp32_trains_and_hands_back_plain_tensors() -> None:
    plain, plain_loss, _ = train(FP32)
    laid, laid_loss, model = train(ComputeFormat(channels_last=True))
    for name, tensor in laid.items():
        assert tensor.is_contiguous()
        torch.testing.assert_close(tensor, plain[name], atol=1e-5, rtol=1e-4)
    assert laid_loss == pytest.approx(plain_loss, rel=1e-5)
    assert all(p.is_contiguous() for p in model.parameters())


def test_bf16_autocast_trains_in_bf16_and_keeps_fp32_weights() -> None:
    plain, plain_loss, _ = train(FP32)
    mixed, mixed_loss, _ = train(ComputeFormat(precision="bf16"))
    assert all(t.dtype == torch.float32 for t in mixed.values())
    assert mixed_loss == pytest.approx(plain_loss, rel=0.05)
    assert any(not torch.equal(mixed[n], plain[n]) for n in plain)  # it did compute in bf16


def test_fp16_loss_scaling_skips_an_overflowed_step_and_unscales_the_others() -> None:
    layer = nn.Linear(2, 2)
    scale = LossScale(ComputeFormat(precision="fp16"))
    first = scale.scale
    layer.weight.grad = torch.full((2, 2), float("inf"))
    layer.bias.grad = torch.zeros(2)
    assert not scale.unscaled(layer)
    assert scale.scale == first / 2
    layer.weight.grad = torch.full((2, 2), scale.scale)
    assert scale.unscaled(layer)
    assert torch.equal(layer.weight.grad, torch.ones(2, 2))
    untouched = LossScale(ComputeFormat(precision="bf16"))
    layer.weight.grad = torch.full((2, 2), 3.0)
    assert untouched.unscaled(layer) and torch.equal(layer.weight.grad, torch.full((2, 2), 3.0))


def test_a_cpu_times_no_other_format() -> None:
    assert candidate_formats(model_facts()) == ("fp32",)


def test_the_fastest_measured_format_is_kept_with_the_table_and_trained_in(tmp_path) -> None:
    measured = model_facts()
    table = measure_costs(measured, data(), kinds=("width",), formats=("fp32", "channels-last"))
    assert table.format in ("fp32", "channels-last")
    assert measured.compute_format == ComputeFormat.parse(table.format)
    # the table in the state folder tells a new agent process the format to train in
    forced = dataclasses.replace(table, format="channels-last")

    calibration._MEASURED[table.key] = forced
    try:
        first = model_facts()
        cached_costs(tmp_path, first, data(), kinds=("width",))
    finally:
        calibration._MEASURED.pop(table.key)
    fresh = model_facts()
    assert fresh.compute_format == FP32
    kept = cached_costs(tmp_path, fresh, data(), kinds=("width",))
    assert kept.format == "channels-last"
    assert fresh.compute_format == ComputeFormat(channels_last=True)
