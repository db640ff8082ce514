"""A cadence in seconds that knows when it is due: log lines, periodic checkpoints, evaluations
by time (with train.step.evaluation.EvalSchedule, which also counts steps)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Every:
    seconds: float | None  # None: never due by time
    last: float  # time.monotonic() when it was last done (or when the count started)

    def due(self, now: float) -> bool:
        return self.seconds is not None and now - self.last >= self.seconds

    def since(self, now: float) -> float:
        return now - self.last

    def done(self, at: float) -> None:
        self.last = at
