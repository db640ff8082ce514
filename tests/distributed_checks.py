"""Checks that run as the ranks of a process group: under torchrun, or forked by tests/forkserver.py
with the variables torchrun sets (tests/test_multi_process.py's `_as_process_group`):

    python -m torch.distributed.run --nproc_per_node N tests/distributed_checks.py lr-curve STEPS
    python -m torch.distributed.run --nproc_per_node 2 tests/distributed_checks.py one-rank-oom
    python -m torch.distributed.run --nproc_per_node 2 tests/distributed_checks.py plans-agree DATA ELAPSED ARGUMENTS…
    python -m torch.distributed.run --nproc_per_node 2 tests/distributed_checks.py late-oom ddp|fsdp
    python -m torch.distributed.run --nproc_per_node 2 tests/distributed_checks.py rows-survive ddp|fsdp oom|stall
    python -m torch.distributed.run --nproc_per_node 2 tests/distributed_checks.py slow-load FOLDER TIMEOUT SLEEP

Rank 0 prints one JSON line with what it found. `learning_rate_curve` also runs in one process, in
the test itself, for the curve to compare with."""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def learning_rate_curve(steps: int) -> dict[str, Any]:
    """The learning rate each of `steps` optimizer steps trained at, with the run's schedule
    (the default cosine, train.step.hyperparameters) and THE step, and the scheduler's rate after the last one."""
    import torch

    from benchtrain.train.step.engine import Optimization, StepOptions, engine_from_options
    from benchtrain.train.step.runtime import make_accelerator
    from benchtrain.train.workload.batching import SyntheticBatches
    from benchtrain.train.workload.method import MethodConfig
    from benchtrain.train.workload.model import resolve_model

    torch.manual_seed(0)
    spec = resolve_model("tiny")
    options = StepOptions(compile="off", loss="plain")
    engine = engine_from_options(
        spec, MethodConfig(), make_accelerator(), options, optimization=Optimization(1e-3, total_steps=steps)
    )
    batches = iter(SyntheticBatches(steps, 1, 8, spec.config_dict["vocab_size"]))
    rates = [engine.step.run(batches, 1).learning_rate for _ in range(steps)]
    return {"rates": rates, "final": engine.scheduler.get_last_lr()[0], "processes": engine.accelerator.num_processes}


def one_rank_oom() -> dict[str, Any]:
    """A probe that runs out of memory on rank 0 only, then one that fits: both end on every rank
    (no rank left in DDP's all-reduce), and the combined rows say oom, then ok."""
    import torch.distributed as dist

    from benchtrain.bench.probe import Workload
    from benchtrain.train.workload.method import unwrap
    from benchtrain.train.workload.model import resolve_model

    workload = Workload(resolve_model("tiny"))
    lm = unwrap(workload.engine.model)
    original = lm.forward
    failing = {"on": dist.get_rank() == 0}

    def forward(*args: Any, **kwargs: Any) -> Any:
        if failing["on"]:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (rank 0 only)")
        return original(*args, **kwargs)

    lm.forward = forward
    rows = two_probes_on_every_rank(workload, lambda: failing.update(on=False))
    return {"statuses": [row["status"] for row in rows]}


def two_probes_on_every_rank(workload: Any, after_first: Any = None) -> list[dict[str, Any]]:
    """The same small probe twice on every rank, each one's rows combined as bench combines them
    (`after_first` runs between the two)."""
    import torch.distributed as dist

    from benchtrain.bench.probe import ProbeSettings, run_probe
    from benchtrain.bench.probe_tasks import combine_rows
    from benchtrain.calibration.step_config import StepConfig

    settings = ProbeSettings(warmup_steps=1, min_steps=2, max_steps=2, max_seconds=5.0)
    rows = []
    for index in range(2):
        row = run_probe(workload, StepConfig(micro_batch_size=2, num_workers=0, grad_accum=2, seq_len=16), settings)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, row)
        rows.append(combine_rows(gathered))
        if index == 0 and after_first is not None:
            after_first()
    return rows


def late_oom(sharding: str) -> dict[str, Any]:
    """A probe whose second step runs out of memory on rank 1 alone, in the optimizer's step (after
    the step's collectives: the others are already past them), then a probe that fits: both end on
    every rank, and the combined rows say oom, then ok."""
    import torch.distributed as dist

    from benchtrain.bench.probe import Workload
    from benchtrain.train.step.engine import StepOptions
    from benchtrain.train.workload.model import resolve_model

    workload = Workload(resolve_model("tiny"), options=StepOptions(compile="off", loss="plain", sharding=sharding))
    optimizer = workload.engine.optimizer
    original, calls = optimizer.step, {"count": 0}

    def step(*args: Any, **kwargs: Any) -> Any:
        calls["count"] += 1
        if dist.get_rank() == 1 and calls["count"] == 2:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (rank 1, step 2)")
        return original(*args, **kwargs)

    optimizer.step = step
    rows = two_probes_on_every_rank(workload)
    return {
        "statuses": [row["status"] for row in rows],
        "errors": [row.get("error", "") for row in rows],
        "sharding": workload.engine.setup.sharding,
    }


# The probe (counted from 1) in whose second step's backward rank 1 fails (rows_survive).
FAILING_PROBE = 3
# How long rank 1 stalls there before it runs out of memory ("stall"): past the probe's collective timeout.
STALL_SECONDS = 25.0


def rows_survive(sharding: str, failure: str) -> dict[str, Any]:
    """`bench run` under two processes, rank 1 failing in the middle of the third probe's second
    step's backward: between collectives (FSDP's all-gathers and reduce-scatters, DDP's bucketed
    all-reduce), where no agreement can reach the other rank. "oom": it runs out of memory there
    (rank 0's next collective no longer matches rank 1's: gloo aborts; NCCL would wait for its
    watchdog); "stall": it first stalls for STALL_SECONDS, and rank 0's collective gives up after the
    probe's timeout (bench.probe_tasks.COLLECTIVE_TIMEOUT_FLOOR made 5 s). Rank 0's exit code and
    the seconds from the failing probe's start to bench's end, when it ends at all."""
    import time

    import torch.distributed as dist

    import benchtrain.bench.probe as probe
    import benchtrain.bench.probe_tasks as probe_tasks
    from benchtrain.bench.cli import main as bench_main
    from benchtrain.common.errors import guard_cli
    from benchtrain.train.workload.method import unwrap

    probe_tasks.COLLECTIVE_TIMEOUT_FLOOR = 5.0  # seconds: the test's processes are not GPUs
    original, probes = probe.run_probe, {"count": 0, "failing_started": 0.0}

    def run_probe(workload: Any, config: Any, settings: Any, peak_flops: float | None = None) -> dict[str, Any]:
        probes["count"] += 1
        if probes["count"] == FAILING_PROBE:
            probes["failing_started"] = time.monotonic()
        if probes["count"] != FAILING_PROBE or int(os.environ["RANK"]) != 1:
            return original(workload, config, settings, peak_flops)
        blocks = unwrap(workload.engine.model).model.layers  # a llama's decoder blocks (FSDP renames their class)
        forwards = {"count": 0}

        def out_of_memory(gradient: Any) -> Any:
            if failure == "stall":
                time.sleep(STALL_SECONDS)
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (rank 1, step 2's backward)")

        def arm(module: Any, inputs: Any, output: Any) -> None:
            forwards["count"] += 1
            if forwards["count"] == 2:  # the second step: its backward fails between the blocks' collectives
                (output[0] if isinstance(output, tuple) else output).register_hook(out_of_memory)

        handle = blocks[len(blocks) // 2].register_forward_hook(arm)
        try:
            return original(workload, config, settings, peak_flops)
        finally:
            handle.remove()

    probe_tasks.run_probe = run_probe  # where the probe task calls it
    grid = ["--gpu", "cpu", "--batch-sizes", "1,2", "--seq-lens", "32,64", "--workers", "0", "--accum", "1"]
    code = guard_cli(
        bench_main,
        ["run", *grid, "--sharding", sharding, "--loss", "plain", "--compile", "off", "--no-report", "--quiet"],
    )
    return {
        "code": code,
        "rank": dist.get_rank(),
        "failing_probe_seconds": time.monotonic() - probes["failing_started"],
    }


def plans_agree(data: str, rank1_elapsed: float, arguments: list[str]) -> dict[str, Any]:
    """`train`'s plan on every rank (tests/test_multi_process_ranks.py), rank 1 made to have spent
    `rank1_elapsed` seconds more than rank 0 (its clock feeds --fit-deadline and the deadline check);
    then the guard before the first step, given a step count that differs on rank 1."""
    import time

    import torch.distributed as dist

    from benchtrain.common.errors import BenchtrainError
    from benchtrain.train.cli import build_parser
    from benchtrain.train.recipes.config import TrainConfig
    from benchtrain.train.recipes.recipe import TrainRecipe, check_same_training
    from benchtrain.train.running.resume import what_to_continue

    rank = int(os.environ["RANK"])
    args = build_parser().parse_args(["--use-calibration", "latest", "--data", data, *arguments])
    started = time.monotonic() - (rank1_elapsed if rank == 1 else 0.0)
    continuation = what_to_continue(args.resume, args.out, args.dry_run, started)
    config = TrainConfig.from_args(args, started_at=started, continuation=continuation)
    recipe = TrainRecipe(config, continuation, lambda folder: folder)
    recipe.setup()
    try:
        plan = recipe.plan().plan
        mine: dict[str, Any] = {
            "configuration": plan.chosen.config.to_row(),
            "optimizer_steps": plan.chosen.optimizer_steps,
            "step_limit": plan.step_limit,
        }
    except BenchtrainError as error:
        mine = {"refused": str(error)}
    plans: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(plans, mine)
    try:
        check_same_training({"optimizer_steps": 10 + rank})
        guard = "passed"
    except BenchtrainError as error:
        guard = str(error)
    guards: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(guards, guard)
    return {"plans": plans, "guard": guards}


def slow_load(folder: str, timeout_seconds: float, sleep_seconds: float) -> dict[str, Any]:
    """FSDP's sharded model filled from `folder` (train.step.sharding.load_from_rank0) under a process
    group whose collectives give up after `timeout_seconds`, while rank 0's reading of the weights
    takes `sleep_seconds` longer: the other ranks must not be left in a collective meanwhile. Rank 0
    reports whether the gathered weights are the folder's (in the shards' fp32)."""
    import time
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from benchtrain.train.step.sharding import gather_full_state, shard_model
    from benchtrain.train.workload.model import make_config, resolve_model

    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_seconds))
    spec = resolve_model(folder)
    read = AutoModelForCausalLM.from_pretrained
    if dist.get_rank() == 0:

        def slow_read(*args: Any, **kwargs: Any) -> Any:
            time.sleep(sleep_seconds)
            return read(*args, **kwargs)

        AutoModelForCausalLM.from_pretrained = slow_read  # type: ignore[method-assign]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(make_config(spec), dtype=torch.float32)
    shard_model(model, torch.device("cpu"), bf16=False, spec=spec)
    weights, _ = gather_full_state(model, None)
    if dist.get_rank() != 0:
        return {}
    saved = read(folder, dtype="auto").state_dict()
    return {
        "same": all(torch.equal(weights[name], tensor.float()) for name, tensor in saved.items()),
        "saved_dtype": str(next(iter(saved.values())).dtype),
        "shard_dtype": str(next(model.parameters()).dtype),
    }


def main() -> None:

    check = sys.argv[1]
    if check == "plans-agree":
        result = plans_agree(sys.argv[2], float(sys.argv[3]), sys.argv[4:])
    elif check == "late-oom":
        result = late_oom(sys.argv[2])
    elif check == "rows-survive":
        result = rows_survive(sys.argv[2], sys.argv[3])
    elif check == "slow-load":
        result = slow_load(sys.argv[2], float(sys.argv[3]), float(sys.argv[4]))
    else:
        result = learning_rate_curve(int(sys.argv[2])) if check == "lr-curve" else one_rank_oom()
    report_and_leave(result)


def report_and_leave(result: Any) -> None:
    """Rank 0 prints `result` as one JSON line; every rank waits for the others and exits 0."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print(json.dumps(result), flush=True)
    from benchtrain.train.step.runtime import finish_together, leave

    finish_together()
    leave(0)


if __name__ == "__main__":
    main()
