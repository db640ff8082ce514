"""The collective model against gloo on this host, run as two ranks (torchrun, or tests/forkserver.py's ranks, as tests/test_topology.py runs it):

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node 2 tests/topology_checks.py STEPS [MICRO SEQ]

Every rank runs one compute thread (torch.set_num_threads(1): one core each on this 2-core
machine, as torchrun gives one device per process). Rank 0 prints one JSON line with:
- `all_reduce`: all-reduces timed as bench times them (train.planning.comm.measure_collective:
  its sizes, on CPU beside a computing thread), from which the test fits the loopback link;
- `all_reduce_idle`: the same timed on idle processes (what bench did before issue 41);
- `step_alone`: THE step of `tiny` (micro-batch × seq, no accumulation) with no collective in it
  (`synchronize=False`): what a 1-process calibration measures when it runs with the threads and
  the share of the cores each rank has here — two processes computing side by side is compute,
  not communication, so it belongs on this side of the comparison;
- `step_ddp`: the same step under DDP (its gradient all-reduce overlapped with backward as DDP
  does it), alternated with the first so both see the same load;
- `extra`, `extra_error`: what DDP adds, step by step against the step before it without
  communication (paired: both under the same load), its median and that median's standard error;
- `gradient_bytes`: what DDP all-reduces per optimizer step.
Each figure is the slowest rank's median.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def slowest_median(values: list[float]) -> float:
    import statistics

    import torch
    import torch.distributed as dist

    median = torch.tensor([statistics.median(values)], dtype=torch.float64)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return float(median.item())


def slowest_extra(alone: list[float], together: list[float]) -> tuple[float, float]:
    """What DDP adds to the step, paired step by step (each DDP step against the step without
    communication just before it, under the same load): the median of the differences and its
    standard error (1.2533 σ/√n), the slowest rank's."""
    import math
    import statistics

    import torch
    import torch.distributed as dist

    differences = [ddp - plain for plain, ddp in zip(alone, together, strict=True)]
    figures = torch.tensor(
        [statistics.median(differences), 1.2533 * statistics.stdev(differences) / math.sqrt(len(differences))],
        dtype=torch.float64,
    )
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    return float(figures[0]), float(figures[1])


def ddp_step_against_collectives(steps: int, micro: int, seq: int) -> dict[str, Any]:
    import time

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from benchtrain.bench.probe import Workload
    from benchtrain.calibration.comm import gradient_bytes
    from benchtrain.train.planning import comm
    from benchtrain.train.planning.comm import measure_collective
    from benchtrain.train.step.engine import StepOptions
    from benchtrain.train.workload.batching import SyntheticBatches
    from benchtrain.train.workload.model import resolve_model

    torch.manual_seed(0)
    workload = Workload(resolve_model("tiny"), options=StepOptions(compile="off", loss="plain"))
    assert isinstance(workload.engine.model, torch.nn.parallel.DistributedDataParallel), type(workload.engine.model)
    rows = measure_collective(workload.device, "all_reduce")  # as bench times them: beside a computing thread on CPU
    with patched(comm, "beside_compute", lambda device: contextlib.nullcontext()):
        idle = measure_collective(workload.device, "all_reduce")  # on idle processes, for the notes
    batches = iter(SyntheticBatches(10**6, micro, seq, workload.vocab_size))
    for _ in range(3):  # warm-up: allocations, the reducer's first buckets
        workload.engine.step.run(batches, 1, synchronize=False)
        workload.engine.step.run(batches, 1)
    alone: list[float] = []
    together: list[float] = []
    for _ in range(steps):
        for synchronize, times in ((False, alone), (True, together)):
            dist.barrier()
            started = time.perf_counter()
            workload.engine.step.run(batches, 1, synchronize=synchronize)
            times.append(time.perf_counter() - started)
    extra, extra_error = slowest_extra(alone, together)
    trainable = sum(p.numel() for p in workload.engine.model.parameters() if p.requires_grad)
    return {
        "all_reduce": rows,
        "all_reduce_idle": idle,
        "step_alone": slowest_median(alone),
        "step_ddp": slowest_median(together),
        "extra": extra,
        "extra_error": extra_error,
        "gradient_bytes": gradient_bytes(trainable),
        "threads": torch.get_num_threads(),
        "processes": dist.get_world_size(),
        "backend": str(dist.get_backend()),
    }


def main() -> None:
    from distributed_checks import report_and_leave

    steps = int(sys.argv[1])
    micro, seq = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (4, 64)
    report_and_leave(ddp_step_against_collectives(steps, micro, seq))


if __name__ == "__main__":
    main()
