"""Exact FedSPU freezing: training inside `active_block_gradients` gives today's
restore-after-step results bit for bit, while backward computes weight gradients for the
trainable block only."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

from agent.learning import sparse, training
from agent.learning.config import SGDConfig
from agent.learning.exact_freezing import active_block_gradients
from agent.learning.freezing import active_masks, freezing_plan
from agent.learning.models import build_model, prunable_names
from agent.learning.training import train_local

BUNDLED = [("mlp", (1, 8, 8)), ("cnn1d", (1, 40)), ("cnn2d", (1, 8, 8)), ("resnet18", (3, 16, 16))]


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Bit-identity is promised with one intra-op thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Tiny(nn.Module):
    """A user's module: a conv, a conv with a residual add, a Linear on a sequence (3-D
    input), a pooled Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.mix = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.tokens = nn.Linear(8, 12)
        self.head = nn.Linear(12 * 16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x))
        h = torch.relu(self.mix(h)) + h
        seq = nn.functional.max_pool2d(h, 2).flatten(2).transpose(1, 2)  # (N, 16, 8)
        return self.out(torch.relu(self.head(torch.relu(self.tokens(seq)).flatten(1))))


def _no_context(*args: object, **kwargs: object) -> contextlib.nullcontext[None]:
    return contextlib.nullcontext()


def _outer(
    rows: int, cols: int, active_rows: int, active_cols: int, kernel: tuple[int, ...] = ()
) -> torch.Tensor:
    """A trainable mask: a random subset of rows times a random subset of columns."""
    generator = torch.Generator().manual_seed(rows * 1000 + active_rows * 10 + active_cols)
    r = torch.zeros(rows, dtype=torch.bool)
    r[torch.randperm(rows, generator=generator)[:active_rows]] = True
    c = torch.zeros(cols, dtype=torch.bool)
    c[torch.randperm(cols, generator=generator)[:active_cols]] = True
    return (
        (r[:, None] & c[None, :])
        .view(rows, cols, *(1,) * len(kernel))
        .expand(rows, cols, *kernel)
        .clone()
    )


def _train_both(
    model: nn.Module,
    shape: tuple[int, ...],
    active: dict[str, torch.Tensor],
    masks: dict[str, torch.Tensor] | None,
    momentum: float,
    samples: int,
    batch_size: int,
) -> None:
    """Train from the same start outside the context (restore-after-step) and inside it:
    the same states bit for bit and the same loss, and some tensor did train."""
    generator = torch.Generator().manual_seed(7)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if masks:
        state = sparse.apply_masks(state, masks)
    x = torch.randn(samples, *shape, generator=generator)
    y = torch.randint(0, 4, (samples,), generator=generator)
    config = SGDConfig(momentum=momentum, batch_size=batch_size, epochs=1)

    def run() -> tuple[dict[str, torch.Tensor], float]:
        result = train_local(
            model, state, masks, x, y, config, 3, torch.Generator().manual_seed(1), frozen=active
        )
        return result.state, result.mean_loss

    with pytest.MonkeyPatch.context() as patch:
        # Today's restore-after-step: train_local without its own exact-freezing context.
        patch.setattr(training, "active_block_gradients", _no_context)
        restored, restored_loss = run()
    assert any(
        p.grad is not None and p.grad[~active[n]].any()
        for n, p in model.named_parameters()
        if n in active and active[n].any()
    ), "the reference computed no gradient outside the blocks: it is not restore-after-step"
    with active_block_gradients(model, active, min_macs=0):
        exact, exact_loss = run()
    assert exact_loss == restored_loss
    for name, tensor in restored.items():
        assert torch.equal(exact[name], tensor), name
    trained = [n for n in active if active[n].any() and not torch.equal(restored[n], state[n])]
    assert trained, "nothing trained: the comparison would be vacuous"


def _assert_block_gradients(model: nn.Module, active: dict[str, torch.Tensor]) -> int:
    """The last step's weight gradients vanish outside each trainable block (restore-after-
    step leaves the full gradient there); returns how many layers were checked."""
    checked = 0
    for name, module in model.named_modules():
        mask = active.get(f"{name}.weight")
        if not isinstance(module, nn.Linear | nn.Conv1d | nn.Conv2d) or mask is None:
            continue
        grad = module.weight.grad
        if not mask.any():
            assert grad is None or not grad.any(), name
        elif not mask.all():
            assert grad is not None and not grad[~mask].any() and grad[mask].any(), name
        checked += 1
    return checked


@pytest.mark.parametrize("use_sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("fraction", [0.5, 0.2])
@pytest.mark.parametrize(("name", "shape"), BUNDLED, ids=[n for n, _ in BUNDLED])
def test_bundled_models_train_bit_for_bit_as_restore_after_step(
    name: str, shape: tuple[int, ...], fraction: float, momentum: float, use_sparse: bool
) -> None:
    model = build_model(name, shape, 4, seed=0)
    state = model.state_dict()
    generator = torch.Generator().manual_seed(3)
    active = active_masks(freezing_plan(model, shape), state, fraction, generator)
    masks = None
    if use_sparse:
        shapes = {n: state[n].shape for n in prunable_names(model)}
        masks = sparse.random_masks(shapes, dict.fromkeys(shapes, 0.5), generator)
    samples, batch = (6, 3) if name == "resnet18" else (10, 4)
    _train_both(model, shape, active, masks, momentum, samples, batch)
    partial = [n for n in prunable_names(model) if active[n].any() and not active[n].all()]
    assert partial
    assert _assert_block_gradients(model, active) >= len(partial)


def test_a_user_module_with_a_residual_add_and_a_sequence_linear() -> None:
    torch.manual_seed(0)
    model = Tiny()
    shape = (3, 8, 8)
    active = active_masks(
        freezing_plan(model, shape), model.state_dict(), 0.5, torch.Generator().manual_seed(0)
    )
    active["conv.weight"] = _outer(8, 3, 5, 3, (3, 3))
    active["mix.weight"] = _outer(8, 8, 3, 6, (3, 3))
    active["tokens.weight"] = _outer(12, 8, 7, 8)
    _train_both(model, shape, active, None, 0.9, 10, 4)
    assert _assert_block_gradients(model, active) == 5


LAYERS: list[tuple[Callable[[], nn.Module], tuple[int, ...], int, int]] = [
    # (layer, input shape, active rows, active columns)
    (lambda: nn.Linear(64, 10), (64, 64), 10, 12),
    (lambda: nn.Linear(64, 10), (5, 64), 2, 5),
    (lambda: nn.Linear(20, 12, bias=False), (4, 7, 20), 5, 20),
    (lambda: nn.Conv2d(16, 32, 3, padding=1), (8, 16, 8, 8), 6, 3),
    (lambda: nn.Conv2d(64, 64, 3, padding=1, bias=False), (2, 64, 2, 2), 12, 12),
    (lambda: nn.Conv2d(8, 16, 1, stride=2), (3, 8, 9, 9), 3, 8),
    (lambda: nn.Conv2d(3, 16, 3, dilation=2), (1, 3, 12, 12), 3, 3),
    (lambda: nn.Conv1d(4, 32, 5, stride=2, padding=2), (8, 4, 40), 6, 1),
]


@pytest.mark.parametrize(("make", "x_shape", "rows", "cols"), LAYERS)
def test_weight_gradient_is_the_dense_one_on_the_block(
    make: Callable[[], nn.Module], x_shape: tuple[int, ...], rows: int, cols: int
) -> None:
    torch.manual_seed(0)
    layer = make()
    assert isinstance(layer, nn.Linear | nn.Conv1d | nn.Conv2d)
    x = torch.randn(x_shape)
    kernel = tuple(layer.weight.shape[2:])
    mask = _outer(layer.weight.shape[0], layer.weight.shape[1], rows, cols, kernel)
    upstream = torch.randn(layer(x).shape)

    def grads() -> tuple[torch.Tensor, ...]:
        layer.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_()
        out = layer(leaf)
        out.backward(upstream)
        bias = () if layer.bias is None else (layer.bias.grad,)
        return (out.detach(), leaf.grad, layer.weight.grad, *bias)

    dense = grads()
    with active_block_gradients(layer, {"weight": mask}, min_macs=0):
        exact = grads()
    assert torch.equal(exact[0], dense[0])  # forward
    assert torch.equal(exact[1], dense[1])  # input gradient
    assert torch.equal(exact[2][mask], dense[2][mask])
    assert not exact[2][~mask].any()
    if layer.bias is not None:
        assert torch.equal(exact[3], dense[3])


def test_a_whole_frozen_layer_gets_no_gradient_and_forwards_come_back() -> None:
    torch.manual_seed(0)
    conv, linear = nn.Conv2d(1, 8, 3), nn.Linear(8 * 6 * 6, 3)
    model = nn.Sequential(conv, nn.ReLU(), nn.Flatten(), linear)
    trainable = {
        "0.weight": torch.zeros(8, 1, 3, 3, dtype=torch.bool),
        "3.weight": _outer(3, 288, 2, 100),
    }
    x = torch.randn(4, 1, 8, 8)
    upstream = torch.randn(4, 3)

    def run() -> tuple[torch.Tensor, torch.Tensor | None]:
        model.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_()
        out = model(leaf)
        out.backward(upstream)
        return out.detach(), leaf.grad

    expected, input_grad = run()
    with active_block_gradients(model, trainable, min_macs=0):
        assert "forward" in conv.__dict__ and "forward" in linear.__dict__
        out, exact_input_grad = run()
    assert torch.equal(out, expected)
    assert input_grad is not None and exact_input_grad is not None
    assert torch.equal(exact_input_grad, input_grad)
    assert conv.weight.grad is None or not conv.weight.grad.any()
    assert conv.bias is not None and conv.bias.grad is not None and conv.bias.grad.any()
    assert all("forward" not in module.__dict__ for module in model)

    with (
        pytest.raises(RuntimeError, match="boom"),
        active_block_gradients(model, trainable, min_macs=0),
    ):
        assert "forward" in conv.__dict__
        raise RuntimeError("boom")
    assert all("forward" not in module.__dict__ for module in model)
    assert torch.equal(model(x), expected)


def test_masks_that_are_not_an_outer_product_leave_the_layer_dense() -> None:
    layer = nn.Linear(16, 8)
    scattered = torch.rand(8, 16, generator=torch.Generator().manual_seed(0)) < 0.5
    with active_block_gradients(layer, {"weight": scattered}, min_macs=0):
        assert "forward" not in layer.__dict__
    with active_block_gradients(layer, {"weight": torch.ones(8, 16, dtype=torch.bool)}, min_macs=0):
        assert "forward" not in layer.__dict__
