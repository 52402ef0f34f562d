"""Tracing a model (agent/learning/fx_graph.py `traced`) while other threads of the process run
their own models, as agents hosted in one process do (agent/host.py): torch.fx patches every
module's call process-wide while it traces, and a hosted agent judging its round while another
traced its model for FedSPU's neuron groups died with torch.fx's ``NameError: module is not
installed as a submodule``. Neither side may disturb the other: the other threads' forward
passes run untouched, and the trace still sees its own model's layers."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from agent.learning.freezing import freezing_plan
from agent.learning.fx_graph import traced
from agent.learning.models import build_model

THREADS = 4
TRACES = 40
INPUT = (1, 28, 28)
SWITCH_INTERVAL_S = 1e-5


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.ReLU(), nn.Linear(32, 10))


@contextlib.contextmanager
def _computing(models: list[nn.Module]) -> Iterator[list[str]]:
    """Threads running `models`' forward passes, each its own, over and over until the block
    ends; yields the failures: any error, or an output other than the model's own alone."""
    x = torch.randn(2, *INPUT)
    with torch.no_grad():
        expected = [m(x) for m in models]
    stop = threading.Event()
    start = threading.Barrier(len(models) + 1)
    failures: list[str] = []

    def compute(index: int) -> None:
        start.wait()
        try:
            while not stop.is_set():
                with torch.no_grad():
                    out = models[index](x)
                if not torch.equal(out, expected[index]):
                    failures.append(f"model {index} computed another output")
        except Exception as exc:  # the failure under test: reported by the test
            failures.append(repr(exc))

    workers = [threading.Thread(target=compute, args=(i,), daemon=True) for i in range(len(models))]
    for worker in workers:
        worker.start()
    try:
        start.wait()
        yield failures
    finally:
        stop.set()
        for worker in workers:
            worker.join()


def test_forward_passes_in_other_threads_survive_traces() -> None:
    """Threads running their own models' forward passes while the main thread traces, again
    and again, all run untouched: no torch.fx NameError, the outputs of their models alone."""
    torch.manual_seed(0)
    model = build_model("cnn2d", INPUT, 10, seed=0)
    with _computing([_mlp() for _ in range(THREADS)]) as failures:
        for _ in range(TRACES):
            graph = traced(model, INPUT)
            assert any(node.op == "call_module" for node in graph.nodes)
    assert failures == []


def test_a_trace_meanwhile_still_finds_its_own_groups() -> None:
    """The plan a trace finds while other threads compute is the one it finds alone."""
    model = build_model("cnn2d", INPUT, 10, seed=0)
    alone = freezing_plan(model, INPUT)
    assert alone.groups
    with _computing([_mlp() for _ in range(2)]) as failures:
        plans = [freezing_plan(model, INPUT) for _ in range(10)]
    assert failures == []
    assert all(plan == alone for plan in plans)


@pytest.fixture(autouse=True)
def _threads_switch_often() -> Iterator[None]:
    """Threads switch every few microseconds (Python's default: 5 ms, longer than a trace), so
    the other threads do run while a trace has torch's module call patched; and every test
    leaves that call as it found it (no trace left patched in)."""
    interval = sys.getswitchinterval()
    call, getattr_ = nn.Module.__call__, nn.Module.__getattr__
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)
    assert nn.Module.__call__ is call and nn.Module.__getattr__ is getattr_
