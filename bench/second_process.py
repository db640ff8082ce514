"""The step measured again in fresh processes, where a calibration is used.

On a CPU two processes can run the same step at speeds further apart than the fit's own error, and
a process that has benchmarked for minutes is not the one `train` starts. So bench measures a few
configurations again in PROCESSES fresh interpreters, each building the same Workload, and
bench.record judges the drift correction and the bound between processes by them. Run as
`python -m bench.second_process REQUEST_JSON`; prints one JSON line (rows, resident set, seconds).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from bench.compile_probe import child_request, child_workload, run_child
from bench.probe import Workload, run_probe
from bench.timing import WELL_TIMED_STEP_SECONDS, ProbeSettings
from calibration.step_config import StepConfig
from common.heap import frozen_heap
from train.step.engine import StepOptions
from train.step.peak_memory import resident_bytes_before_model
from train.workload.method import MethodConfig
from train.workload.model import ModelSpec

# Two fresh processes: their difference is a sample of the spread between processes, which one
# process alone cannot show.
PROCESSES = 2
# Configurations each process measures: the measured steps at three quantiles of their length.
CONFIGS = 3


def main(argv: list[str]) -> None:
    started = time.perf_counter()
    request = json.loads(argv[0])
    spec, method = child_workload(request)
    before_model = resident_bytes_before_model()
    workload = Workload(spec, None, method, StepOptions(**request["options"]))
    settings = ProbeSettings(**request["settings"])
    with frozen_heap():  # as the bench's probes run (common.heap)
        rows = [run_probe(workload, StepConfig.from_row(config), settings) for config in request["configs"]]
    seconds = time.perf_counter() - started
    print(json.dumps({"rows": rows, "rss_before_model_bytes": before_model, "build_seconds": workload.build_seconds, "process_seconds": seconds}))


def check_configs(rows: list[dict[str, Any]]) -> list[StepConfig]:
    """The configurations a fresh process measures again: measured ones (so the comparison is of
    processes, not of the fit's interpolation) whose steps time well, at the quartiles and the
    median of their step time."""
    ok = sorted((row for row in rows if row["status"] == "ok" and row["step_seconds"] >= WELL_TIMED_STEP_SECONDS), key=lambda row: row["step_seconds"])
    if not ok:
        return []
    picked = dict.fromkeys(StepConfig.from_row(ok[round(q * (len(ok) - 1))]) for q in (0.25, 0.5, 0.75))
    return list(picked)[:CONFIGS]


def check_price(configs: list[StepConfig], process_seconds: float, probe_seconds: Callable[[StepConfig], float]) -> float:
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
) -> list[dict[str, Any]]:
    """Probe `configs` (synthetic tokens) in `processes` new interpreters, one after another: their ok
    rows, each with its `process` and that process's `rss_before_model_bytes`. A process that fails
    or runs past its share of `timeout_seconds` adds nothing."""
    request = {**child_request(spec, method), "options": asdict(options), "settings": asdict(settings), "configs": [config.to_row() for config in configs]}
    rows = []
    for index in range(processes):
        result = run_child("bench.second_process", request, timeout_seconds / processes)
        if result is not None:
            rows += [{**row, "process": index, "rss_before_model_bytes": result["rss_before_model_bytes"]} for row in result["rows"] if row["status"] == "ok"]
    return rows

if __name__ == "__main__":
    main(sys.argv[1:])
