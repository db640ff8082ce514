"""The deadline of one `train` command, and the margin held back from it.

Built once from the command line (`--deadline`, `--margin`: train.recipes.config.TrainConfig.budget)
and handed whole to the planner (what a plan may promise) and to the deadline guard (what the live
speed is held against). The budget — deadline minus margin — is computed here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeadlineBudget:
    deadline_seconds: float  # from the command's start
    margin_seconds: float  # held back from the deadline as a safety margin

    @classmethod
    def with_margin_share(cls, deadline_seconds: float, margin_share: float) -> DeadlineBudget:
        return cls(deadline_seconds, deadline_seconds * margin_share)

    @property
    def budget_seconds(self) -> float:
        """Deadline − margin, from the command's start: what the plan and the guard hold to."""
        return self.deadline_seconds - self.margin_seconds

    def seconds_left(self, elapsed_seconds: float) -> float:
        """What is left of the budget after `elapsed_seconds` of the command."""
        return self.budget_seconds - elapsed_seconds

    @staticmethod
    def deadline_holding(seconds: float, margin_share: float) -> float:
        """The deadline whose budget, after a margin of `margin_share` of it, holds `seconds`."""
        return seconds / (1 - margin_share)
