"""The fixed cost of a micro-step, and what the host does in it (torch.profiler).

For micro-batch 1 and 2 at one length, THE step (eager, then compiled with --compile on) is
timed (median of --steps) and profiled: host syncs per optimizer step, host time per micro-step,
kernel time, and the busiest host ops. The fixed cost per micro-step is 2·t(1) − t(2).

    python benchmarks/step_overhead.py                                  # tiny on CPU
    python benchmarks/step_overhead.py --model llama-3.2-1b --seq-len 512 --compile off,on
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the step profiler (tests/step_profile.py)


def measure(model: str, compile_mode: str, micro_batch: int, seq_len: int, steps: int) -> dict:
    import torch
    from step_profile import profile_step

    from benchtrain.train.step.engine import StepOptions, engine_from_options
    from benchtrain.train.step.runtime import make_accelerator
    from benchtrain.train.workload.batching import SyntheticBatches
    from benchtrain.train.workload.method import MethodConfig
    from benchtrain.train.workload.model import resolve_model

    torch._dynamo.reset()
    engine = engine_from_options(
        resolve_model(model), MethodConfig(), make_accelerator(), StepOptions(compile=compile_mode)
    )
    batch = SyntheticBatches(1, micro_batch, seq_len, engine.model.config.vocab_size)[0]
    batches = itertools.cycle([batch])
    for _ in range(3):  # warm-up, compilation included
        engine.step.run(batches, 1)
    seconds = statistics.median(engine.step.run(batches, 1).seconds for _ in range(steps))
    profile = profile_step(engine.step, batches, grad_accum=1, optimizer_steps=3)
    return {"seconds": seconds, "profile": profile}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--compile", default="off", help="comma-separated: off,on")
    args = parser.parse_args()

    from step_profile import fixed_micro_step_seconds

    from benchtrain.train.step.hardware import detect_hardware

    print(f"{detect_hardware()['name']}: {args.model}, seq {args.seq_len}, accumulation 1")
    print(
        f"{'compile':<8} {'batch':>5} {'step ms':>8} {'host ms/µstep':>13} {'kernel ms':>9} {'scalar reads/step':>10}  busiest host ops"
    )
    for mode in args.compile.split(","):
        times = {}
        for micro_batch in (1, 2):
            result = measure(args.model, mode, micro_batch, args.seq_len, args.steps)
            p = result["profile"]
            times[micro_batch] = result["seconds"]
            top = ", ".join(f"{name} {seconds / p.micro_steps * 1e3:.1f}" for name, seconds in p.top_host_ops[:3])
            print(
                f"{mode:<8} {micro_batch:>5} {result['seconds'] * 1e3:>8.1f} {p.host_seconds_per_micro_step * 1e3:>13.1f} "
                f"{p.device_seconds / p.micro_steps * 1e3:>9.1f} {p.syncs_per_optimizer_step:>10.1f}  {top}"
            )
        print(
            f"{mode:<8} fixed cost per micro-step 2·t(1) − t(2): {fixed_micro_step_seconds(times[1], times[2]) * 1e3:.1f} ms"
        )


if __name__ == "__main__":
    main()
