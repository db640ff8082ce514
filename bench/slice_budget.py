"""How `bench run --layers` spends one budget on several slice depths (bench.layer_slices).

Each depth is a bench of its own (bench.variant_measurement), but the depths run in one process,
one after the other, and what does not depend on depth is paid once:

- **Compilation.** train.step.compile compiles the decoder block's class once per shape (regional
  compilation) and every layer runs that block; a deeper slice is more layers of the same block,
  so a shape compiled at one depth is compiled for the next (dynamo's cache lives in the process,
  keyed by the block's code and the tensors' shapes, not by the model). Each depth's planner and
  workload know the shapes compiled before it (`Carry.shapes`): their probes are priced, and
  recorded, as repeated shapes. The whole model's compilation per shape is what the depths that
  compiled measured (bench.slice_record).
- **The checkpoint write and the compile-cache process** are timed at one depth only, the last
  (`BenchTask.one_off_timings`), with what the depths before it left unspent: the full model's
  checkpoint bytes are exact from the `meta` device and the disk's speed does not depend on
  depth; the block compiled from the cache is the same block at every depth. `--loss auto`
  compares the losses at the first depth only (the head is the same at every depth); the later
  depths run the loss it chose.
- **The budget** is split by the planner's own prices (`price_depths`): each depth's minimum viable
  fit, priced in order with the shapes compiled before it (the first depth pays the compilations),
  and what is left over in proportion to those minimums. The first depth gets most: what it
  compiles with it, every later depth probes at a repeated shape's price; what a depth leaves
  unspent goes to the depths after it. A budget short of the sum is refused before anything is
  built, naming the budget the depths need.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, replace
from typing import Any

from bench.choose import ProbePlanner
from bench.outlook import total_seconds
from bench.space import Shape, shape_of
from common.durations import format_duration
from common.errors import BenchtrainError


@dataclass
class Carry:
    """What one depth leaves the next in the same process."""

    shapes: set[Shape] = field(default_factory=set)  # (rows, length, switches on) compiled so far
    one_off: bool = False  # this depth makes the one-off timings (checkpoint write, compile cache): the last one
    compile_seconds: float | None = None  # a new shape's compilation, as the earlier depths measured it

    def prepare(self, task: Any, planner: ProbePlanner) -> Any:
        """This depth's task (one-off timings only at the last depth); its planner learns the
        shapes already compiled."""
        planner.seen_shapes |= self.shapes
        if self.compile_seconds is not None:
            planner.cost.compile_prior_seconds = self.compile_seconds
        return replace(task, one_off_timings=self.one_off)

    def seed(self, seen: set[Any]) -> None:
        """A workload's (or a simulated device's) shapes run: the compiled ones added."""
        seen |= self.shapes

    def done(self, planner: ProbePlanner) -> None:
        self.shapes |= planner.seen_shapes
        if planner.cost.compiled:
            self.compile_seconds = planner.cost.first_step_extra(new_shape=True)


@dataclass(frozen=True)
class DepthPrice:
    minimum: float  # seconds for this depth's minimum viable fit, all included, shapes compiled before it carried


def price_depths(planners: dict[int, tuple[ProbePlanner, float, float]]) -> dict[int, DepthPrice]:
    """Each depth's prices from its planner, `planners[K] = (planner, seconds before its probes
    (imports, build), seconds after them (evaluation, timings))`, shallowest first."""
    compiled: set[Shape] = set()
    prices = {}
    for depth in sorted(planners):
        planner, before, after = planners[depth]
        trial = copy.deepcopy(planner)
        trial.seen_shapes |= compiled
        chosen = trial.preview(None, stop_when_viable=True)
        compiled |= {shape_of(config) for config, _ in chosen}
        prices[depth] = DepthPrice(total_seconds(sum(price for _, price in chosen), before, after))
    return prices


def needed_seconds(prices: dict[int, DepthPrice]) -> float:
    return sum(price.minimum for price in prices.values())


def depth_share(left: float, prices: dict[int, DepthPrice], depths: tuple[int, ...]) -> float:
    """The next depth's (`depths[0]`) seconds of the `left` the remaining `depths` share: its
    minimum and its part of the rest (the last depth takes all that is left)."""
    if len(depths) == 1:
        return left
    needed = sum(prices[depth].minimum for depth in depths)
    return min(left, prices[depths[0]].minimum * max(1.0, left / needed) if needed > 0 else left / len(depths))


def refuse_if_unaffordable(prices: dict[int, DepthPrice], budget: float | str | None, name: str, spent: float = 0.0) -> None:
    """One line, before anything is built, when the budget cannot pay for a minimum viable fit at
    every depth after the `spent` seconds (pricing them)."""
    needed = needed_seconds(prices) + spent
    if isinstance(budget, (int, float)) and budget < needed:
        depths = ", ".join(map(str, sorted(prices)))
        raise BenchtrainError(
            f"--budget {format_duration(budget)} cannot pay for a minimum calibration at each of the slice depths {depths} of {name}: "
            f"they need ≈ {format_duration(needed)}; use --budget {format_duration(math.ceil(needed))} or more, or fewer depths (--layers)"
        )
