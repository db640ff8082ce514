"""common.heap: probes' collections skip what was alive before them, and a model being dropped is
still collected."""

from __future__ import annotations

import gc
import weakref

from benchtrain.common.heap import collect_everything, frozen_heap


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


def test_a_collection_inside_skips_what_was_alive_before_and_collect_everything_reaches_it() -> None:
    before = Node()
    alive_before = weakref.ref(before)
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        made_inside = weakref.ref(Node())
        del before
        gc.collect()
        assert made_inside() is None  # what the block made is collected as usual
        assert alive_before() is not None  # frozen: a full collection no longer walks it
        collect_everything()
        assert alive_before() is None
        assert gc.get_freeze_count() > 0  # still frozen for the rest of the block
    assert gc.get_freeze_count() == 0


def test_only_the_outermost_block_thaws() -> None:
    with frozen_heap():
        with frozen_heap():
            pass
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def test_the_heap_thaws_when_the_block_raises() -> None:
    try:
        with frozen_heap():
            raise RuntimeError("a probe failed")
    except RuntimeError:
        pass
    assert gc.get_freeze_count() == 0
