"""Which process speaks, and how: under a launcher only rank 0 prints (one module, so the command
lines and the sessions import it, not each other)."""

from __future__ import annotations

import os
import sys


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def say(message: str) -> None:
    if is_main_process():
        print(message, file=sys.stderr, flush=True)
