"""A plan that does not fit its deadline: `--fit-deadline`'s cut to the optimizer steps that fit,
and what is said when the calibration's error is what decides the deadline.

Each step count is planned as the run it would be (its own checkpoints, evaluations and export,
not the whole plan's): the planner hands in how it plans a candidate's configuration under a step
limit (train.planning.planner.make_plan), so nothing here depends on how a candidate is estimated.
"""

from __future__ import annotations

from collections.abc import Callable

from common.durations import format_duration
from common.errors import DeadlineError
from train.planning.types import Candidate

EXTRAPOLATION_ADVICE = "the plan extrapolates past what bench measured; `bench run --data PATH` measures the lengths this data needs"


def error_decides_deadline(chosen: Candidate, available: float) -> str | None:
    """Said when the calibration's error is what decides the deadline: the central estimate fits
    and its upper bound does not (refused, or promised on the central estimate when too noisy)."""
    if not chosen.total_seconds <= available < chosen.total_seconds_high:
        return None
    return (
        f"the calibration's error decides this deadline: the estimate {format_duration(chosen.total_seconds)} fits the "
        f"{format_duration(available)} usable, its upper bound {format_duration(chosen.total_seconds_high)} (±{chosen.bound_fraction:.0%}) "
        + (f"does not; {EXTRAPOLATION_ADVICE}" if chosen.extrapolated else "does not; a longer `bench run --budget` narrows it")
    )


def shortened_alternatives(ranked: list[Candidate], available: float, limited: Callable[[Candidate, int], Candidate], shown: int = 3) -> list[Candidate]:
    """With --fit-deadline, the alternatives as they would run: each cut to the steps that fit
    (those of which not one step fits are left out). `limited(candidate, max_steps)`: the
    candidate's configuration planned with that step limit."""
    alternatives: list[Candidate] = []
    for candidate in ranked:
        if len(alternatives) == shown:
            break
        if candidate.total_seconds_promised > available:
            try:
                candidate = shrink_to_deadline(candidate, available, limited)[0]
            except DeadlineError:
                continue
        alternatives.append(candidate)
    return alternatives


def shrink_to_deadline(chosen: Candidate, available: float, limited: Callable[[Candidate, int], Candidate]) -> tuple[Candidate, int]:
    """The same configuration with as many steps as fit: each count planned as the run it would be
    by `limited(chosen, max_steps)`, the largest whose promised total fits found by bisection (the
    total grows with the steps). Counted after the steps a resumed run already did, so the limit
    is the run's total."""
    done = chosen.optimizer_steps - chosen.remaining_steps  # what a resumed run already did
    fits, low, high = None, 0, chosen.remaining_steps - 1  # all the steps do not fit
    while low < high:
        middle = (low + high + 1) // 2
        candidate = limited(chosen, done + middle)
        if candidate.total_seconds_promised <= available:
            fits, low = candidate, middle
        else:
            high = middle - 1
    if fits is None:
        one = limited(chosen, done + 1)
        if one.total_seconds_promised > available:
            wide = f" (its bound ±{one.bound_fraction:.0%}: {EXTRAPOLATION_ADVICE})" if one.extrapolated else ""
            raise DeadlineError(
                f"--fit-deadline: not even one optimizer step fits before the deadline: one step ({chosen.label()}) "
                f"needs up to {format_duration(one.total_seconds_promised)} with its overheads{wide}, {format_duration(max(0.0, available))} are left"
            )
        fits, low = one, 1
    return fits, done + low
