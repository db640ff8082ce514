"""What a new `train` process pays to compile a shape bench already compiled on this machine.

Run by `bench run --compile on` in a fresh interpreter, as `train` will be: build the step, run a
few steps of one probed shape, print JSON with the first step's seconds and the steady step's. The
difference holds loading inductor and the compiled kernels from its on-disk cache, which an
in-process measurement (imports done) would miss. Also the helpers of every child process of bench.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, replace
from typing import Any

from train.step.engine import StepOptions, engine_from_options
from train.step.runtime import make_accelerator
from train.workload.batching import SyntheticBatches
from train.workload.method import MethodConfig, unwrap
from train.workload.model import ModelSpec, resolve_model

STEPS = 4
# A child process (compile cache, fresh-process check) that has not finished by then has failed, when no budget sets less.
CHILD_TIMEOUT = 900.0

# What torchrun's elastic agent and `accelerate launch` tell each worker about its job. A child that
# inherits them is one more rank 0 of the job: it joins the job's rendezvous, and the child and every
# other rank wait on each other until the watchdog kills the bench.
LAUNCHER_VARIABLES = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_NAME",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "FORK_LAUNCHED",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",  # the agent's choice for its workers; a lone process keeps torch's default
    }
)
# TORCHELASTIC_*: the agent's run id, store and restarts; ACCELERATE_* and FSDP_*: the launched
# job's distributed type, precision and FSDP plugin (a child builds its own, as one process);
# PET_*: torchrun's own arguments given as variables.
LAUNCHER_PREFIXES = ("TORCHELASTIC_", "ACCELERATE_", "FSDP_", "PET_")


def single_process_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """`environ` (this process's) without the launcher's variables: a child started from it is a
    process of its own, on the same device (CUDA_VISIBLE_DEVICES is kept), not a rank of this job."""
    source = dict(os.environ if environ is None else environ)
    return {name: value for name, value in source.items() if name not in LAUNCHER_VARIABLES and not name.startswith(LAUNCHER_PREFIXES)}


def child_request(spec: ModelSpec, method: Any) -> dict[str, Any]:
    """The model and method as a child process's request: the config whole (a slice stays a slice)."""
    return {"model": spec.reference, "config": spec.config_dict, "load_weights": spec.load_weights, "method": asdict(method)}


def child_workload(request: dict[str, Any]) -> tuple[ModelSpec, MethodConfig]:
    """The model and method a child process builds, from its request (`child_request`)."""
    method = MethodConfig(**{**request["method"], "lora_targets": tuple(request["method"]["lora_targets"] or ()) or None})
    return replace(resolve_model(request["model"]), config_dict=request["config"], load_weights=request["load_weights"]), method


def run_child(module: str, request: dict[str, Any], timeout_seconds: float) -> dict[str, Any] | None:
    """`python -m module REQUEST` in a fresh interpreter, never a second rank 0 of this job: the JSON
    line it printed last, or None when it failed or ran past `timeout_seconds`."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", module, json.dumps(request)], capture_output=True, text=True, timeout=timeout_seconds, env=single_process_environment()
        )
    except subprocess.TimeoutExpired:
        return None
    if done.returncode != 0 or not done.stdout.strip():
        return None
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str]) -> None:
    started = time.perf_counter()
    request = json.loads(argv[0])
    spec, method = child_workload(request)
    engine = engine_from_options(spec, method, make_accelerator(), StepOptions(compile="on", loss=request["loss"]), request["checkpointing"])
    batch = SyntheticBatches(1, request["micro_batch_size"], request["seq_len"], unwrap(engine.model).config.vocab_size)[0]
    seconds = [engine.step.run(iter([batch]), 1).seconds for _ in range(STEPS)]
    print(json.dumps({"first_step_seconds": seconds[0], "step_seconds": statistics.median(seconds[1:]), "process_seconds": time.perf_counter() - started}))


def measure_in_new_process(spec: ModelSpec, method: Any, loss: str, row: dict[str, Any], timeout_seconds: float = CHILD_TIMEOUT) -> dict[str, float] | None:
    """Run this module in a fresh interpreter for `spec` at `row`'s shape; None when it fails."""
    shape = {"micro_batch_size": int(row["micro_batch_size"]), "seq_len": int(row["seq_len"]), "checkpointing": bool(row.get("gradient_checkpointing"))}
    return run_child("bench.compile_probe", {**child_request(spec, method), "loss": loss, **shape}, timeout_seconds)


if __name__ == "__main__":
    main(sys.argv[1:])
