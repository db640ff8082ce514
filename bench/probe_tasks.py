"""What each process of a bench runs on its workload when rank 0 says so: the coordinator's named
tasks (bench.distributed), the same code under one process or several."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.disk_write import measure_checkpoint, real_save_fits
from bench.distributed import Coordinator
from bench.timing import ProbeSettings
from calibration.step_config import StepConfig
from common.console import is_main_process
from train.planning.comm import measure_collectives


def probe_coordinator(workload: Any, peak_flops: float | None) -> Coordinator:
    """The coordinator of this process, with a handler for every task rank 0 may ask of it."""
    # Looked up when the coordinator is made: tests replace the probes.
    from bench.probe import run_eval_probe, run_probe

    return Coordinator(
        {
            "probe": lambda task: run_probe(workload, StepConfig.from_row(task["config"]), ProbeSettings(**task["settings"]), peak_flops),
            "eval": lambda task: run_eval_probe(workload, StepConfig.from_row(task)),
            # FSDP: every rank joins in gathering the state that rank 0 saves (train.running.checkpoint);
            # DDP: rank 0 alone saves. Rank 0's figures are kept.
            "checkpoint": lambda task: (
                measure_checkpoint(workload, Path(task["folder"]), task["real_save"], task["max_bytes"]) if task["every_rank"] or is_main_process() else {}
            ),
            "comm": lambda task: measure_collectives(workload.device, ("all_reduce", "all_gather", "reduce_scatter")),
            "loss_probe": lambda task: (
                workload.set_loss(task["loss"]),
                run_probe(workload, StepConfig.from_row(task["config"]), ProbeSettings(**task["settings"]), peak_flops),
            )[1],
            "set_loss": lambda task: (workload.set_loss(task["loss"]), {})[1],
            # Rank 0 only, and last: the other ranks keep their models, which they no longer use.
            "compile_cache": lambda task: measure_cached_compile(workload, task["row"], task.get("timeout_seconds")) if is_main_process() else {},
        }
    )


def checkpoint_task(workload: Any, folder: Path, max_bytes: int) -> dict[str, Any]:
    """Rank 0's decision for the checkpoint measurement, the same on every rank."""
    return {
        "folder": str(folder),
        "real_save": real_save_fits(workload, folder, max_bytes),
        "max_bytes": max_bytes,
        "every_rank": workload.engine.sharding == "fsdp",
    }


def measure_cached_compile(workload: Any, row: dict[str, Any], timeout_seconds: float | None) -> dict[str, Any]:
    """Free this process's model and device memory, then time a fresh `train`-like process
    compiling `row`'s shape from inductor's cache (bench.compile_probe)."""
    from bench.compile_probe import measure_in_new_process

    loss = workload.engine.loss
    workload.release()
    return measure_in_new_process(workload.spec.reference, workload.method, loss, row, timeout_seconds or 900.0) or {}
