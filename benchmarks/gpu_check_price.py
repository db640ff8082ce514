"""What benchmarks/gpu_check.py costs on one H100, priced before renting one (issue 39).

Every figure comes from the real H100 calibration that ships with the package
(calibration/bundled/h100-llama-3.2-1b.json) or from the simulated H100 built on it (tests/simulated.py):

- a step of the peers / loss / compile checks: the calibration's predicted step at that shape (it was
  measured eager: a compiled step is faster, so this is an upper price);
- building the model on the device: the calibration's measured `model_build_seconds`;
- compiling a new shape: tests/simulated.py's COMPILE_SECONDS, the simulated H100's own assumption;
- the `bench run` of the lora-8b check: the simulated H100 running that very command (its virtual
  clock: planner, budget, model build, compilation, probes, fit); the eager bench before `train`: the
  replayed real grid (tests/simulated.py: simulate_bench(replay=True));
- the `train` check: its deadline (`--fit-deadline` fills it; the deadline counts from the command's start);
- each fresh Python process: PROCESS_SECONDS (not in the calibration; the real H100 `train` run of
  2026-11-22 spent 12.4 s from its start to its plan, imports and data included).

And what each fixed-shape check holds in memory: the calibration's predicted peak with its fit's
margin (`peak_memory_bytes_high`), against the device's memory less SPARE.

    python benchmarks/gpu_check.py --price       # this table, on any machine, in seconds
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchtrain.calibration.step_config import StepConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the simulated H100 (tests/simulated.py)

BUNDLED = Path(__file__).resolve().parent.parent / "benchtrain" / "calibration" / "bundled" / "h100-llama-3.2-1b.json"
PROCESS_SECONDS = 15.0  # a fresh interpreter's imports and CUDA context (12.4 s measured before a real H100 plan)
LIMIT_SECONDS = 600.0  # the ten minutes the script promises on one H100
SPARE = 0.10  # each fixed-shape check must fit with this share of the device's memory left over


@dataclass
class PricedCheck:
    name: str
    seconds: float
    parts: dict[str, float] = field(default_factory=dict)
    peak_memory_bytes: float | None = None  # the calibration's upper peak, for checks at a fixed shape


def bundled_calibration() -> Any:
    from benchtrain import calibration

    return calibration.load(BUNDLED)


def step_parts(scale: Any, cal: Any, loops: list[str]) -> dict[str, float]:
    """Each loop of peers.py at the scale's shape: a model build, a compilation where compiled,
    warm-up and timed steps at the calibration's step."""
    from simulated import COMPILE_SECONDS

    build = float(cal.data["overheads"]["model_build_seconds"])
    step = cal.predict(StepConfig(scale.micro_batch, 0, 1, scale.seq_len)).step_seconds
    return {
        loop: build + (COMPILE_SECONDS if "compiled" in loop else 0.0) + (scale.warmup + scale.steps) * step
        for loop in loops
    }


def simulated_bench_seconds(model: str, lora: bool, budget: float, replay: bool) -> float:
    """`bench run --gpu h100 --model MODEL [--lora] --budget …` on the simulated H100: its clock."""
    from simulated import simulate_bench

    _, device = simulate_bench(model, lora, budget, replay=replay)
    return float(device.clock())


def fixed_shape_peak(scale: Any, cal: Any) -> float:
    prediction = cal.predict(StepConfig(scale.micro_batch, 0, 1, scale.seq_len))
    return float(prediction.peak_memory_bytes_high)


def price_checks(scale: Any, names: list[str]) -> list[PricedCheck]:
    """The priced duration of each named check of gpu_check.py at `scale` (its GPU scale), plus the
    script's own start ("start")."""
    from simulated import COMPILE_SECONDS

    from benchtrain.bench.fresh_process import COMPILE_STEPS as STEPS

    cal = bundled_calibration()
    if cal.data["model"]["name"] != scale.model:
        raise ValueError(
            f"the bundled calibration measured {cal.data['model']['name']}, not {scale.model}: it cannot price this scale"
        )
    peak = fixed_shape_peak(scale, cal)
    build = float(cal.data["overheads"]["model_build_seconds"])
    step = cal.predict(StepConfig(scale.micro_batch, 0, 1, scale.seq_len)).step_seconds
    parts: dict[str, Callable[[], dict[str, float]]] = {  # each priced only when asked for: the benches take seconds
        "peers": lambda: step_parts(scale, cal, list(scale.peer_loops)),
        "loss": lambda: step_parts(scale, cal, ["ours-chunked-loss", "ours-plain-loss", "ours-liger-loss"]),
        "lora-8b": lambda: {
            "process": PROCESS_SECONDS,
            "bench (simulated H100)": simulated_bench_seconds(scale.lora_model, True, scale.lora_budget, False),
        },
        "train": lambda: {
            "bench process": PROCESS_SECONDS,
            "bench (replayed H100 grid)": simulated_bench_seconds(scale.model, False, scale.bench_budget, True),
            "train process": PROCESS_SECONDS,
            "train deadline": scale.train_deadline,
        },
        "compile": lambda: {
            "process": PROCESS_SECONDS,
            "model build": build,
            "compilation": COMPILE_SECONDS,
            "steps": STEPS * step,
        },
        "memory": lambda: {},
    }
    fixed = {"peers", "loss", "compile"}
    priced = [PricedCheck("start", PROCESS_SECONDS, {"imports and CUDA context": PROCESS_SECONDS})]
    for name in names:
        seconds = parts[name]()
        priced.append(PricedCheck(name, sum(seconds.values()), seconds, peak if name in fixed else None))
    return priced


def memory_bytes() -> float:
    return float(bundled_calibration().data["hardware"]["memory_bytes"])


def price_table(priced: list[PricedCheck]) -> list[str]:
    """Lines to print: each check's priced seconds and parts, the total against the ten minutes."""
    from benchtrain.common.durations import format_duration

    device = memory_bytes()
    lines = ["priced on the simulated H100 (calibration/bundled/h100-llama-3.2-1b.json):"]
    for check in priced:
        shown = ", ".join(f"{part} {format_duration(seconds)}" for part, seconds in check.parts.items())
        memory = (
            f"; peak ≤ {check.peak_memory_bytes / 2**30:.1f} of {device / 2**30:.1f} GiB"
            if check.peak_memory_bytes
            else ""
        )
        lines.append(f"  {check.name:<8} {format_duration(check.seconds):>8}  {shown}{memory}")
    total = sum(check.seconds for check in priced)
    lines.append(f"  total    {format_duration(total):>8}  (limit {format_duration(LIMIT_SECONDS)})")
    return lines
