"""Durations as people write them: `90s`, `15m`, `12h`, `1h30m`, `2d` or plain seconds."""

from __future__ import annotations

import math
import re

from calibration.errors import BenchtrainError

_UNIT_SECONDS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)([dhms])")


def parse_duration(text: str, what: str = "duration") -> float:
    """Seconds in `text`; raises a one-line error for anything else, zero and negatives included."""
    cleaned = str(text).strip().lower().replace(" ", "")
    seconds: float | None = None
    try:
        seconds = float(cleaned)
    except ValueError:
        parts = _PART.findall(cleaned)
        if parts and "".join(number + unit for number, unit in parts) == cleaned:
            seconds = sum(float(number) * _UNIT_SECONDS[unit] for number, unit in parts)
    if seconds is None or not math.isfinite(seconds):
        raise BenchtrainError(f"{what} {text!r} is not a duration: write e.g. 90s, 15m, 12h, 1h30m or plain seconds")
    if seconds <= 0:
        raise BenchtrainError(f"{what} must be positive, got {text!r}")
    return seconds


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
