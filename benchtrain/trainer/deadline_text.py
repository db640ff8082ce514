"""A deadline as the user writes it to the callback: a duration (`11h30m`, `90s`, plain seconds: a
budget of training time, kept across a resume) or an absolute time (`2026-11-28T18:00`, `18:00`
today, an aware or naive `datetime`: local time when naive), which a resume keeps as it is."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

from benchtrain.common.durations import format_duration, parse_duration
from benchtrain.common.errors import BenchtrainError

_CLOCK_TIME = re.compile(r"^\d{1,2}:\d{2}(:\d{2})?$")


@dataclass(frozen=True)
class DeadlineText:
    """What the `deadline` argument says: a budget of seconds, or a moment (epoch seconds)."""

    text: str  # as given (the callback's state carries it, so a resume rebuilds the same one)
    budget_seconds: float | None = None  # a duration
    at_epoch: float | None = None  # an absolute time

    @property
    def is_absolute(self) -> bool:
        return self.at_epoch is not None


def parse_deadline(deadline: str | float | datetime, now_epoch: float) -> DeadlineText:
    """The deadline, checked: a duration must be positive, an absolute time in the future."""
    if isinstance(deadline, datetime):
        return _absolute(deadline.isoformat(), deadline, now_epoch)
    text = str(deadline).strip()
    if _CLOCK_TIME.match(text):
        today = datetime.fromtimestamp(now_epoch).date().isoformat()
        return _absolute(text, datetime.fromisoformat(f"{today}T{text}"), now_epoch)
    if "-" in text[1:] or "T" in text:
        try:
            moment = datetime.fromisoformat(text)
        except ValueError:
            raise BenchtrainError(
                f"deadline {text!r} is neither a duration (11h30m, 90s) nor a time (2026-11-28T18:00, 18:00)"
            ) from None
        return _absolute(text, moment, now_epoch)
    return DeadlineText(text, budget_seconds=parse_duration(text, "deadline"))


def _absolute(text: str, moment: datetime, now_epoch: float) -> DeadlineText:
    at = moment.timestamp()  # a naive datetime is local time
    if at <= now_epoch:
        now = datetime.fromtimestamp(now_epoch).isoformat(timespec="seconds")
        raise BenchtrainError(
            f"deadline {text} is {format_duration(now_epoch - at)} in the past (it is {now}): give a later time or a duration such as 11h30m"
        )
    return DeadlineText(text, at_epoch=at)
