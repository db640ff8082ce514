"""Progress bars that redraw in a terminal and stay quiet (a line every 10 s) in logs."""

from __future__ import annotations

import sys
from typing import Any


def progress_bar(total: int, description: str, unit: str, initial: int = 0) -> Any:
    from tqdm.auto import tqdm

    interactive = sys.stderr.isatty()
    return tqdm(
        total=total,
        initial=initial,
        desc=description,
        unit=unit,
        dynamic_ncols=True,
        mininterval=0.2 if interactive else 10.0,
    )
