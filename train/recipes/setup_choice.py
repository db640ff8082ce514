"""The setups a `train` command weighs (train.recipes.variant_choice says which): each fitted to
the device and said, the best plan kept with what the others would have cost, and, when none
fits, what the bases the calibration did not measure would hold."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from common.console import say
from train.recipes.config import TrainConfig
from train.recipes.plan_setup import FittedSetup, fit_setup
from train.recipes.planned_run import PlannedRun

if TYPE_CHECKING:
    from calibration.model import Calibration
    from train.workload.method import MethodConfig
    from train.workload.model import ModelSpec


def fitted_for(config: TrainConfig, cal: Calibration, spec: ModelSpec, method: MethodConfig, layout: tuple[int, str], quiet: bool = False) -> FittedSetup:
    """The setup on the device the plan is for (train.recipes.plan_setup.fit_setup), said: the
    calibration's device when a dry run plans for another, and what --force let through. `quiet`:
    say nothing (a calibration's second setup: the first said it)."""
    from train.step.hardware import detect_hardware

    here = detect_hardware()
    setup = fit_setup(config, cal, spec, method, layout, here)
    if setup.device.foreign and not quiet:
        say(
            f"planning for {cal.hardware['name']}, the device calibration {cal.id} measured (this machine: {here['name']}); "
            "training on it needs that device, or --force"
        )
    for warning in setup.warnings if not quiet else ():
        say(f"warning: {warning}")
    return setup


def with_smaller_bases(message: str, spec: ModelSpec, setup: FittedSetup) -> str:
    """A plan that fits nowhere, and what the bases the calibration did not measure would hold,
    with the activations of the smallest step."""
    from train.recipes.variant_choice import GIB, fit_verdict, smallest_activations, unmeasured_bases

    cal, method, need, hardware = setup.cal, setup.method, setup.need, setup.device.hardware
    activations = smallest_activations(cal, need.total_bytes)
    others = unmeasured_bases(spec, method, cal, hardware, activations)
    if not others or activations is None:
        return message + ("; " + "; ".join(others) if others else "")
    peak = need.total_bytes + activations[0]
    mine = f"this run's base: ≈{peak / GIB:.1f} GiB peak at {activations[1]}: {fit_verdict(peak, float(hardware['memory_bytes']), cal.memory_margin)}"
    return "; ".join([message, mine, *others])


def choose_setup(runs: list[PlannedRun], refused: list[tuple[Any, str]]) -> PlannedRun:
    """The best plan (train.recipes.variant_choice.best_first), its notes saying what the other
    setups would have cost."""
    from train.recipes.variant_choice import best_first, compare_setups

    if len(runs) + len(refused) == 1:
        return runs[0]
    ranked = [runs[index] for index in best_first([run.plan for run in runs])]
    best = ranked[0]
    best.plan.notes.extend(compare_setups((best.cal, best.plan), [(run.cal, run.plan) for run in ranked[1:]], refused))
    return best
