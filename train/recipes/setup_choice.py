"""The setups a `train` command weighs (train.recipes.chosen_setup decided each): the best plan
kept with what the others would have cost, and, when none fits, what the bases the calibration
did not measure would hold."""

from __future__ import annotations

from typing import TYPE_CHECKING

from train.recipes.chosen_setup import ChosenSetup
from train.recipes.planned_run import PlannedRun
from train.recipes.variant_choice import GIB, Refused, best_first, compare_setups, fit_verdict, smallest_activations, unmeasured_bases

if TYPE_CHECKING:
    from train.workload.model import ModelSpec


def with_smaller_bases(message: str, spec: ModelSpec, setup: ChosenSetup) -> str:
    """A plan that fits nowhere, and what the bases the calibration did not measure would hold,
    with the activations of the smallest step."""
    cal, method, need, hardware = setup.cal, setup.method, setup.need, setup.hardware
    activations = smallest_activations(cal, need.total_bytes)
    others = unmeasured_bases(spec, method, cal, hardware, activations)
    if not others or activations is None:
        return message + ("; " + "; ".join(others) if others else "")
    peak = need.total_bytes + activations[0]
    mine = f"this run's base: ≈{peak / GIB:.1f} GiB peak at {activations[1]}: {fit_verdict(peak, float(hardware['memory_bytes']), cal.memory_margin)}"
    return "; ".join([message, mine, *others])


def choose_setup(runs: list[PlannedRun], refused: list[Refused]) -> PlannedRun:
    """The best plan (train.recipes.variant_choice.best_first), its notes saying what the other
    setups would have cost."""
    if len(runs) + len(refused) == 1:
        return runs[0]
    ranked = [runs[index] for index in best_first([run.plan for run in runs])]
    best = ranked[0]
    best.plan.notes.extend(compare_setups((best.cal, best.plan), [(run.cal, run.plan) for run in ranked[1:]], refused))
    return best
