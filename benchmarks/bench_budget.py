"""What a `bench run` budget buys: probes measured, held-out error, time taken (issue 21).

Two kinds of rows:

- simulated: `bench run --gpu h100 --model MODEL --lora …` on the simulated H100 (tests/simulated.py:
  the real H100 measurements scaled by FLOPs, on a virtual clock). Besides the calibration's own
  held-out error, the simulator knows the truth: the table also gives the calibration's error on
  every configuration of the grid that fits in memory and was *not* probed.
- replay: the real H100 grid of llama-3.2-1b (48 probes): every probe the planner chooses answers
  what it measured on the H100, and the calibration is scored on the real probes it did not choose.
- real: a real `bench run --gpu NAME --model MODEL` on this machine, timed as a whole.

    python benchmarks/bench_budget.py --simulated llama-3.1-8b --lora --checkpointing off,on --budgets 2m,5m,15m
    python benchmarks/bench_budget.py --simulated mistral-nemo-12b --lora --budgets 2m,5m,15m
    python benchmarks/bench_budget.py --replay --budgets 1m,2m,4m     # the real H100 grid, replayed
    python benchmarks/bench_budget.py --real gpt2 --budgets 1m,3m,10m
    python benchmarks/bench_budget.py --real gpt2 --lora --checkpointing off,on --budgets 3m
    python benchmarks/bench_budget.py --real llama-3.1-8b --gpu h100 --lora --checkpointing off,on --budgets 5m   # on a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the simulated H100 (tests/simulated.py)

from benchtrain.common.durations import format_duration, parse_duration


def simulated_row(
    model: str, lora: bool, checkpointing: tuple[int, ...], budget: float, replay: bool = False
) -> dict[str, Any]:
    from simulated import simulate_bench

    from benchtrain.calibration.model import Calibration
    from benchtrain.calibration.step_config import StepConfig

    try:
        record, device = simulate_bench(model, lora, budget, checkpointing, replay=replay)
    except Exception as error:  # a refused budget is a row too
        return {"budget": format_duration(budget), "result": str(error).split(":")[0][:60]}
    ok = [row for row in record["measurements"] if row["status"] == "ok"]
    if record["fit"] is None:
        return {"budget": format_duration(budget), "probes ok": len(ok), "result": "no fit"}
    calibration = Calibration(record)
    probed = {StepConfig.from_row(row) for row in ok}
    truths = []
    from benchtrain.bench.space import default_space

    space = default_space("cuda", device.hardware["memory_bytes"])
    for b in space.axis("batch_sizes"):
        for s in space.axis("seq_lens"):
            for a in space.axis("accums"):
                for c in checkpointing:
                    config = StepConfig(micro_batch_size=b, num_workers=0, grad_accum=a, seq_len=s).switched(
                        gradient_checkpointing=bool(c)
                    )
                    if config in probed or not device.peak_bytes(config) <= device.hardware["memory_bytes"]:
                        continue
                    predicted = calibration.micro_step_seconds(config) * a
                    truths.append(abs(predicted / device.step_seconds(config) - 1) * 100)
    error = record["fit"]["held_out_error"]
    memory = (record["fit"].get("memory") or {}).get("held_out_error") or {}
    over_budget = sum(1 for entry in device.log if entry["ended"] > budget)
    over_memory = sum(
        1
        for row in record["measurements"]
        if (row.get("predicted") or {}).get("peak_memory_bytes", 0) > device.hardware["memory_bytes"]
    )
    return {
        "budget": format_duration(budget),
        "probes ok": len(ok),
        "fit": record["fit"]["kind"],
        "held-out median %": round(error["median_abs_pct"], 2),
        "held-out p90 %": round(error["p90_abs_pct"], 2),
        "memory held-out %": round(memory.get("median_abs_pct") or 0.0, 2),
        "true error, unprobed (median %)": round(statistics.median(truths), 2) if truths else None,
        "true error, unprobed (p90 %)": round(sorted(truths)[int(0.9 * (len(truths) - 1))], 2) if truths else None,
        "took": format_duration(device.clock()),
        "probes past budget": over_budget,
        "predicted past memory": over_memory,
        "after probes skipped": len(record["search"]["skipped_after_probes"]),
    }


def real_row(model: str, lora: bool, checkpointing: str | None, budget: float, device: str) -> dict[str, Any]:
    return real_bench(model, lora, checkpointing, budget, device)[0]


def real_bench(
    model: str,
    lora: bool,
    checkpointing: str | None,
    budget: float,
    device: str,
    extra: tuple[str, ...] = (),
    home: Path | None = None,
) -> tuple[dict[str, Any], Path | None]:
    """One `bench run` in its own process and BENCHTRAIN_HOME (`home`, else a new temporary one):
    its row, and the calibration it stored (None: none). `extra`: more bench run options."""
    home = home or Path(tempfile.mkdtemp(prefix="bench-budget-"))
    command = [
        sys.executable,
        "-m",
        "benchtrain.bench",
        "run",
        "--gpu",
        device,
        "--model",
        model,
        "--budget",
        f"{budget:.0f}s",
        "--quiet",
        *extra,
    ]
    if lora:
        command.append("--lora")
    if checkpointing:
        command += ["--checkpointing", checkpointing]
    started = time.monotonic()
    done = subprocess.run(command, env={**os.environ, "BENCHTRAIN_HOME": str(home)}, capture_output=True, text=True)
    took = time.monotonic() - started
    stored = sorted((home / "calibrations").glob("*.json"))
    row: dict[str, Any] = {"budget": format_duration(budget), "exit": done.returncode, "took": format_duration(took)}
    if not stored:
        row["result"] = (done.stderr.strip().splitlines() or [""])[-1][:120]
        return row, None
    record = json.loads(stored[-1].read_text())
    ok = [r for r in record["measurements"] if r["status"] == "ok"]
    error = record["fit"]["held_out_error"]
    row.update(
        {
            "probes ok": len(ok),
            "fit": record["fit"]["kind"],
            "held-out median %": round(error["median_abs_pct"], 1),
            "held-out p90 %": round(error["p90_abs_pct"], 1),
            "memory held-out %": round(
                ((record["fit"].get("memory") or {}).get("held_out_error") or {}).get("median_abs_pct") or 0.0, 2
            ),
            "load before": record["search"].get("load_average_before"),
        }
    )
    return row, stored[-1]


def print_table(rows: list[dict[str, Any]]) -> None:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(str(row.get(column, "")) for column in columns) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--simulated", metavar="MODEL", help="a preset on the simulated H100")
    where.add_argument("--real", metavar="MODEL", help="a preset, measured for real on this machine's device (--gpu)")
    where.add_argument(
        "--replay",
        action="store_true",
        help="the real H100 grid (llama-3.2-1b, full): each probe answers what it measured there",
    )
    parser.add_argument("--gpu", default="cpu", help="with --real: the device name bench run is told (default cpu)")
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--checkpointing", default=None, help="off,on")
    parser.add_argument("--budgets", default="2m,5m,15m")
    args = parser.parse_args()
    budgets = [parse_duration(text, "--budgets") for text in args.budgets.split(",")]
    rows = []
    for budget in budgets:
        if args.replay:
            rows.append(simulated_row("llama-3.2-1b", False, (0,), budget, replay=True))
        elif args.simulated:
            modes = (0, 1) if args.checkpointing == "off,on" else ((1,) if args.checkpointing == "on" else (0,))
            rows.append(simulated_row(args.simulated, args.lora, modes, budget))
        else:
            rows.append(real_row(args.real, args.lora, args.checkpointing, budget, args.gpu))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print_table(rows)


if __name__ == "__main__":
    main()
