"""What a new `train` process pays to compile a shape bench already compiled on this machine.

Run by `bench run --compile on` in a fresh Python process, as `train` will be: build the step
(train.step.engine), run a few steps of one probed shape, print JSON with the first step's seconds
and the steady step's. The difference holds loading inductor and the compiled kernels from its
on-disk cache, which an in-process measurement (with imports done) would miss.

    python -m bench.compile_probe '{"model": "tiny", "method": {...}, "micro_batch_size": 2, "seq_len": 64}'
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from typing import Any

STEPS = 4


def main(argv: list[str]) -> None:
    started = time.perf_counter()
    request = json.loads(argv[0])
    from train.step.engine import StepOptions, build_engine
    from train.step.runtime import make_accelerator
    from train.workload.batching import SyntheticBatches
    from train.workload.method import MethodConfig
    from train.workload.model import resolve_model

    method = MethodConfig(**{**request["method"], "lora_targets": tuple(request["method"]["lora_targets"] or ()) or None})
    options = StepOptions(compile="on", loss=request["loss"])
    engine = build_engine(resolve_model(request["model"]), method, make_accelerator(), options, request["checkpointing"])
    batch = SyntheticBatches(1, request["micro_batch_size"], request["seq_len"], engine.model.config.vocab_size)[0]
    seconds = [engine.step.run(iter([batch]), 1).seconds for _ in range(STEPS)]
    print(json.dumps({"first_step_seconds": seconds[0], "step_seconds": statistics.median(seconds[1:]), "process_seconds": time.perf_counter() - started}))


def measure_in_new_process(model: str, method: Any, loss: str, row: dict[str, Any], timeout_seconds: float = 900.0) -> dict[str, float] | None:
    """Run this module in a fresh interpreter for `row`'s shape; None when it fails."""
    request = {
        "model": model,
        "method": asdict(method),
        "loss": loss,
        "micro_batch_size": int(row["micro_batch_size"]),
        "seq_len": int(row["seq_len"]),
        "checkpointing": bool(row.get("gradient_checkpointing")),
    }
    try:
        done = subprocess.run([sys.executable, "-m", "bench.compile_probe", json.dumps(request)], capture_output=True, text=True, timeout=timeout_seconds)
    except subprocess.TimeoutExpired:
        return None
    if done.returncode != 0 or not done.stdout.strip():
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main(sys.argv[1:])
