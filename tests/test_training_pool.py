"""The simulator's scheduling of agents' rounds (`when_ready`): an agent starts only after
every agent it waits for was handed to the caller, never more than the slots at once, and
with one slot in the given order (the serial simulator's reuse order)."""

from __future__ import annotations

import random
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from coordinator.training_pool import when_ready

CHAINS = {"b": {"a"}, "c": {"b"}, "e": {"a", "d"}, "g": {"f"}, "h": {"c", "g"}}
ORDER = list("abcdefgh")


def schedule(slots: int, seed: int) -> tuple[list[str], list[str]]:
    """(started, handed over) for ORDER and CHAINS; rounds take a random few milliseconds
    on `slots` threads, so they finish in varying orders."""
    rng = random.Random(seed)
    started: list[str] = []
    handed: list[str] = []
    under_way: set[str] = set()

    def start(k: str) -> Future[str]:
        assert CHAINS.get(k, set()) <= set(handed), f"{k} started before what it waits for"
        assert len(under_way) < slots, "more under way than the slots"
        started.append(k)
        under_way.add(k)
        pause = rng.uniform(0, 0.005)
        return threads.submit(lambda: time.sleep(pause) or k)

    with ThreadPoolExecutor(slots) as threads:
        for k, value in when_ready(ORDER, CHAINS, start, slots):
            assert value == k
            under_way.discard(k)
            handed.append(k)
    return started, handed


def test_one_slot_keeps_the_order() -> None:
    assert schedule(1, seed=1) == (ORDER, ORDER)


@pytest.mark.parametrize("seed", range(5))
def test_several_slots_start_nothing_early_and_hand_over_everything(seed: int) -> None:
    started, handed = schedule(3, seed)
    assert sorted(started) == sorted(handed) == ORDER
    assert started[:3] == ["a", "d", "f"]  # the earliest ready ones first
