"""Garbage collection that does not walk the libraries' objects at every probe (`gc.freeze`).
Why: docs/design.md#heap."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

_frozen_depth = 0  # nested frozen_heap()s: only the outermost freezes and thaws


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Freeze what is alive now for the collector until the block ends (nested blocks: the outermost)."""
    global _frozen_depth
    if _frozen_depth == 0:
        gc.collect()
        gc.freeze()
    _frozen_depth += 1
    try:
        yield
    finally:
        _frozen_depth -= 1
        if _frozen_depth == 0:
            gc.unfreeze()


def collect_everything() -> None:
    """A full collection that frozen objects take part in; inside `frozen_heap()` what is still alive afterwards is frozen again."""
    gc.unfreeze()
    gc.collect()
    if _frozen_depth:
        gc.freeze()
