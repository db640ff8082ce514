"""What a budget buys, said before it is spent; a budget too small for a minimum viable fit is refused.
Why: docs/design.md#bench-outlook
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from benchtrain.bench.choose import ProbePlanner
from benchtrain.bench.cost import PRIOR_EFFICIENCY, DeviceSpeed
from benchtrain.bench.runner import BUDGET_RESERVE
from benchtrain.calibration.fit import MIN_ROWS_FOR_FIT
from benchtrain.calibration.step_config import StepConfig
from benchtrain.calibration.store import list_calibrations
from benchtrain.common.durations import format_duration
from benchtrain.common.errors import BenchtrainError

# Probes `--budget auto` pays for: below this many, a calibration says "too few probes"
# (bench.record.assess_noise) and its held-out error is rough.
AUTO_PROBES = 12


@dataclass(frozen=True)
class Outlook:
    budget_seconds: float | None
    grid_seconds: float  # every probe that fits in memory, at today's prices
    grid_probes: int
    planned: tuple[tuple[StepConfig, float], ...]  # what the budget buys, with each price
    minimum_seconds: float  # the smallest budget that pays for a minimum viable fit, at these prices
    least_seconds: float  # the same at the device's peak speed: below it no fit is possible at all
    after_probes_seconds: float  # evaluation and checkpoint timings
    prices: str  # where the prices come from (a prior or measurements)
    expected_error_pct: float | None = None  # from an earlier calibration of this model here

    @property
    def affordable(self) -> bool:
        """A prior's prices are conservative: only a budget short of what even the device's peak would need is refused. Measured prices are bet on."""
        needed = self.minimum_seconds if self.prices == "measured" else self.least_seconds
        return self.budget_seconds is None or self.budget_seconds >= needed


def total_seconds(probes_seconds: float, spent_seconds: float, after_probes_seconds: float) -> float:
    """A budget that pays for these probes and the rest: the runner keeps BUDGET_RESERVE of it."""
    return (spent_seconds + probes_seconds + after_probes_seconds) / (1 - BUDGET_RESERVE)


def outlook(
    planner: ProbePlanner, budget_seconds: float | None, spent_seconds: float, after_probes_seconds: float
) -> Outlook:
    everything = planner.preview(None)
    viable = planner.preview(None, stop_when_viable=True)
    fastest = copy.deepcopy(planner)
    fastest.cost.speed = DeviceSpeed(planner.cost.speed.flops_per_second / PRIOR_EFFICIENCY, "peak")
    least = fastest.preview(None, stop_when_viable=True)
    probes_budget = (
        None if budget_seconds is None else budget_seconds - total_seconds(0.0, spent_seconds, after_probes_seconds)
    )
    planned = planner.preview(max(0.0, probes_budget)) if probes_budget is not None else everything
    return Outlook(
        budget_seconds=budget_seconds,
        grid_seconds=total_seconds(sum(price for _, price in everything), spent_seconds, after_probes_seconds),
        grid_probes=len(everything),
        planned=tuple(planned),
        minimum_seconds=total_seconds(sum(price for _, price in viable), spent_seconds, after_probes_seconds),
        least_seconds=total_seconds(
            sum(price for _, price in least), spent_seconds, after_probes_seconds * PRIOR_EFFICIENCY
        ),
        after_probes_seconds=after_probes_seconds,
        prices="measured" if planner.cost.measured else planner.cost.source,
    )


def auto_budget(planner: ProbePlanner, spent_seconds: float, after_probes_seconds: float) -> float:
    """The budget for AUTO_PROBES probes (the whole grid when it has fewer), at least the minimum."""
    chosen = planner.preview(None)[:AUTO_PROBES]
    viable = planner.preview(None, stop_when_viable=True)
    probes = max(sum(price for _, price in chosen), sum(price for _, price in viable))
    return math.ceil(total_seconds(probes, spent_seconds, after_probes_seconds))


def expected_error(hardware_name: str, fingerprint: str, probes: int) -> float | None:
    """The held-out median error to expect with `probes` probes, from the newest stored
    calibration of this model on this device (scaled by √(its probes ÷ these)); None without one."""
    for _, data, _ in list_calibrations():
        if (
            not data
            or not data.get("fit")
            or data["hardware"].get("name") != hardware_name
            or data["model"].get("fingerprint") != fingerprint
        ):
            continue
        median, rows = data["fit"]["held_out_error"].get("median_abs_pct"), data["fit"].get("rows_used")
        if median is None or not rows or probes < 1:
            return None
        return float(median) * math.sqrt(rows / probes)
    return None


def describe(view: Outlook) -> list[str]:
    """The outlook in a few lines for the terminal."""
    lines = [
        f"the whole grid ({view.grid_probes} probes that fit in memory) needs ≈ {format_duration(view.grid_seconds)} (probe prices: {view.prices})"
    ]
    if view.budget_seconds is not None:
        sample = ", ".join(c.label for c, _ in view.planned[:5])
        more = f" and {len(view.planned) - 5} more" if len(view.planned) > 5 else ""
        lines.append(
            f"within {format_duration(view.budget_seconds)} I expect to measure {len(view.planned)} probes ({sample}{more}), "
            + (
                f"expected held-out error ≈ {view.expected_error_pct:.1f}% (from the last calibration of this model here), "
                if view.expected_error_pct
                else ""
            )
            + f"then evaluation and checkpoint timings (≈ {format_duration(view.after_probes_seconds)}); "
            f"a minimum viable fit needs ≈ {format_duration(view.minimum_seconds)}"
        )
    return lines


def refuse_if_too_small(view: Outlook, planner: ProbePlanner | None = None) -> None:
    """One line naming the budget a minimum viable fit needs (or the grid it needs), before any of the budget is spent."""
    if (
        planner is not None
        and len(view.planned if view.budget_seconds is None else planner.preview(None)) < MIN_ROWS_FOR_FIT
    ):
        raise BenchtrainError(
            f"the grid has {planner.space.size} configurations ({len(planner.candidates())} that fit in memory); a fit needs at least "
            f"{MIN_ROWS_FOR_FIT}: add values to --batch-sizes, --seq-lens or --accum"
        )
    if view.affordable:
        return
    assert view.budget_seconds is not None
    measured = view.prices == "measured"
    needed = view.minimum_seconds if measured else view.least_seconds
    how = "at the prices measured so far" if measured else "even if every step ran at the device's peak"
    raise BenchtrainError(
        f"--budget {format_duration(view.budget_seconds)} cannot pay for even a minimum calibration "
        f"({MIN_ROWS_FOR_FIT} probes, one of each checkpointing mode asked for): {how} it needs ≈ {format_duration(needed)} "
        f"(≈ {format_duration(view.minimum_seconds)} at {view.prices}); "
        f"use --budget {format_duration(math.ceil(view.minimum_seconds))} or more, or --budget auto"
    )


def settle_budget(
    planner: ProbePlanner,
    asked: float | str | None,
    spent_seconds: float,
    after_probes_seconds: float,
    say: Callable[[str], None],
    expected: Callable[[int], float | None] | None = None,
) -> float | None:
    """The budget in seconds (`auto` worked out), after saying what it buys; refused if too small."""
    seconds = auto_budget(planner, spent_seconds, after_probes_seconds) if asked == "auto" else asked
    assert seconds is None or isinstance(seconds, (int, float))
    if asked == "auto":
        say(
            f"--budget auto: {format_duration(seconds or 0.0)} (the grid's first {AUTO_PROBES} probes at today's prices)"
        )
    view = outlook(planner, seconds, spent_seconds, after_probes_seconds)
    if expected is not None and view.planned:
        view = dataclasses.replace(view, expected_error_pct=expected(len(view.planned)))
    for line in describe(view):
        say(line)
    refuse_if_too_small(view, planner)
    return seconds


def minimum_from_scratch(planner: ProbePlanner, spent_before_probes: float, after_probes_seconds: float) -> float:
    """The budget a minimum viable fit needs from the start, at the prices measured so far (what a failed benchmark tells the user to ask for next time)."""
    fresh = copy.deepcopy(planner)
    fresh.rows, fresh.oom, fresh.seen_shapes = {}, [], set()
    return total_seconds(
        sum(price for _, price in fresh.preview(None, stop_when_viable=True)), spent_before_probes, after_probes_seconds
    )
