"""What this CPU charges for the operations whose price differs most between CPUs: a matmul in
fp32 and bf16, a quantized layer's forward and backward with bitsandbytes (4-bit NF4 computing in
fp32 and in bf16, 8-bit), and one full garbage collection after the training stack's imports, with
and without `gc.freeze` (common.heap). One thread, as a test worker runs.

    python benchmarks/cpu_costs.py                 # gpt2's c_attn shape: 512 rows × 768 → 2304
    python benchmarks/cpu_costs.py --rows 64 --repeat 20

On a CPU without AVX512-BF16 (an AVX2 EPYC) bf16 matmuls fall back to a slow path: that made 4-bit
bases computing in bf16 take minutes per gpt2 step there (train.workload.quantize now computes in the
base's dtype, fp32 on a CPU). Prints one table; docs/results.md records the results.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def median_seconds(run: Callable[[], object], repeat: int) -> float:
    run()  # the first call pays allocation (and a quantized layer's quantization)
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def matmul_rows(rows: int, inputs: int, outputs: int, repeat: int) -> list[tuple[str, float]]:
    import torch

    results = []
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(rows, inputs, dtype=dtype), torch.randn(inputs, outputs, dtype=dtype)
        results.append(
            (
                f"matmul {rows}×{inputs} @ {inputs}×{outputs}, {str(dtype).removeprefix('torch.')}",
                median_seconds(lambda a=a, b=b: a @ b, repeat),
            )
        )
    return results


def layer_rows(rows: int, inputs: int, outputs: int, repeat: int) -> list[tuple[str, float]]:
    """Forward and backward of one layer: nn.Linear, and bitsandbytes' 4-bit and 8-bit ones."""
    import torch

    layers: list[tuple[str, torch.nn.Module]] = [("nn.Linear fp32", torch.nn.Linear(inputs, outputs))]
    try:
        import bitsandbytes as bnb

        for dtype in (torch.float32, torch.bfloat16):
            name = f"bitsandbytes 4-bit NF4, {str(dtype).removeprefix('torch.')} compute"
            layers.append(
                (
                    name,
                    bnb.nn.Linear4bit(
                        inputs, outputs, compute_dtype=dtype, quant_type="nf4", compress_statistics=True
                    ).to("cpu"),
                )
            )
        layers.append(
            ("bitsandbytes 8-bit (LLM.int8)", bnb.nn.Linear8bitLt(inputs, outputs, has_fp16_weights=False).to("cpu"))
        )
    except ImportError:
        pass
    x = torch.randn(rows, inputs, requires_grad=True)
    return [
        (
            f"{name}: forward + backward, {rows} rows",
            median_seconds(lambda layer=layer: layer(x).sum().backward(), repeat),
        )
        for name, layer in layers
    ]


def collection_rows(repeat: int) -> list[tuple[str, float]]:
    """One full gc.collect() once the training stack is imported, then inside common.heap.frozen_heap."""
    import accelerate  # noqa: F401
    import peft  # noqa: F401
    import transformers  # noqa: F401

    import benchtrain.bench.probe
    import benchtrain.train.recipes.recipe  # noqa: F401
    from benchtrain.common.heap import frozen_heap

    objects = len(gc.get_objects())
    rows = [(f"gc.collect() after the imports ({objects:,} objects)", median_seconds(gc.collect, repeat))]
    with frozen_heap():
        rows.append(("gc.collect() inside common.heap.frozen_heap()", median_seconds(gc.collect, repeat)))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rows", type=int, default=512, help="rows of the input (tokens of a micro-batch; default 512 = 8 × 64)"
    )
    parser.add_argument("--inputs", type=int, default=768)
    parser.add_argument("--outputs", type=int, default=2304)
    parser.add_argument("--repeat", type=int, default=5, help="timed calls of each (the median is shown)")
    args = parser.parse_args(argv)
    import torch

    from benchtrain.train.step.hardware import detect_hardware

    torch.set_num_threads(1)
    shape = (args.rows, args.inputs, args.outputs, args.repeat)
    rows = [*matmul_rows(*shape), *layer_rows(*shape), *collection_rows(args.repeat)]
    print(
        f"{detect_hardware()['name']}, torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, 1 thread"
    )
    width = max(len(name) for name, _ in rows)
    print(f"{'operation':<{width}}  {'seconds':>10}")
    for name, seconds in rows:
        print(f"{name:<{width}}  {seconds:>10.5f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
