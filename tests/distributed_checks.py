"""Checks that run under torchrun, started by tests/test_multi_process.py:

    python -m torch.distributed.run --nproc_per_node N tests/distributed_checks.py lr-curve STEPS
    python -m torch.distributed.run --nproc_per_node 2 tests/distributed_checks.py one-rank-oom

Rank 0 prints one JSON line with what it found. `learning_rate_curve` also runs in one process, in
the test itself, for the curve to compare with."""

from __future__ import annotations

import json
import sys
from typing import Any


def learning_rate_curve(steps: int) -> dict[str, Any]:
    """The learning rate each of `steps` optimizer steps trained at, with the run's schedule
    (the default cosine, train.step.hyperparameters) and THE step, and the scheduler's rate after the last one."""
    import torch

    from train.step.engine import Optimization, StepOptions, build_engine
    from train.step.runtime import make_accelerator
    from train.workload.batching import SyntheticBatches
    from train.workload.method import MethodConfig
    from train.workload.model import resolve_model

    torch.manual_seed(0)
    spec = resolve_model("tiny")
    options = StepOptions(compile="off", loss="plain")
    engine = build_engine(spec, MethodConfig(), make_accelerator(), options, optimization=Optimization(1e-3, total_steps=steps))
    batches = iter(SyntheticBatches(steps, 1, 8, spec.config_dict["vocab_size"]))
    rates = [engine.step.run(batches, 1).learning_rate for _ in range(steps)]
    return {"rates": rates, "final": engine.scheduler.get_last_lr()[0], "processes": engine.accelerator.num_processes}


def one_rank_oom() -> dict[str, Any]:
    """A probe that runs out of memory on rank 0 only, then one that fits: both end on every rank
    (no rank left in DDP's all-reduce), and the combined rows say oom, then ok."""
    import torch.distributed as dist

    from bench.distributed import combine_rows
    from bench.probe import ProbeSettings, Workload, run_probe
    from calibration.step_config import StepConfig
    from train.workload.method import unwrap
    from train.workload.model import resolve_model

    workload = Workload(resolve_model("tiny"))
    lm = unwrap(workload.model)
    original = lm.forward
    failing = {"on": dist.get_rank() == 0}

    def forward(*args: Any, **kwargs: Any) -> Any:
        if failing["on"]:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (rank 0 only)")
        return original(*args, **kwargs)

    lm.forward = forward
    settings = ProbeSettings(warmup_steps=1, min_steps=2, max_steps=2, max_seconds=5.0)
    statuses = []
    for _ in range(2):
        row = run_probe(workload, StepConfig(micro_batch_size=2, num_workers=0, grad_accum=2, seq_len=16), settings)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, row)
        statuses.append(combine_rows(gathered)["status"])
        failing["on"] = False
    return {"statuses": statuses}


def main() -> None:
    import torch.distributed as dist

    check = sys.argv[1]
    result = learning_rate_curve(int(sys.argv[2])) if check == "lr-curve" else one_rank_oom()
    if dist.get_rank() == 0:
        print(json.dumps(result), flush=True)
    from train.step.runtime import finish_together, leave

    finish_together()
    leave(0)


if __name__ == "__main__":
    main()
