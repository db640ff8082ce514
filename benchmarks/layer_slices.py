"""Slices of a model predict the whole (issue 40): step time and peak memory, measured on this CPU.

For each model and method (full fine-tuning, LoRA), every depth is benched in a fresh process
(`bench run --gpu cpu --model <the real config with K layers>` over one fixed grid, so that every
configuration is measured at every depth), and so is the whole model. The depths' calibrations
are combined as `bench run --layers` combines them (bench.layer_slices.whole_model_record), for
each set of depths asked, and the combined calibration's prediction (the fitted median step, the
memory model's peak: what a plan uses) is compared with what the whole model measured, per
configuration. The table gives the median and worst error over the configurations, the
extrapolation's own held-out error (the deepest slice predicted from the shallower ones) and the
bound the plan then carries.

    python benchmarks/layer_slices.py                                  # gpt2 and llama-12L, full and LoRA, depths 2,4,6 and 2,4
    python benchmarks/layer_slices.py --models gpt2 --methods lora --depth-sets 2,4,6
    python benchmarks/layer_slices.py --tiny                           # the same pipeline on tiny shapes (minutes; its times are noise)

`--layers auto` on this CPU: the whole model fits and, without a budget, is measured whole; with a
budget too small for a usable fit of it, auto takes 2,4,6 (the first ladder whose deepest slice
fits, bench.layer_slices.AUTO_LADDERS): the 2,4,6 rows are auto's choice.
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

# A llama-shaped model of 12 layers, CPU-sized (≈110M parameters: gpt2's size).
LLAMA_12 = {
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}
TINY = {
    "gpt2": {"model_type": "gpt2", "vocab_size": 512, "n_embd": 64, "n_layer": 12, "n_head": 4, "n_positions": 256},
    "llama-12l": {
        **LLAMA_12,
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 172,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
    },
}


def model_config(name: str, tiny: bool) -> dict[str, Any]:
    from benchtrain.train.workload.model import PRESETS

    if tiny:
        return dict(TINY[name])
    return dict(LLAMA_12) if name == "llama-12l" else dict(PRESETS[name])


def write_model(folder: Path, config: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def bench_in_fresh_process(folder: Path, home: Path, lora: bool, grid: argparse.Namespace) -> dict[str, Any]:
    """`bench run` of the model in `folder`, alone in its own process; its calibration."""
    command = [
        sys.executable,
        "-m",
        "benchtrain.bench",
        "run",
        "--gpu",
        "cpu",
        "--model",
        str(folder),
        "--workers",
        "0",
        "--no-report",
        "--quiet",
    ]
    command += [
        "--batch-sizes",
        grid.batch_sizes,
        "--seq-lens",
        grid.seq_lens,
        "--accum",
        grid.accum,
        "--max-probe-seconds",
        str(grid.max_probe_seconds),
    ]
    command += ["--lora"] if lora else []
    started = time.monotonic()
    done = subprocess.run(
        command, env={**os.environ, "BENCHTRAIN_HOME": str(home)}, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"bench run of {folder.name} failed:\n{done.stderr[-2000:]}")
    path = next((home / "calibrations").glob("*.json"))
    print(
        f"  measured {folder.name}{' (LoRA)' if lora else ''} in {time.monotonic() - started:.0f}s",
        file=sys.stderr,
        flush=True,
    )
    return json.loads(path.read_text())


def compare(records: dict[int, dict[str, Any]], whole: dict[str, Any], spec: Any, lora: bool) -> dict[str, Any]:
    """The depths' combination against the whole model's measurements, per configuration."""
    from benchtrain.bench.layer_slices import whole_model_record
    from benchtrain.calibration.model import Calibration
    from benchtrain.calibration.step_config import StepConfig
    from benchtrain.train.workload.method import MethodConfig

    method = MethodConfig(method="lora") if lora else MethodConfig()
    combined = whole_model_record(records, spec, method, f"benchmark: {','.join(map(str, sorted(records)))}")
    cal = Calibration(combined)
    time_errors, memory_errors = [], []
    for row in whole["measurements"]:
        if row["status"] != "ok":
            continue
        config = StepConfig.from_row(row)
        predicted = cal.throughput.micro_step_seconds(config) * config.grad_accum
        time_errors.append(100 * (predicted / row["step_seconds"] - 1))
        if cal.memory is not None:
            memory_errors.append(100 * (cal.memory.peak_bytes(config) / row["peak_memory_bytes"] - 1))
    held = combined["slices"]["held_out"]["time"]
    return {
        "configs": len(time_errors),
        "time median %": statistics.median(time_errors),
        "time worst %": max(time_errors, key=abs),
        "memory median %": statistics.median(memory_errors) if memory_errors else None,
        "memory worst %": max(memory_errors, key=abs) if memory_errors else None,
        "held-out %": held.get("median_abs_pct"),
        "plan bound %": 100 * cal.relative_bound,
        "per layer ms": 1000 * combined["slices"]["per_layer"]["seconds"],
    }


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from benchtrain.train.workload.model import resolve_model

    depth_sets = [tuple(sorted(int(d) for d in text.split(","))) for text in args.depth_sets.split(";")]
    depths_needed = sorted({depth for depths in depth_sets for depth in depths})
    rows = []
    with tempfile.TemporaryDirectory(prefix="layer-slices-") as scratch:
        root = Path(scratch)
        for name in args.models.split(","):
            config = model_config(name, args.tiny)
            full = write_model(root / name / "whole", config)
            spec = resolve_model(str(full))
            key = "n_layer" if "n_layer" in config else "num_hidden_layers"
            for method in args.methods.split(","):
                lora = method == "lora"
                home = root / "homes" / f"{name}-{method}"
                whole = bench_in_fresh_process(full, home / "whole", lora, args)
                records = {}
                for depth in depths_needed:
                    folder = write_model(root / name / f"layers-{depth}", {**config, key: depth})
                    records[depth] = bench_in_fresh_process(folder, home / f"layers-{depth}", lora, args)
                for depths in depth_sets:
                    result = compare({depth: records[depth] for depth in depths}, whole, spec, lora)
                    rows.append(
                        {
                            "model": name,
                            "method": method,
                            "depths": ",".join(map(str, depths)),
                            "layers": config[key],
                            **result,
                        }
                    )
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    columns = list(rows[0])
    cells = [
        [
            f"{row[c]:+.1f}"
            if isinstance(row[c], float) and "%" in c and "bound" not in c and "held" not in c
            else f"{row[c]:.1f}"
            if isinstance(row[c], float)
            else str(row[c])
            for c in columns
        ]
        for row in rows
    ]
    widths = [max(len(c), *(len(cell[i]) for cell in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for cell in cells:
        print("  ".join(value.rjust(w) for value, w in zip(cell, widths, strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt2,llama-12l", help="gpt2, llama-12l (comma-separated)")
    parser.add_argument("--methods", default="full,lora")
    parser.add_argument(
        "--depth-sets", default="2,4,6;2,4", help="sets of slice depths, ';'-separated (default: 2,4,6;2,4)"
    )
    parser.add_argument("--batch-sizes", default="2,4")
    parser.add_argument("--seq-lens", default="128,256")
    parser.add_argument("--accum", default="1,2")
    parser.add_argument("--max-probe-seconds", type=float, default=8.0)
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="tiny shapes and a short grid: proves the pipeline (its millisecond steps are noise, not a result)",
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    if args.tiny:
        args.batch_sizes, args.seq_lens, args.max_probe_seconds = "1,2", "32,64", min(args.max_probe_seconds, 0.3)
    rows = run(args)
    print(json.dumps(rows, indent=2) if args.json else "", end="")
    if not args.json:
        print_table(rows)


if __name__ == "__main__":
    main()
