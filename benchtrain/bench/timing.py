"""How a probe times the step: warm-up, then timed steps until the median is steady or time is up.
The rules and why: docs/design.md#bench-timing
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from benchtrain.common.json_types import JsonDict

if TYPE_CHECKING:
    from benchtrain.train.step.step import StepResult


@dataclass(frozen=True)
class ProbeSettings:
    """How one probe times the step (the same on every rank of a multi-process bench)."""

    warmup_steps: int = 1
    min_steps: int = 3  # timed steps, when time allows; 2 when one step is expensive
    max_steps: int = 20
    max_seconds: float = 1.5  # the timed phase's share of the budget
    target_standard_error: float = 0.01  # relative standard error of the median step
    time_limit_seconds: float | None = None  # the whole probe ends by then (the budget left)
    expected_step_seconds: float | None = None  # the planner's price of one step (bench.cost)

    @classmethod
    def for_device(cls, device_type: str) -> ProbeSettings:
        if device_type == "cuda":
            return cls(warmup_steps=1, min_steps=3, max_steps=30, max_seconds=10.0)
        return cls()

    def for_budget(self, budget_seconds: float | None) -> ProbeSettings:
        """A larger budget gives each probe a larger time share (BUDGET_SHARE of it): more timed
        steps where steps scatter (a busy CPU) or cost seconds each (a large model)."""
        if budget_seconds is None:
            return self
        return replace(self, max_seconds=max(self.max_seconds, BUDGET_SHARE * budget_seconds))

    def with_limit(self, seconds: float | None, expected_step_seconds: float | None = None) -> ProbeSettings:
        return replace(
            self,
            time_limit_seconds=None if seconds is None else max(0.0, seconds),
            expected_step_seconds=expected_step_seconds,
        )


# A probe's timed phase may take this share of the whole budget (at least the device's default).
BUDGET_SHARE = 0.01
# Steps shorter than this time poorly on a CPU (interpreter overhead and scheduling move a 10-ms step
# by half between probes): never a yardstick for the others (the drift reference, the check in a
# fresh process).
WELL_TIMED_STEP_SECONDS = 0.04
# Fewest timed steps that still give a spread (and so a standard error).
MIN_TIMED_STEPS = 2
# A first timed step this much slower than the median of the rest is still warming up.
SLOW_START_FACTOR = 1.5
# The median's standard error ≈ 1.25 σ / √n, and σ ≈ IQR / 1.349.
MEDIAN_ERROR_PER_SPREAD = 1.25 / 1.349


def spread(values: list[float]) -> float:
    """Interquartile range over the median: how stable the step time is."""
    if len(values) < 2:
        return 0.0
    quartiles = statistics.quantiles(values, n=4, method="inclusive")
    return (quartiles[2] - quartiles[0]) / statistics.median(values)


def median_standard_error(values: list[float]) -> float:
    """Relative standard error of the median of `values` (inf with fewer than two)."""
    if len(values) < MIN_TIMED_STEPS:
        return math.inf
    return MEDIAN_ERROR_PER_SPREAD * spread(values) / math.sqrt(len(values))


def steps_needed(step_spread: float, settings: ProbeSettings) -> int:
    """Timed steps for the target standard error at a given spread (bounded by the settings)."""
    wanted = (
        math.ceil((MEDIAN_ERROR_PER_SPREAD * step_spread / settings.target_standard_error) ** 2)
        if step_spread > 0
        else 0
    )
    return max(settings.min_steps, min(settings.max_steps, wanted))


def min_timed_steps(step_seconds: float, settings: ProbeSettings) -> int:
    """`min_steps`, or MIN_TIMED_STEPS when that many steps alone would overrun the timed phase."""
    return (
        settings.min_steps
        if settings.min_steps * step_seconds <= settings.max_seconds
        else min(settings.min_steps, MIN_TIMED_STEPS)
    )


@dataclass
class StepTiming:
    """What the loop measured: warm-up and timed steps, and why it stopped."""

    first_step_seconds: float = 0.0
    warmup_seconds: float = 0.0
    warmup_steps: int = 0
    step_seconds: list[float] = field(default_factory=list)  # steady_step_seconds of each timed step
    wait_seconds: list[float] = field(default_factory=list)
    raw_step_seconds: list[float] = field(default_factory=list)  # as the clock measured them
    stop_reason: str = ""

    @property
    def complete(self) -> bool:
        return len(self.step_seconds) >= 1

    def record(self) -> JsonDict:
        """How the probe was timed, for its calibration row."""
        error = median_standard_error(self.step_seconds)
        return {
            "warmup_steps": self.warmup_steps,
            "timed_steps": len(self.step_seconds),
            "timing_stop": self.stop_reason,
            "median_standard_error": round(error, 5) if math.isfinite(error) else None,
        }


def time_steps(
    run_step: Callable[[], StepResult],
    settings: ProbeSettings,
    clock: Callable[[], float],
    agree: Callable[[int], int] = lambda flag: flag,
    first_step: Callable[[], object] | None = None,
) -> StepTiming:
    """Warm-up then timed steps of `run_step` (its result has `seconds` and `data_wait_seconds`);
    `agree` gives every rank the same stop decision, `first_step` runs the first warm-up step
    instead. Exceptions (an OOM) propagate."""
    timing = StepTiming()
    started = clock()

    def left() -> float:
        return math.inf if settings.time_limit_seconds is None else settings.time_limit_seconds - (clock() - started)

    warm_from = clock()
    for index in range(settings.warmup_steps):
        if index and timing.first_step_seconds > left():
            break
        (first_step if index == 0 and first_step is not None else run_step)()
        timing.warmup_steps += 1
        if index == 0:
            timing.first_step_seconds = clock() - warm_from
    timing.warmup_seconds = clock() - warm_from
    timed_from = clock()
    while True:
        # Before a timed step: would it cross the limit? The first is priced by the planner (the
        # warm-up step held a compilation), else by the warm-up.
        expected = (
            statistics.median(timing.step_seconds)
            if timing.step_seconds
            else settings.expected_step_seconds or timing.first_step_seconds
        )
        if agree(int(expected > left())):
            timing.stop_reason = "time limit"
            break
        result = run_step()
        timing.step_seconds.append(steady_step_seconds(result))
        timing.raw_step_seconds.append(result.seconds)
        timing.wait_seconds.append(result.data_wait_seconds)
        reason = _stop_reason(timing.step_seconds, clock() - timed_from, settings)
        if agree(int(reason is not None)):
            timing.stop_reason = reason or "another rank stopped"
            break
    _trim_slow_start(timing)
    return timing


# Fewest micro-steps whose median leaves one disturbed micro-step out.
MIN_MICRO_STEPS_FOR_MEDIAN = 3


def steady_step_seconds(result: StepResult) -> float:
    """A step's seconds with its micro-steps counted at their median: the step's time less its
    micro-steps', plus A × their median (the step's own seconds where it did not time them, as on a
    GPU, or where A is below MIN_MICRO_STEPS_FOR_MEDIAN)."""
    micro = list(getattr(result, "micro_step_seconds", ()) or ())
    if len(micro) < MIN_MICRO_STEPS_FOR_MEDIAN:
        return float(result.seconds)
    return float(result.seconds) - sum(micro) + len(micro) * statistics.median(micro)


def _stop_reason(steps: list[float], timed_seconds: float, settings: ProbeSettings) -> str | None:
    if len(steps) >= settings.max_steps:
        return "max steps"
    if len(steps) < min_timed_steps(statistics.median(steps), settings):
        return None
    if median_standard_error(steps) <= settings.target_standard_error:
        return "converged"
    if timed_seconds >= settings.max_seconds:
        return "time share"
    return None


def _trim_slow_start(timing: StepTiming) -> None:
    """A first timed step still warming up (far slower than the rest) counts as warm-up."""
    steps = timing.step_seconds
    if len(steps) >= MIN_TIMED_STEPS + 1 and steps[0] > SLOW_START_FACTOR * statistics.median(steps[1:]):
        steps.pop(0)
        timing.warmup_seconds += timing.raw_step_seconds.pop(0)
        timing.wait_seconds.pop(0)
        timing.warmup_steps += 1
