"""Does `train` peak where its plan says? Predicted vs actual peak memory, several configurations.

Each row is one `train --max-steps N` in its own process with the calibration it names (run
`bench run --model M` and `bench run --model M --lora` first): the plan's predicted peak
(run.json `estimate.peak_memory_bytes`) against the run's measured peak (`actual.peak_memory_bytes`:
the CUDA allocator's peak on a GPU, the peak RSS on CPU; train.step.peak_memory).

    python benchmarks/memory_plan.py --model gpt2 --data chats.jsonl \\
        --full-calibration ID --lora-calibration ID --configs 4x128,8x256,16x256
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

GIB = 2**30


def run_train(arguments: list[str], out: Path) -> dict | None:
    result = subprocess.run(
        ["train", "--no-report", "--out", str(out), *arguments],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    if result.returncode != 0:
        print(
            f"train exited {result.returncode}: {result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ''}"
        )
        return None
    return json.loads((out / "run.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--data", required=True)
    parser.add_argument("--full-calibration", help="calibration id of full fine-tuning (none: skip)")
    parser.add_argument("--lora-calibration", help="calibration id of LoRA (none: skip)")
    parser.add_argument("--configs", default="4x128,8x256,16x256", help="EFFECTIVE_BATCHxMAX_LENGTH, comma-separated")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--train-args", default="", help="more train options for every run")
    args = parser.parse_args()
    methods = [
        (name, calibration)
        for name, calibration in (("full", args.full_calibration), ("lora", args.lora_calibration))
        if calibration
    ]
    print(f"{'method':<6} {'configuration':<36} {'predicted':>10} {'actual':>10} {'error':>7}")
    with tempfile.TemporaryDirectory() as scratch:
        for method, calibration in methods:
            for index, config in enumerate(args.configs.split(",")):
                effective, length = config.split("x")
                arguments = [
                    "--model",
                    args.model,
                    "--data",
                    args.data,
                    "--use-calibration",
                    calibration,
                    "--deadline",
                    "2h",
                ]
                arguments += [
                    "--effective-batch",
                    effective,
                    "--max-length",
                    length,
                    "--max-steps",
                    str(args.steps),
                    *args.train_args.split(),
                ]
                if method == "lora":
                    arguments.append("--lora")
                record = run_train(arguments, Path(scratch) / f"{method}-{index}")
                if record is None:
                    continue
                plan, predicted, actual = (
                    record["plan"],
                    record["estimate"]["peak_memory_bytes"],
                    record["actual"]["peak_memory_bytes"],
                )
                label = f"batch {plan['micro_batch_size']} × accum {plan['grad_accum']}, length {plan['max_length']}"
                print(
                    f"{method:<6} {label:<36} {predicted / GIB:>8.2f} G {actual / GIB:>8.2f} G {(actual - predicted) / predicted:>+7.1%}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
