"""A process that starts a run collects its start-up garbage and freezes what survives, so the
full collections of the rounds leave its long-lived objects out (`agent.runtime.heap`)."""

from __future__ import annotations

import gc
import weakref

from agent.runtime.heap import settle_heap


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def test_settling_collects_start_up_garbage_and_freezes_the_rest() -> None:
    garbage_a, garbage_b = Node(), Node()
    garbage_a.other, garbage_b.other = garbage_b, garbage_a  # a cycle: only gc frees it
    gone = weakref.ref(garbage_a)
    del garbage_a, garbage_b
    survivor = Node()
    gc.unfreeze()
    settle_heap()
    assert gone() is None, "the start-up cycle was not collected"
    assert gc.get_freeze_count() > 0
    assert not any(obj is survivor for obj in gc.get_objects()), "a survivor is still walked"
