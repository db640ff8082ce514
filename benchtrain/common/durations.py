"""Durations as people write them: `90s`, `15m`, `12h`, `1h30m`, `2d` or plain seconds."""

from __future__ import annotations

import math
import re

from benchtrain.common.errors import BenchtrainError

_UNIT_SECONDS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)([dhms])")


def parse_duration(text: str, what: str = "duration") -> float:
    """Seconds in `text`; raises a one-line error for anything else, zero and negatives included."""
    cleaned = str(text).strip().lower().replace(" ", "")
    # A sign is read (so that -5m is "not positive" rather than "not a duration").
    sign, body = (-1.0, cleaned[1:]) if cleaned.startswith("-") else (1.0, cleaned)
    seconds: float | None = None
    try:
        seconds = float(cleaned)
    except ValueError:
        parts = _PART.findall(body)
        if parts and "".join(number + unit for number, unit in parts) == body:
            seconds = sign * sum(float(number) * _UNIT_SECONDS[unit] for number, unit in parts)
    if seconds is None or not math.isfinite(seconds):
        raise BenchtrainError(f"{what} {text!r} is not a duration: write e.g. 90s, 15m, 12h, 1h30m or plain seconds")
    if seconds <= 0:
        raise BenchtrainError(f"{what} must be positive, got {text!r}")
    return seconds


_NEGATIVE_VALUE = re.compile(r"^-\.?\d")


def join_negative_values(argv: list[str]) -> list[str]:
    """`--deadline -5m` as `--deadline=-5m`: argparse takes a value that starts with '-' for an
    option and answers "expected one argument"; joined, the option's own check names the problem."""
    joined: list[str] = []
    for token in argv:
        if joined and joined[-1].startswith("--") and "=" not in joined[-1] and _NEGATIVE_VALUE.match(token):
            joined[-1] = f"{joined[-1]}={token}"
        else:
            joined.append(token)
    return joined


def format_duration(seconds: float) -> str:
    """`1h02m`, `3m20s`, `12.5s`: short and exact enough for a plan."""
    if not math.isfinite(seconds):
        return "∞"
    sign = "-" if seconds < 0 else ""
    seconds = abs(seconds)
    if seconds < 60:
        return f"{sign}{seconds:.1f}s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{sign}{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{sign}{hours}h{minutes:02d}m"
