"""THE step in a fresh interpreter, as `train` starts one: `python -m benchtrain.bench.fresh_process REQUEST_JSON`
prints one JSON line. Two tasks: "compile" (a shape bench compiled, from inductor's cache) and
"probes" (configurations measured again: the spread between processes). Why: docs/design.md#bench-fresh-process
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, replace

from benchtrain.bench.probe import Workload, run_probe
from benchtrain.bench.timing import WELL_TIMED_STEP_SECONDS, ProbeSettings
from benchtrain.calibration.dimensions import switches
from benchtrain.calibration.step_config import StepConfig
from benchtrain.common.heap import frozen_heap
from benchtrain.common.json_types import JsonDict
from benchtrain.train.step.engine import StepOptions, engine_from_options
from benchtrain.train.step.peak_memory import resident_bytes_before_model
from benchtrain.train.step.runtime import make_accelerator
from benchtrain.train.workload.batching import SyntheticBatches
from benchtrain.train.workload.method import MethodConfig, unwrap
from benchtrain.train.workload.model import ModelSpec, resolve_model

COMPILE_STEPS = 4
# A child process that has not finished by then has failed, when no budget sets less.
CHILD_TIMEOUT = 900.0
# Two fresh processes: their difference is a sample of the spread between processes, which one
# process alone cannot show.
PROCESSES = 2
# Configurations each process measures: the measured steps at three quantiles of their length.
CONFIGS = 3

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
    return {
        name: value
        for name, value in source.items()
        if name not in LAUNCHER_VARIABLES and not name.startswith(LAUNCHER_PREFIXES)
    }


def child_request(task: str, spec: ModelSpec, method: MethodConfig) -> JsonDict:
    """A child's request: its task, the model's config whole (a slice stays a slice) and the method."""
    return {
        "task": task,
        "model": spec.reference,
        "config": spec.config_dict,
        "load_weights": spec.load_weights,
        "method": asdict(method),
    }


def child_workload(request: JsonDict) -> tuple[ModelSpec, MethodConfig]:
    """The model and method a child process builds, from its request (`child_request`)."""
    method = MethodConfig(
        **{**request["method"], "lora_targets": tuple(request["method"]["lora_targets"] or ()) or None}
    )
    return replace(
        resolve_model(request["model"]), config_dict=request["config"], load_weights=request["load_weights"]
    ), method


def run_child(request: JsonDict, timeout_seconds: float) -> JsonDict | None:
    """This module in a fresh interpreter, never a second rank 0 of this job: the JSON line it printed
    last, or None when it failed or ran past `timeout_seconds`."""
    command = [sys.executable, "-m", "benchtrain.bench.fresh_process", json.dumps(request)]
    done = run_own_group(command, timeout_seconds)
    if done is None or done.returncode != 0 or not done.stdout.strip():
        return None
    result: JsonDict = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def run_own_group(command: list[str], timeout_seconds: float) -> subprocess.CompletedProcess[str] | None:
    """`command` in a process group of its own, its output captured; None past `timeout_seconds`. A SIGTERM to this
    process (an engine's stop, `timeout`) ends the group first, then this process as SIGTERM would: the child
    measures on the same device and would hold it after bench is gone."""
    with subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=single_process_environment(),
        start_new_session=True,
    ) as child:

        def end_group() -> None:
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        def on_term(signum: int, frame: object) -> None:
            end_group()
            signal.signal(signal.SIGTERM, previous)
            os.kill(os.getpid(), signal.SIGTERM)

        main_thread = threading.current_thread() is threading.main_thread()
        previous = (signal.getsignal(signal.SIGTERM) or signal.SIG_DFL) if main_thread else signal.SIG_DFL
        if main_thread:
            signal.signal(signal.SIGTERM, on_term)
        try:
            stdout, stderr = child.communicate(timeout=timeout_seconds)
        except subprocess.TimeoutExpired:
            end_group()
            child.communicate()
            return None
        except BaseException:
            end_group()
            raise
        finally:
            if main_thread:
                signal.signal(signal.SIGTERM, previous)
    return subprocess.CompletedProcess(command, child.returncode, stdout, stderr)


def main(argv: list[str]) -> None:
    started = time.perf_counter()
    request = json.loads(argv[0])
    spec, method = child_workload(request)
    if request["task"] == "compile":
        engine = engine_from_options(
            spec,
            method,
            make_accelerator(),
            StepOptions(compile="on", loss=request["loss"]),
            tuple(request["switches"]),
        )
        batch = SyntheticBatches(
            1, request["micro_batch_size"], request["seq_len"], unwrap(engine.model).config.vocab_size
        )[0]
        seconds = [engine.step.run(iter([batch]), 1).seconds for _ in range(COMPILE_STEPS)]
        result: JsonDict = {"first_step_seconds": seconds[0], "step_seconds": statistics.median(seconds[1:])}
    else:
        before_model = resident_bytes_before_model()
        workload = Workload(spec, None, method, StepOptions(**request["options"]))
        settings = ProbeSettings(**request["settings"])
        with frozen_heap():  # as the bench's probes run (common.heap)
            rows = [run_probe(workload, StepConfig.from_row(config), settings) for config in request["configs"]]
        result = {"rows": rows, "rss_before_model_bytes": before_model, "build_seconds": workload.build_seconds}
    print(json.dumps({**result, "process_seconds": time.perf_counter() - started}))


def measure_in_new_process(
    spec: ModelSpec, method: MethodConfig, loss: str, row: JsonDict, timeout_seconds: float
) -> dict[str, float] | None:
    """The compiled step at `row`'s shape in a fresh interpreter: its first step's seconds (loading
    inductor and the kernels from the on-disk cache) and its steady step's; None when it fails."""
    shape = {
        "micro_batch_size": int(row["micro_batch_size"]),
        "seq_len": int(row["seq_len"]),
        "switches": [dimension.name for dimension in switches() if row.get(dimension.name)],
    }
    return run_child({**child_request("compile", spec, method), "loss": loss, **shape}, timeout_seconds)


def check_configs(rows: list[JsonDict]) -> list[StepConfig]:
    """The configurations a fresh process measures again: measured ones (so the comparison is of
    processes, not of the fit's interpolation) whose steps time well, at the quartiles and the
    median of their step time."""
    ok = sorted(
        (row for row in rows if row["status"] == "ok" and row["step_seconds"] >= WELL_TIMED_STEP_SECONDS),
        key=lambda row: row["step_seconds"],
    )
    if not ok:
        return []
    picked = dict.fromkeys(StepConfig.from_row(ok[round(q * (len(ok) - 1))]) for q in (0.25, 0.5, 0.75))
    return list(picked)[:CONFIGS]


def check_price(
    configs: list[StepConfig], process_seconds: float, probe_seconds: Callable[[StepConfig], float]
) -> float:
    """Seconds the check costs: per process, its start and model build, and each configuration's probe."""
    return PROCESSES * (process_seconds + sum(probe_seconds(config) for config in configs))


def measure_in_fresh_processes(
    spec: ModelSpec,
    method: MethodConfig,
    options: StepOptions,
    configs: list[StepConfig],
    settings: ProbeSettings,
    timeout_seconds: float,
    processes: int = PROCESSES,
) -> list[JsonDict]:
    """Probe `configs` (synthetic tokens) in `processes` new interpreters, one after another: their ok
    rows, each with its `process` and that process's `rss_before_model_bytes`. A process that fails
    or runs past its share of `timeout_seconds` adds nothing."""
    request = {
        **child_request("probes", spec, method),
        "options": asdict(options),
        "settings": asdict(settings),
        "configs": [c.to_row() for c in configs],
    }
    rows = []
    for index in range(processes):
        result = run_child(request, timeout_seconds / processes)
        if result is not None:
            rows += [
                {**row, "process": index, "rss_before_model_bytes": result["rss_before_model_bytes"]}
                for row in result["rows"]
                if row["status"] == "ok"
            ]
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
