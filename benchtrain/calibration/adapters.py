"""Which training methods train adapters on a frozen base (LoRA and its family) rather than the whole model: the one
table train.workload.method's METHODS reads, and what calibration/ reads where a file names its method (a calibration's
`training.method`, run.json's plan)."""

from __future__ import annotations

# By the method's name: --method's value, run.json's and the calibration's `method`.
TRAINS_ADAPTERS: dict[str, bool] = {"full": False, "lora": True}


def trains_adapters(method: str) -> bool:
    """Whether `method` trains adapters (their settings under `lora`). A name the table does not hold was written by a
    version with more adapter methods (DoRA): the whole model is trained by "full" alone."""
    return TRAINS_ADAPTERS.get(method, True)
