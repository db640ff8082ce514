"""What a quantized base and an 8-bit optimizer cost and save: each setup's weights and optimizer
state predicted (train.planning.memory_check, on `meta`) against what train builds, and the step
time and peak memory bench measures for each, from one `bench run --quantize LIST --optimizer LIST`.

    python benchmarks/quantize.py --model gpt2 --quantize none,8bit,4bit --budget 6m
    python benchmarks/quantize.py --model gpt2 --quantize none --optimizer adamw,adamw-8bit --budget 4m

The measured columns are the calibration's probe at --batch × --length (the same probe for every
setup); `fit` is its fitted model's prediction there.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the loaded model's bytes (tests/helpers.py)

GIB = 2**30


def built_bytes(model: str, quantize: str, optimizer: str) -> tuple[int, int, int, int]:
    """(predicted weights, built weights, predicted optimizer state, real optimizer state) bytes."""
    import torch
    from helpers import loaded_bytes

    from benchtrain.train.planning.memory_check import memory_need
    from benchtrain.train.step.hyperparameters import make_optimizer
    from benchtrain.train.workload.method import MethodConfig
    from benchtrain.train.workload.model import build_model, resolve_model

    spec, method = resolve_model(model), MethodConfig(method="lora", quantize=quantize, optimizer=optimizer)
    need = memory_need(spec, method, "cpu")
    built = build_model(spec, "cpu", method)
    optimizer_object = make_optimizer(built, 1e-4, optimizer)
    for parameter in built.parameters():
        if parameter.requires_grad:
            parameter.grad = torch.zeros_like(parameter)
    optimizer_object.step()
    tensors = [
        value
        for state in optimizer_object.state.values()
        for value in state.values()
        if torch.is_tensor(value) and value.dim()
    ]
    state = {tensor.data_ptr(): tensor.numel() * tensor.element_size() for tensor in tensors}  # shared maps once
    return need.weights_bytes, loaded_bytes(built), need.optimizer_bytes, sum(state.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--quantize", default="none,8bit,4bit")
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--budget", default="6m")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as home:
        env = {**os.environ, "BENCHTRAIN_HOME": home}
        grid = [
            "--batch-sizes",
            f"1,{args.batch}",
            "--seq-lens",
            f"64,{args.length}",
            "--workers",
            "0",
            "--accum",
            "1,2",
        ]
        command = [
            "bench",
            "run",
            "--gpu",
            "cpu",
            "--model",
            args.model,
            "--lora",
            "--quantize",
            args.quantize,
            "--optimizer",
            args.optimizer,
            *grid,
        ]
        subprocess.run(
            [*command, "--budget", args.budget, "--quiet", "--no-report"],
            check=True,
            stdout=subprocess.DEVNULL,
            env=env,
        )
        (path,) = Path(home, "calibrations").glob("*.json")
        os.environ["BENCHTRAIN_HOME"] = home
        from benchtrain.calibration.model import Calibration
        from benchtrain.calibration.schema import read_calibration_file
        from benchtrain.calibration.step_config import StepConfig

        calibration = Calibration(read_calibration_file(path), path)
        config = StepConfig(args.batch, 0, 1, args.length)
        print(
            f"{args.model} LoRA r16 on this CPU, probe B{args.batch}/S{args.length} ({' '.join(command)} --budget {args.budget})\n"
        )
        columns = (
            ("setup", 22),
            ("weights pred", 12),
            ("weights built", 13),
            ("optim pred", 10),
            ("optim real", 10),
            ("step s", 8),
            ("fit s", 8),
        )
        header = (
            " ".join(f"{name:<{width}}" if name == "setup" else f"{name:>{width}}" for name, width in columns)
            + f" {'peak GiB':>9} {'fit GiB':>8}"
        )
        print(header)
        print("-" * len(header))
        for variant in calibration.variants():
            quantize, optimizer = variant.variant
            weights_predicted, weights_built, state_predicted, state_real = built_bytes(args.model, quantize, optimizer)
            row = next((r for r in variant.ok_rows() if StepConfig.from_row(r) == config), None)
            fit = variant.predict(config)
            measured_step = f"{row['step_seconds']:.3f}" if row else "–"
            measured_peak = f"{row['peak_memory_bytes'] / GIB:.3f}" if row else "–"
            print(
                f"{quantize + ' / ' + optimizer:<22} {weights_predicted / GIB:>12.4f} {weights_built / GIB:>13.4f} "
                f"{state_predicted / 2**20:>9.2f}M {state_real / 2**20:>9.2f}M "
                f"{measured_step:>8} {fit.step_seconds:>8.3f} {measured_peak:>9} {(fit.peak_memory_bytes or 0) / GIB:>8.3f}"
            )
        print(f"\ncalibration: {json.loads(path.read_text())['id']}")


if __name__ == "__main__":
    main()
