"""While a run is under way its process's heap is settled: start-up garbage collected, the
rest frozen, so the rounds' full collections leave the long-lived objects out; once no run
is under way the heap is unfrozen, so a process that runs run after run collects what a
finished run left behind (`agent.runtime.heap`)."""

from __future__ import annotations

import gc
import weakref

from agent.runtime.heap import settled_heap


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def walked(obj: object) -> bool:
    """Whether the collector's next full collection looks at `obj`."""
    return any(found is obj for found in gc.get_objects())


def test_a_run_collects_start_up_garbage_and_its_collections_skip_the_rest() -> None:
    garbage_a, garbage_b = Node(), Node()
    garbage_a.other, garbage_b.other = garbage_b, garbage_a  # a cycle: only gc frees it
    gone = weakref.ref(garbage_a)
    del garbage_a, garbage_b
    survivor = Node()
    with settled_heap():
        assert gone() is None, "the start-up cycle was not collected"
        assert not walked(survivor)
    assert walked(survivor), "the heap stayed frozen after the run"
    assert gc.get_freeze_count() == 0


def test_the_heap_stays_settled_until_the_last_run_of_the_process_ends() -> None:
    survivor = Node()
    with settled_heap():
        with settled_heap():  # a second agent of the same process
            pass
        assert not walked(survivor), "one run's end unfroze another's heap"
    assert walked(survivor)


def test_a_finished_run_s_garbage_is_collected_by_the_next_one() -> None:
    held_a, held_b = Node(), Node()  # a run's objects: alive when it starts, so frozen
    held_a.other, held_b.other = held_b, held_a
    gone = weakref.ref(held_a)
    with settled_heap():
        del held_a, held_b  # a cycle, garbage once the run is over
    with settled_heap():
        assert gone() is None, "the last run's garbage outlived the next run's start"
