"""What each switch dimension of the step (calibration.dimensions) does to a built model: its applier, named by its
`Dimension.applier` in `APPLIERS`. The engine applies a StepConfig's switches at build and bench's probes switch
between modes on one model through it. Why: docs/design.md#dimensions-of-a-step"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from benchtrain.calibration.dimensions import switches
from benchtrain.calibration.step_config import Mode
from benchtrain.train.workload.method import set_gradient_checkpointing

if TYPE_CHECKING:
    import torch

# Turns its switch on (True) or off (False) on a built model, wrapped (DDP, peft) or not: at build before the loss and
# compilation, and between probes after them.
SwitchApplier = Callable[["torch.nn.Module", bool], None]

APPLIERS: dict[str, SwitchApplier] = {
    "gradient_checkpointing": set_gradient_checkpointing,
}


def set_switches(model: torch.nn.Module, on: Mode, before: Mode = ()) -> None:
    """`model` with the switches `on` on and every other off: each switch whose state differs from `before` (what the
    model has on now; a model just built has none) turned by its applier."""
    for dimension in switches():
        wanted = dimension.name in on
        if wanted != (dimension.name in before):
            APPLIERS[dimension.applier](model, wanted)
