"""What the train command needs besides its parser: the bundled samples, which process speaks,
and how it speaks (one module, so the command line and the session import it, not each other)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

SAMPLES = {"sample": "sample.jsonl", "sample-chat": "sample_chat.jsonl"}


def bundled_sample(name: str) -> str:
    return str(Path(__file__).resolve().parent / "sample_data" / SAMPLES[name])


def resolve_data_path(value: str) -> str:
    return bundled_sample(value) if value in SAMPLES else value


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def say(message: str) -> None:
    if is_main_process():
        print(message, file=sys.stderr, flush=True)
