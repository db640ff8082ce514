"""The deadline of one `train` command: when the command started, the deadline counted from then,
and the margin held back from it. Built once from the options and handed whole to the planner, the
loop and the deadline guard: the budget and the time elapsed are computed here and nowhere else.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Deadline:
    deadline_seconds: float  # from the command's start
    margin_seconds: float  # held back from the deadline as a safety margin
    started_at: float = 0.0  # time.monotonic() when the command started: the deadline counts from there

    @classmethod
    def with_margin_share(cls, deadline_seconds: float, margin_share: float, started_at: float = 0.0) -> Deadline:
        return cls(deadline_seconds, deadline_seconds * margin_share, started_at)

    @property
    def budget_seconds(self) -> float:
        """Deadline − margin, from the command's start: what the plan and the guard hold to."""
        return self.deadline_seconds - self.margin_seconds

    def seconds_left(self, elapsed_seconds: float) -> float:
        return self.budget_seconds - elapsed_seconds

    def elapsed(self, now: float | None = None) -> float:
        """Seconds since the command started (at `now`, a time.monotonic() reading; default: now)."""
        return (time.monotonic() if now is None else now) - self.started_at

    @staticmethod
    def deadline_holding(seconds: float, margin_share: float) -> float:
        """The deadline whose budget, after a margin of `margin_share` of it, holds `seconds`."""
        return seconds / (1 - margin_share)
