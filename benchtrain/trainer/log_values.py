"""What the callback puts on each training log of the Trainer (its log line and, through
tracker_metrics.BeforeTrackers, its `report_to` trackers): what the Trainer world lacks.

- `tokens_per_second`, `padded_tokens_per_second`: the real tokens (attention mask) and the
  positions computed (padding included) of the optimizer steps since the last log, every
  micro-batch of each step and every process counted, over those steps' measured time;
- `mfu`: model FLOPs utilisation per process at the device's datasheet peak (dense bf16), only
  where the device has one (a GPU in calibration.datasheets): absent, never assumed, on a CPU;
- `eta_seconds` with `eta_low_seconds` and `eta_high_seconds`: the guard's projected finish less the
  time used, widened by the estimate's bound (none before the estimate is made);
- `deadline_left_seconds`: the budget (the deadline less its margin) left.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from benchtrain.calibration.step_config import Mode
from benchtrain.common.json_types import JsonDict
from benchtrain.train.running.guard import Verdict
from benchtrain.train.step.metrics import mfu, tokens_per_second
from benchtrain.train.workload.model import ModelShape, model_shape
from benchtrain.trainer.step_watch import StepWatch

DIGITS = 4  # significant enough for a tracker's plot, short enough for the log line


@dataclass
class LogValues:
    shape: ModelShape | None  # the model's FLOPs formula; None where there is no peak to hold it against
    lora: bool
    switches: Mode  # the step's switches on (gradient checkpointing recomputes)
    peak_flops: float | None  # the device's dense bf16 peak FLOP/s per process (None: not known, no MFU)
    world_size: int
    logged_steps: int = 0  # the watch's steps that an earlier log covered

    @classmethod
    def of(cls, model: Any, lora: bool, switches: Mode, hardware: JsonDict, world_size: int) -> LogValues:
        peak = hardware.get("peak_bf16_flops")
        shape = model_shape(model) if peak and model is not None else None
        return cls(shape, lora, switches, float(peak) if peak else None, world_size)

    def values(self, watch: StepWatch, verdict: Verdict, bound_fraction: float) -> JsonDict:
        steps = watch.steps[self.logged_steps :] or watch.steps[-1:]
        lengths = watch.lengths[self.logged_steps :] or watch.lengths[-1:]
        self.logged_steps = len(watch.steps)
        seconds = sum(record.seconds for record in steps)
        padded_rate = tokens_per_second(sum(record.padded_tokens for record in steps), seconds)
        elapsed = watch.elapsed()
        eta = max(0.0, verdict.projected_finish - elapsed)
        values: JsonDict = {
            "tokens_per_second": round(tokens_per_second(sum(record.tokens for record in steps), seconds), 1),
            "padded_tokens_per_second": round(padded_rate, 1),
            "eta_seconds": round(eta, 1),
            "eta_low_seconds": round(eta / (1 + bound_fraction), 1),
            "eta_high_seconds": round(eta * (1 + bound_fraction), 1),
            "deadline_left_seconds": round(verdict.budget_seconds - elapsed, 1),
        }
        if self.shape is not None and lengths:
            length = max(1, round(sum(lengths) / len(lengths)))
            flops = self.shape.flops_per_token(length, lora=self.lora, switches=self.switches)
            utilisation = mfu(padded_rate / self.world_size, flops, self.peak_flops)
            if utilisation is not None:
                values["mfu"] = round(utilisation, DIGITS)
        return values
