"""How a training run ended: the words run.json's `actual.status` (and its top-level `status`) hold.

They are the ground truth people's scripts, the report, the model card and the estimate check
(calibration.accuracy) read, so they live here, on the floor every reader may import: the deadline
guard's actions (train.running.guard.OVERRUN_ACTIONS) and the loop refer to these constants and
never spell a status themselves. The words never change; a new way for a run to end is a new word.
"""

from __future__ import annotations

from typing import Final

COMPLETED: Final = "completed"  # every planned step ran
STEP_LIMIT: Final = "step_limit"  # stopped at a step limit: --max-steps, --fit-deadline, or the guard's shrink
STOPPED_FOR_DEADLINE: Final = "stopped_for_deadline"  # the deadline guard stopped it at the last safe moment
INTERRUPTED: Final = "interrupted"  # SIGINT or SIGTERM

# Runs that stopped before their planned end, from a checkpoint they can resume: their final/ is
# marked partial, and the end of the run says how to resume it.
STOPPED_EARLY: Final = (STOPPED_FOR_DEADLINE, INTERRUPTED)
