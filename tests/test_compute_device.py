"""--device: which torch device an agent trains on, and a budget that counts that compute."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from agent.device import (
    DEFAULT_EFFICIENCY,
    BudgetLimits,
    RoundWork,
    calibrated_efficiency,
    compute_budget,
    nominal_reading,
    resolve_device,
)
from agent.learning import Learner, LocalData, preset
from agent.learning.learner import RoundResult
from agent.learning.models import build_model, prunable_names
from agent.learning.reduction import Reduction
from firmware_profiles import ProfileError, list_profiles, load_profile

CUDA = torch.cuda.is_available()
JETSONS = ("jetson-nano", "jetson-orin-nano", "jetson-xavier-nx")
CPU_BOARDS = ("raspberry-pi-4", "raspberry-pi-5", "x86-laptop")
INPUT = (1, 40)
# A round that needs 100 s at the Nano's GPU rate: time-limited at 60 s on any compute.
WORK = RoundWork(train_flops=100 * 235.9e9 * DEFAULT_EFFICIENCY)
LIMITS = BudgetLimits(round_time_s=60)


def test_auto_and_cpu_resolve_to_what_torch_sees() -> None:
    assert resolve_device("auto") == torch.device("cuda" if CUDA else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(CUDA, reason="this machine has CUDA: the no-CUDA error cannot occur")
@pytest.mark.parametrize("spec", ["cuda", "cuda:0"])
def test_cuda_without_cuda_is_a_one_line_error(spec: str) -> None:
    with pytest.raises(ValueError) as info:
        resolve_device(spec)
    assert str(info.value) == (
        f"--device {spec}: this torch build sees no CUDA device "
        "(torch.cuda.is_available() is False); use --device cpu or auto"
    )


@pytest.mark.parametrize("spec", ["gpu", "", "cuda:x", "cuda:-1", "cpu:0"])
def test_an_unknown_device_is_a_one_line_error(spec: str) -> None:
    with pytest.raises(ValueError, match=f"^--device {spec}: expected") as info:
        resolve_device(spec)
    assert "\n" not in str(info.value)


def test_auto_picks_cuda_where_torch_sees_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("CUDA:0") == torch.device("cuda", 0)
    with pytest.raises(ValueError, match="^--device cuda:1: torch sees 1 CUDA device"):
        resolve_device("cuda:1")


@pytest.mark.parametrize("name", JETSONS)
def test_a_jetson_gives_its_gpu_and_its_cpu_peak(name: str) -> None:
    board = load_profile(name)
    assert board.has_gpu
    assert board.peak_for("cuda") == board.peak_fp32_gflops
    assert board.peak_for("cpu") == board.cpu_peak_fp32_gflops
    assert 0 < board.peak_for("cpu") < board.peak_for("cuda")
    assert "cpu_peak_fp32_gflops" in board.sources["peak_fp32_gflops"], "derivation missing"


@pytest.mark.parametrize("name", CPU_BOARDS)
def test_a_cpu_only_board_has_no_cuda_peak(name: str) -> None:
    board = load_profile(name)
    assert not board.has_gpu and board.peak_for("cpu") == board.peak_fp32_gflops
    with pytest.raises(ValueError, match=f"device profile '{name}' has no GPU"):
        board.peak_for("cuda")
    with pytest.raises(ValueError, match="unknown compute 'tpu'"):
        board.peak_for("tpu")


def _budget(name: str, compute: str | None) -> float:
    board = load_profile(name)
    return compute_budget(board, nominal_reading(board), WORK, LIMITS, compute=compute).p_k


@pytest.mark.parametrize("name", JETSONS)
def test_a_jetson_budgets_the_compute_it_trains_on(name: str) -> None:
    board = load_profile(name)
    gpu = compute_budget(board, nominal_reading(board), WORK, LIMITS, compute="cuda")
    cpu = compute_budget(board, nominal_reading(board), WORK, LIMITS, compute="cpu")
    assert cpu.p_k < gpu.p_k, "the same work on the slower CPU must get a smaller budget"
    assert gpu.effective_gflops == board.peak_fp32_gflops * DEFAULT_EFFICIENCY
    assert cpu.effective_gflops == pytest.approx(board.peak_for("cpu") * DEFAULT_EFFICIENCY)
    assert f"{board.peak_for('cpu'):g} cpu peak" in cpu.reason
    assert gpu.p_k == _budget(name, None), "cuda is the GPU peak, the profile's main figure"


def test_the_nano_cpu_budget_by_hand() -> None:
    """The Nano's CPU: 45.76 GFLOPS peak, 4.576 effective; 60 s of a 100 s GPU round's work
    (2359 GFLOP) is 60 x 4.576 / 2359 of it."""
    assert _budget("jetson-nano", "cpu") == pytest.approx(60 * 4.576 / 2359)


def test_a_cpu_only_board_cannot_budget_cuda() -> None:
    with pytest.raises(ValueError, match="'raspberry-pi-4' has no GPU"):
        _budget("raspberry-pi-4", "cuda")


def test_budgets_keep_their_fields() -> None:
    """`compute` changes the peak and nothing else: same limits, same memory fit."""
    nano = load_profile("jetson-nano")
    default = compute_budget(nano, nominal_reading(nano), WORK, LIMITS)
    gpu = compute_budget(nano, nominal_reading(nano), WORK, LIMITS, compute="cuda")
    assert dataclasses.replace(gpu, reason=default.reason) == default


@pytest.mark.parametrize("name", sorted(list_profiles()))
def test_the_default_budget_is_the_main_computes(name: str) -> None:
    """Without `compute` (simulate, emulate) p_k follows peak_fp32_gflops, as before."""
    board = load_profile(name)
    gflops = board.peak_fp32_gflops * DEFAULT_EFFICIENCY
    expected = min(max(60 * gflops * 1e9 / WORK.train_flops, 0.05), 1.0)
    assert _budget(name, None) == pytest.approx(expected, rel=1e-12)
    if not board.has_gpu:
        assert _budget(name, "cpu") == _budget(name, None)


def test_calibrated_efficiency_uses_the_same_peak() -> None:
    nano = load_profile("jetson-nano")
    assert calibrated_efficiency(4.576e9, 1.0, nano, compute="cpu") == pytest.approx(0.1)
    assert calibrated_efficiency(23.59e9, 1.0, nano) == pytest.approx(0.1)


PROFILE = """\
name = "my-jetson"
description = "a GPU board of my own"
peak_fp32_gflops = 500
cpu_peak_fp32_gflops = {cpu}
memory_mb = 4096
idle_power_w = 1.0
max_power_w = 10.0
link_bandwidth_mbps = 100.0
radio_power_w = 1.0
cpu_cores = 4

[sources]
cpu_peak_fp32_gflops = "4 cores x 2 GHz x 8 FLOP/cycle"
"""


def test_a_user_profile_gives_its_cpu_peak(tmp_path: Path) -> None:
    path = tmp_path / "my-jetson.toml"
    path.write_text(PROFILE.format(cpu=64))
    board = load_profile(path)
    assert board.cpu_peak_fp32_gflops == 64.0 and isinstance(board.cpu_peak_fp32_gflops, float)
    assert board.peak_for("cuda") == 500.0 and board.peak_for("cpu") == 64.0
    assert board.sources["cpu_peak_fp32_gflops"].startswith("4 cores")
    path.write_text(PROFILE.format(cpu=-1))
    with pytest.raises(ProfileError, match="'cpu_peak_fp32_gflops': must be a positive"):
        load_profile(path)


def _learner(strategy: str) -> tuple[Learner, LocalData]:
    model = build_model("cnn1d", INPUT, 10, seed=0)
    config = preset(strategy, rounds=10, epochs=2, batch_size=16)
    learner = Learner(model, INPUT, prunable_names(model), config, seed=5)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, *INPUT, generator=g), torch.randint(0, 10, (64,), generator=g)
    return learner, LocalData(x[:40], y[:40], x[40:52], y[40:52], x[52:], y[52:])


def _rounds(learner: Learner, data: LocalData) -> list[RoundResult]:
    """Three rounds that take every training path: a neighbour's model and a density cap,
    further pruning and RigL, then frozen neurons (sparse strategies)."""
    a, b = learner.init_agent("a"), learner.init_agent("b")
    inbox = {"b": learner.published(b, 12)}
    first = learner.local_round(a, data, inbox, 1, True, Reduction("prune", 0.3))
    second = learner.local_round(first.state, data, {"b": first.published}, 2, True)
    third = learner.local_round(second.state, data, {}, 3, False, Reduction("freeze", 0.5))
    return [first, second, third]


def _assert_identical(one: RoundResult, other: RoundResult) -> None:
    for name, tensor in one.state.weights.items():
        assert torch.equal(tensor, other.state.weights[name]), name
    assert one.state.masks is not None and other.state.masks is not None
    assert all(torch.equal(m, other.state.masks[n]) for n, m in one.state.masks.items())
    assert (one.loss, one.train_loss, one.train_flops) == (
        other.loss,
        other.train_loss,
        other.train_flops,
    )


def test_training_on_the_cpu_device_is_bit_identical_to_the_default() -> None:
    default, data = _learner("dadpfl")
    on_cpu, _ = _learner("dadpfl")
    assert on_cpu.to(resolve_device("cpu")) is on_cpu and on_cpu.facts.device == torch.device("cpu")
    for one, other in zip(_rounds(default, data), _rounds(on_cpu, data), strict=True):
        _assert_identical(one, other)


def test_the_adam_family_refuses_a_gpu_before_moving() -> None:
    learner, _ = _learner("fedadam")
    with pytest.raises(ValueError, match="strategy fedadam trains on the cpu only"):
        learner.to(torch.device("cuda"))
    assert learner.facts.device == torch.device("cpu")


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_training_on_cuda_returns_cpu_tensors_close_to_the_cpu_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    on_cpu, data = _learner("dadpfl")
    on_gpu, _ = _learner("dadpfl")
    assert on_gpu.to(resolve_device("cuda")).facts.device.type == "cuda"
    for cpu_round, gpu_round in zip(_rounds(on_cpu, data), _rounds(on_gpu, data), strict=True):
        state = gpu_round.state
        assert state.masks is not None
        assert all(t.device.type == "cpu" for t in [*state.weights.values(), *state.masks.values()])
        for name, mask in state.masks.items():
            assert not state.weights[name][~mask].any(), "pruned weights must stay exactly 0"
        # RigL's top-k may break near-ties differently on the GPU: no closeness asserted.
        assert math.isfinite(gpu_round.train_loss) and math.isfinite(cpu_round.train_loss)
    dense, _ = _learner("dfedavgm")
    dense_gpu, _ = _learner("dfedavgm")
    dense_gpu.to(resolve_device("cuda"))
    a = dense.init_agent("a")
    expected = dense.local_round(a, data, {}, 1, False).state.weights
    got = dense_gpu.local_round(a, data, {}, 1, False).state.weights
    for name, tensor in expected.items():
        assert got[name].device.type == "cpu"
        torch.testing.assert_close(got[name], tensor, rtol=1e-3, atol=1e-4)
    work = RoundWork.for_model(dense_gpu.facts.model, INPUT, samples=40, epochs=1, batch_size=16)
    assert work == RoundWork.for_model(
        dense.facts.model, INPUT, samples=40, epochs=1, batch_size=16
    )
