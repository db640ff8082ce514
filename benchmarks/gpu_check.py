"""Every GPU claim of docs/results.md ("Not measured on a GPU yet") in one command, within ten minutes on one H100:

    python benchmarks/gpu_check.py --out gpu-check/            # one H100 (or any CUDA GPU), priced ≈ 9.6 min (not yet run on one)
    python benchmarks/gpu_check.py --price                     # that price, check by check, on any machine (seconds)
    python benchmarks/gpu_check.py --smoke --out /tmp/smoke    # the same code paths on CPU, tiny shapes, ≈ 1.5 min

Needs (checked before anything runs; one line and exit 2 naming what is missing): this checkout's
own dependencies (`pip install -e .`: torch, transformers, accelerate, peft, datasets, numpy, scipy)
and on a GPU liger-kernel for the loss check's Liger row (`pip install -e '.[gpu]'`). See REQUIRES.

Each check is one function that runs the project's own commands or the functions the other
benchmarks/ scripts run (peers.py's loops, bench_budget.py's `bench run` process, `train`):

- peers: MFU of THE step (compiled) on llama-3.2-1b, full fine-tuning, micro-batch 8 × 1024, and
  its ratio to HF Trainer and to a plain `torch.compile`d loop (peers.py: median step of each);
- loss: THE step with the chunked, the plain and Liger's loss, tokens/s and peak;
- lora-8b: `bench run --gpu h100 --model llama-3.1-8b --lora --budget 2m` (compiled) in its own
  process: probes, held-out error, wall time against the budget (docs/usage.md's 8B command asks
  5m: the ten minutes hold 2m beside the rest; `--lora-budget 5m` for that figure);
- train: `bench run --model llama-3.2-1b --compile off --budget 45s`, then `train --deadline 2m30s
  --fit-deadline` on the bundled sample from that calibration: the estimate error (like for like,
  calibration.accuracy.check_estimate) and the deadline;
- compile: a fresh process (bench.fresh_process, as `train` starts) compiling THE step at the peers'
  shape with an empty inductor cache: the seconds a new shape costs, beside what the lora-8b bench
  measured per shape of the 8B step (and from inductor's cache), against the 40 s the simulated
  H100 assumes;
- memory: the train run's predicted peak (its plan) against the measured one (run.json).

The H100 sizes are priced, not guessed (benchmarks/gpu_check_price.py, held by tests/test_gpu_check.py):
the bundled H100 calibration predicts each fixed-shape check's peak with 10% of the card to spare
(8 × 2048 would need ≈ 82 GiB of its 79 GiB: micro-batch 8 × 1024 is the shape the real H100 ran
all four peers at), and the simulated H100 prices the whole script under ten minutes.

It writes `gpu_check.json` (every figure) and `gpu_check.md` (one row per check, ready for
docs/results.md) into --out. Without CUDA it refuses (exit 2) unless --smoke, which runs the
same functions on CPU with the `tiny` preset, small grids, one thread (MFU against a timed matmul,
since a CPU has no datasheet peak; uncompiled peers and benches: bench prices an unmeasured
compilation at 30 s, more than a smoke budget). The smoke's budgets are sized by what this machine
measures, not fixed: a bench that bench itself finds too small is re-run once at the budget it asks
for, and the train deadline is set from a timed dry run of the same `train` command.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_budget  # benchmarks/: bench run in its own process
import peers  # benchmarks/: HF Trainer, plain and our loops, measured alike

from benchtrain.common.durations import format_duration, parse_duration

GIB = 2**30

# What the checks import, checked before any runs (missing_install): module -> (distribution, why, the pip command).
REQUIRES: dict[str, tuple[str, str, str]] = {
    "torch": ("torch", "every check", "pip install -e ."),
    "transformers": ("transformers", "every check", "pip install -e ."),
    "accelerate": ("accelerate", "THE step and HF Trainer", "pip install -e ."),
    "peft": ("peft", "the lora-8b bench", "pip install -e ."),
    "datasets": ("datasets", "the train check's data", "pip install -e ."),
    "numpy": ("numpy", "the calibration fit", "pip install -e ."),
    "scipy": ("scipy", "the calibration fit", "pip install -e ."),
}
REQUIRES_ON_GPU: dict[str, tuple[str, str, str]] = {
    "liger_kernel": ("liger-kernel", "the loss check's Liger row", "pip install -e '.[gpu]'"),
}


def missing_install(needed: dict[str, tuple[str, str, str]]) -> str | None:
    """One line naming the first package of `needed` that cannot be imported, with its pip command."""
    from importlib.util import find_spec

    for module, (distribution, why, command) in needed.items():
        if find_spec(module) is None:
            return f"gpu_check needs {distribution} ({why}), which is not installed: {command}"
    return None


@dataclass(frozen=True)
class Scale:
    """What the checks run at: one H100's sizes (those of the claims), or --smoke's."""

    device: str  # bench's --gpu
    model: str  # peers, loss, train
    lora_model: str
    micro_batch: int
    seq_len: int
    steps: int  # timed steps per loop
    warmup: int
    peer_loops: tuple[str, str, str]  # HF Trainer, the plain loop, ours
    lora_budget: float
    bench_budget: float
    train_deadline: float
    lora_extra: tuple[str, ...] = ()
    bench_extra: tuple[str, ...] = ()
    train_extra: tuple[str, ...] = ()
    # --smoke: budgets and the deadline follow what this machine measures (a slow CPU gets more).
    sized_by_machine: bool = False


GPU = Scale(
    device="h100",
    model="llama-3.2-1b",
    lora_model="llama-3.1-8b",
    # 8 × 2048 needs ≈ 82 GiB by the bundled H100 calibration (79 GiB card); 8 × 1024 ≈ 50 GiB (56 with
    # the fit's margin), the shape the real H100 ran all four peers at (tests/test_gpu_check.py holds 10% spare).
    micro_batch=8,
    seq_len=1024,
    steps=6,
    warmup=2,
    peer_loops=("hf-trainer", "plain-compiled", "ours-compiled"),
    lora_budget=120.0,
    bench_budget=45.0,  # the replayed H100 grid: 22 eager probes
    train_deadline=150.0,  # what is left of the ten minutes (benchmarks/gpu_check_price.py)
    lora_extra=(),  # the usage page's 8B command: compiled (--compile auto on CUDA)
    bench_extra=("--compile", "off"),
    train_extra=("--compile", "off"),
)
SMALL_GRID = ("--batch-sizes", "1,2", "--workers", "0", "--seq-lens", "32,64", "--max-probe-seconds", "0.2")
SMOKE = Scale(
    device="cpu",
    model="tiny",
    lora_model="tiny",
    micro_batch=2,
    seq_len=64,
    steps=2,
    warmup=1,
    peer_loops=("hf-trainer", "plain", "ours-eager"),
    lora_budget=15.0,
    bench_budget=15.0,
    train_deadline=20.0,
    lora_extra=(*SMALL_GRID, "--accum", "1,2", "--compile", "off"),
    bench_extra=(*SMALL_GRID, "--accum", "1,2", "--compile", "off"),
    train_extra=("--compile", "off", "--max-length", "64", "--workers", "0"),
    sized_by_machine=True,
)


@dataclass
class Check:
    """One claim and what this machine measured for it. `value`: the headline number (None: not measured)."""

    name: str
    claim: str
    value: float | None = None
    unit: str = ""
    measured: dict[str, Any] = field(default_factory=dict)
    command: str = ""
    seconds: float = 0.0
    note: str = ""


@dataclass
class Context:
    scale: Scale
    work: Path  # each command's BENCHTRAIN_HOME lies below
    found: dict[str, Any] = field(default_factory=dict)  # what a check leaves for another (calibrations, run.json)


# -- peers and the loss (in this process, peers.py's loops) -----------------------------------------
def peak_flops() -> tuple[float, str]:
    """The device's dense bf16 peak from the table (train.step.hardware), else (CPU) a timed matmul."""
    from benchtrain.bench.cost import matmul_flops
    from benchtrain.train.step.hardware import detect_hardware

    hardware = detect_hardware()
    if hardware.get("peak_bf16_flops"):
        return float(
            hardware["peak_bf16_flops"]
        ), f"{hardware['name']}: datasheet bf16 peak ({hardware.get('peak_flops_entry')})"
    return matmul_flops(hardware["device_type"]), f"{hardware['name']}: a timed fp32 matmul (no datasheet peak)"


def loop_figures(result: Any) -> dict[str, Any]:
    return {
        "tokens_per_second": result.tokens_per_second,
        "mfu": result.mfu,
        "peak_memory_gib": result.peak_memory_bytes / GIB if result.peak_memory_bytes else None,
        "note": result.note,
    }


def flops_per_token(model: str, seq_len: int) -> float:
    """The step's FLOPs per token (full fine-tuning) from the model built on `meta`: peers.flops_per_token
    builds it for real on the device, a dozen seconds of an H100 the ten minutes cannot spare."""
    from benchtrain.train.planning.memory_check import meta_model
    from benchtrain.train.workload.method import MethodConfig
    from benchtrain.train.workload.model import model_shape, resolve_model

    return model_shape(meta_model(resolve_model(model), MethodConfig())).flops_per_token(seq_len)


def measure_loops(ctx: Context, loops: list[str]) -> tuple[dict[str, Any], str]:
    """peers.measure for each loop at this scale (full fine-tuning); the results and the peak's source."""
    s = ctx.scale
    setup = peers.Setup(s.model, False, 16, False, s.micro_batch, s.seq_len, s.steps, s.warmup)
    if "flops" not in ctx.found:
        ctx.found["flops"], ctx.found["peak"] = flops_per_token(s.model, s.seq_len), peak_flops()
    flops, (peak, source) = ctx.found["flops"], ctx.found["peak"]
    results = [peers.measure(loop, setup, flops, peak) for loop in loops]
    print("\n".join(peers.table(results)), flush=True)
    return {result.loop: result for result in results}, source


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def check_peers(ctx: Context) -> Check:
    s = ctx.scale
    hf, plain, ours = s.peer_loops
    results, source = measure_loops(ctx, list(s.peer_loops))
    rate = {loop: results[loop].tokens_per_second for loop in s.peer_loops}
    return Check(
        name="peers",
        claim=f"THE step on {s.model} at {s.micro_batch} × {s.seq_len}: ≥ 45% MFU, ≥ 1.3× HF Trainer (issue 12)",
        value=results[ours].mfu * 100 if results[ours].mfu is not None else None,
        unit="% MFU",
        measured={
            "loops": {loop: loop_figures(result) for loop, result in results.items()},
            "ratio_to_hf_trainer": ratio(rate[ours], rate[hf]),
            f"ratio_to_{plain}": ratio(rate[ours], rate[plain]),
            "peak_flops_source": source,
        },
        command=f"python benchmarks/peers.py --model {s.model} --micro-batch {s.micro_batch} --seq-len {s.seq_len} "
        f"--steps {s.steps} --warmup {s.warmup} --loops {','.join(s.peer_loops)}",
    )


def check_loss(ctx: Context) -> Check:
    from benchtrain.train.step.loss import liger_problem

    s = ctx.scale
    problem = liger_problem()
    loops = ["ours-chunked-loss", "ours-plain-loss", *([] if problem else ["ours-liger-loss"])]
    results, _ = measure_loops(ctx, loops)
    figures = {
        loop.removeprefix("ours-").removesuffix("-loss"): loop_figures(result) for loop, result in results.items()
    }
    if problem:
        figures["liger"] = {"note": f"not run: {problem}"}
    chunked, plain = results["ours-chunked-loss"], results["ours-plain-loss"]
    return Check(
        name="loss",
        claim="the chunked loss is no slower than the plain one (1.10× LoRA, 1.20× full on cpu-vm) and bounds the logits' memory; "
        "Liger where installed (issue 24)",
        value=ratio(chunked.tokens_per_second, plain.tokens_per_second),
        unit="× plain (tokens/s)",
        measured={
            "losses": figures,
            "peak_memory_ratio_chunked_to_plain": ratio(chunked.peak_memory_bytes, plain.peak_memory_bytes),
            "liger_to_plain": ratio(results["ours-liger-loss"].tokens_per_second, plain.tokens_per_second)
            if not problem
            else None,
        },
        command=f"python benchmarks/peers.py --model {s.model} --micro-batch {s.micro_batch} --seq-len {s.seq_len} --loops {','.join(loops)}",
    )


# -- bench and train (the commands, each in its own process) ----------------------------------------
def held_out(record: dict[str, Any], which: str = "time") -> dict[str, Any]:
    fit = record.get("fit") or {}
    error = fit.get("held_out_error") if which == "time" else (fit.get("memory") or {}).get("held_out_error")
    return error or {}


def budget_asked(row: dict[str, Any]) -> float | None:
    """The budget a failed `bench run` asked for in its last line ("… use --budget 10.0s …"), in seconds."""
    import re

    found = re.search(r"use --budget ((?:\d+h)?(?:\d+m)?(?:\d+(?:\.\d+)?s)?)", str(row.get("result", "")))
    if not found or not found.group(1):
        return None
    try:
        return parse_duration(found.group(1), "--budget")
    except Exception:  # a message in another form: no retry
        return None


def sized_bench(
    ctx: Context, model: str, lora: bool, budget: float, extra: tuple[str, ...], home: Path
) -> tuple[dict[str, Any], Path | None, float, float]:
    """bench_budget.real_bench; at a scale sized by the machine, a bench that stored no calibration (a
    slow or busy CPU: "0 of 0 probes", "cannot pay for even a minimum calibration") runs once more, at
    the larger of what it asked for (×1.5), twice its budget, and its budget plus twice what the failed
    run took (this machine's start-up and first probes, measured).
    The row, the calibration stored, the budget of the last run and its wall seconds."""
    started = time.monotonic()
    row, path = bench_budget.real_bench(model, lora, None, budget, ctx.scale.device, extra, home)
    took = time.monotonic() - started
    if path is None and ctx.scale.sized_by_machine:  # its line is cut at 120 characters: any refusal counts
        asked = budget_asked(row)
        budget = max(1.5 * asked if asked else 0.0, 2 * budget, budget + 2 * took)
        print(
            f"   bench found its budget too small here ({took:.0f}s to refuse): again at {format_duration(budget)}",
            file=sys.stderr,
            flush=True,
        )
        started = time.monotonic()
        row, path = bench_budget.real_bench(model, lora, None, budget, ctx.scale.device, extra, home)
        took = time.monotonic() - started
        row["first_budget_too_small"] = True
    return row, path, budget, took


def check_lora_bench(ctx: Context) -> Check:
    s = ctx.scale
    extra = ("--no-report", *s.lora_extra)
    row, path, budget, took = sized_bench(ctx, s.lora_model, True, s.lora_budget, extra, ctx.work / "lora")
    record = json.loads(path.read_text()) if path else None
    ctx.found["lora_calibration"] = record
    check = Check(
        name="lora-8b",
        claim=f"`bench run --gpu {s.device} --model {s.lora_model} --lora --budget 5m` fits in its budget "
        "(simulated: 11 probes, 0.29% held out at 5m; 4 at 2m) (issue 21)",
        unit="% held-out median",
        command=f"bench run --gpu {s.device} --model {s.lora_model} --lora --budget {format_duration(budget)} {' '.join(extra)}",
        measured={**row, "wall_seconds": took, "budget_seconds": budget},
    )
    if record is None:
        check.note = f"no calibration: {row.get('result', '')}"
        return check
    error = held_out(record)
    check.value = error.get("median_abs_pct")
    check.measured["past_budget_seconds"] = max(0.0, took - budget)  # the row has the probes and held-out errors
    return check


DRY_RUN_SHARE = 0.4  # --smoke: a dry run (imports, data, plan) may take this share of the deadline at most


def train_command(ctx: Context, calibration: Path, home: Path, deadline: float) -> list[str]:
    s = ctx.scale
    command = [
        sys.executable,
        "-m",
        "benchtrain.train",
        "--use-calibration",
        str(calibration),
        "--model",
        s.model,
        "--data",
        "sample",
    ]
    return [
        *command,
        "--deadline",
        f"{deadline:.0f}s",
        "--fit-deadline",
        "--epochs",
        "50",
        "--no-report",
        "--out",
        str(home / "run"),
        *s.train_extra,
    ]


def sized_deadline(ctx: Context, calibration: Path, home: Path) -> float:
    """The train check's deadline. At a scale sized by the machine: at least 1/DRY_RUN_SHARE of a timed
    dry run of the same command (what this machine spends before a step: imports, data, the plan), so
    that a slow CPU gets the room a fixed 20 s would deny it."""
    deadline = ctx.scale.train_deadline
    if not ctx.scale.sized_by_machine:
        return deadline
    ctx.found["dry_run_seconds"] = seconds = dry_run_seconds(ctx, calibration, home, deadline)
    return max(deadline, seconds / DRY_RUN_SHARE)


def dry_run_seconds(ctx: Context, calibration: Path, home: Path, deadline: float) -> float:
    started = time.monotonic()
    subprocess.run(
        [*train_command(ctx, calibration, home, deadline), "--dry-run"],
        env={**os.environ, "BENCHTRAIN_HOME": str(home)},
        capture_output=True,
    )
    return time.monotonic() - started


def run_train(ctx: Context, calibration: Path, home: Path, deadline: float) -> tuple[int, dict[str, Any] | None, str]:
    """`train` on the bundled sample from `calibration`, filling the deadline (--fit-deadline)."""
    out = home / "run"
    command = train_command(ctx, calibration, home, deadline)
    done = subprocess.run(command, env={**os.environ, "BENCHTRAIN_HOME": str(home)}, capture_output=True, text=True)
    record = json.loads((out / "run.json").read_text()) if (out / "run.json").is_file() else None
    return done.returncode, record, (done.stderr.strip().splitlines() or [""])[-1][:160]


def check_train(ctx: Context) -> Check:
    from benchtrain.calibration.accuracy import check_estimate

    s = ctx.scale
    home = ctx.work / "train"
    row, path, budget, _ = sized_bench(ctx, s.model, False, s.bench_budget, ("--no-report", *s.bench_extra), home)
    deadline = sized_deadline(ctx, path, home) if path is not None else s.train_deadline
    check = Check(
        name="train",
        claim=f"a {format_duration(deadline)} `train` finishes within 5% of its estimate (issue 12: a 5-minute run) and meets its deadline",
        unit="% estimate error",
        command=f"bench run --gpu {s.device} --model {s.model} --budget {format_duration(budget)} {' '.join(s.bench_extra)} && "
        f"train --use-calibration latest --model {s.model} --data sample --deadline {format_duration(deadline)} "
        f"--fit-deadline --epochs 50 {' '.join(s.train_extra)}",
        measured={"bench": row, "deadline_seconds": deadline, "dry_run_seconds": ctx.found.get("dry_run_seconds")},
    )
    if path is None:
        check.note = f"bench stored no calibration: {row.get('result', '')}"
        return check
    ctx.found["train_calibration"] = json.loads(path.read_text())
    code, record, last_line = run_train(ctx, path, home, deadline)
    ctx.found["train_record"] = record
    estimate = check_estimate(record) if record else None
    if record is None or estimate is None:
        check.note = f"train exited {code}: {last_line}"
        return check
    check.value = estimate.error_pct
    check.measured.update(
        exit=code,
        estimated_seconds=estimate.estimated_seconds,
        actual_seconds=estimate.actual_seconds,
        steps=f"{estimate.steps_run}/{estimate.planned_steps}",
        tokens_per_second_predicted=estimate.predicted_tokens_per_second,
        tokens_per_second_actual=estimate.actual_tokens_per_second,
        met_deadline=record["met_deadline"],
        command_seconds=record["actual"].get("command_seconds"),
        mfu=record["actual"].get("mfu"),
    )
    return check


# -- what those commands measured on the way -----------------------------------------------------------
def compile_in_new_process(ctx: Context) -> dict[str, float] | None:
    """bench.fresh_process in a fresh process with an empty inductor cache: THE step compiled at
    this scale's shape (full fine-tuning), as a `train` process meets a shape nothing compiled yet."""
    from benchtrain.bench.fresh_process import measure_in_new_process
    from benchtrain.train.workload.method import MethodConfig
    from benchtrain.train.workload.model import resolve_model

    s = ctx.scale
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-", dir=ctx.work)
    try:
        return measure_in_new_process(
            resolve_model(s.model),
            MethodConfig(),
            "auto",
            {"micro_batch_size": s.micro_batch, "seq_len": s.seq_len},
            600.0,
        )
    finally:
        if before is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR")
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


def check_compile(ctx: Context) -> Check:
    s = ctx.scale
    measured = compile_in_new_process(ctx)
    overheads = (ctx.found.get("lora_calibration") or {}).get("overheads") or {}
    check = Check(
        name="compile",
        claim="a new shape's compilation: the simulated H100 assumes 40 s for an 8B step (issue 21); train plans one per shape (issue 12)",
        unit="s per shape",
        measured={
            "first_step_seconds": (measured or {}).get("first_step_seconds"),
            "step_seconds": (measured or {}).get("step_seconds"),
            "process_seconds": (measured or {}).get("process_seconds"),
            # What the lora-8b bench measured on the way (compiled where the step compiles: CUDA).
            "lora_bench_compile_seconds_per_shape": overheads.get("compile_seconds_per_shape"),
            "lora_bench_compile_cached_seconds_per_shape": overheads.get("compile_cached_seconds_per_shape"),
        },
        command=f"TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python -m benchtrain.bench.fresh_process "
        f'\'{{"task": "compile", "model": "{s.model}", "micro_batch_size": {s.micro_batch}, "seq_len": {s.seq_len}, …}}\'',
    )
    if measured is None:
        check.note = "the compile probe process failed"
    else:
        check.value = max(0.0, measured["first_step_seconds"] - measured["step_seconds"])
    return check


def check_memory(ctx: Context) -> Check:
    record = ctx.found.get("train_record") or {}
    calibration = ctx.found.get("train_calibration") or {}
    predicted = (record.get("estimate") or {}).get("peak_memory_bytes")
    actual = (record.get("actual") or {}).get("peak_memory_bytes")
    check = Check(
        name="memory",
        claim="a plan's peak memory holds: ≤ 3% median held out, no under-prediction past 2% (issue 21, on the replayed H100 grid)",
        value=(actual - predicted) / predicted * 100 if predicted and actual else None,
        unit="% actual vs predicted peak",
        measured={
            "predicted_gib": predicted / GIB if predicted else None,
            "actual_gib": actual / GIB if actual else None,
            "calibration_memory_held_out_median_pct": held_out(calibration, "memory").get("median_abs_pct"),
            "lora_calibration_memory_held_out_median_pct": held_out(
                ctx.found.get("lora_calibration") or {}, "memory"
            ).get("median_abs_pct"),
        },
        command="the train check's run.json: estimate.peak_memory_bytes against actual.peak_memory_bytes",
    )
    if check.value is None:
        check.note = "the train check left no run with both peaks"
    return check


CHECKS: dict[str, Callable[[Context], Check]] = {
    "peers": check_peers,
    "loss": check_loss,
    "lora-8b": check_lora_bench,
    "train": check_train,
    "compile": check_compile,  # after lora-8b: shows what its calibration measured beside its own
    "memory": check_memory,  # after train: reads its run.json
}


def run_check(name: str, ctx: Context) -> Check:
    print(f"== {name}", file=sys.stderr, flush=True)
    started = time.monotonic()
    try:
        check = CHECKS[name](ctx)
    except Exception as error:  # one check failing (OOM, a missing kernel) still writes the others
        check = Check(
            name=name,
            claim="",
            note=f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}",
        )
    check.seconds = time.monotonic() - started
    print(
        f"   {name}: {check.value if check.value is not None else '-'} {check.unit} in {check.seconds:.0f}s {check.note}",
        file=sys.stderr,
        flush=True,
    )
    return check


# -- the two files -------------------------------------------------------------------------------------
SIGNED = ("train", "memory")  # errors: + took longer / peaked higher than estimated


def headline(check: Check) -> str:
    if check.value is None:
        return f"not measured ({check.note})" if check.note else "not measured"
    if check.unit.startswith("%"):
        return f"**{check.value:{'+' if check.name in SIGNED else ''}.1f}{check.unit}**"
    return f"**{check.value:.3g} {check.unit}**"


def details(check: Check) -> str:
    """The check's other figures in one cell: numbers, words, and each loop's tokens/s and peak."""
    shown = []
    for key, value in check.measured.items():
        if isinstance(value, dict):
            shown += [
                f"{name} {figures['tokens_per_second']:,.0f} tok/s, {figures['peak_memory_gib']:.2f} GiB"
                for name, figures in value.items()
                if isinstance(figures, dict) and figures.get("tokens_per_second") and figures.get("peak_memory_gib")
            ]
            shown += [
                f"{name}: {figures['note']}"
                for name, figures in value.items()
                if isinstance(figures, dict) and figures.get("note")
            ]
        elif isinstance(value, float):
            shown.append(f"{key.replace('_', ' ')} {value:.3g}")
        elif isinstance(value, (int, str, bool)) and value is not None and key not in ("budget", "took"):
            shown.append(f"{key.replace('_', ' ')} {value}")
    return "; ".join(shown).replace("|", "/")


def markdown(checks: list[Check], device: str, smoke: bool, seconds: float) -> str:
    lines = [
        f"`python benchmarks/gpu_check.py{' --smoke' if smoke else ''}` on {device}, "
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {format_duration(seconds)} in all",
        "",
        "| check | claim | measured | details | took |",
        "|---|---|---|---|---|",
    ]
    for check in checks:
        lines.append(
            f"| {check.name} | {check.claim} | {headline(check)} | {details(check)} | {format_duration(check.seconds)} |"
        )
    return "\n".join(lines) + "\n"


def write_results(out: Path, checks: list[Check], scale: Scale, smoke: bool, seconds: float) -> None:
    from benchtrain.train.step.hardware import detect_hardware

    device = detect_hardware()["name"]
    out.mkdir(parents=True, exist_ok=True)
    document = {
        "device": device,
        "smoke": smoke,
        "seconds": seconds,
        "scale": asdict(scale),
        "checks": [asdict(check) for check in checks],
    }
    (out / "gpu_check.json").write_text(json.dumps(document, indent=2, default=str) + "\n", encoding="utf-8")
    (out / "gpu_check.md").write_text(markdown(checks, device, smoke, seconds), encoding="utf-8")


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out", default="gpu-check", help="folder for gpu_check.json and gpu_check.md (default: ./gpu-check)"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="the same code paths on CPU: tiny model, small grids, budgets of seconds"
    )
    parser.add_argument(
        "--checks", default=",".join(CHECKS), help=f"comma-separated, in order (default: {','.join(CHECKS)})"
    )
    parser.add_argument("--lora-budget", help="bench budget of the lora-8b check (default: 2m; 15s with --smoke)")
    parser.add_argument("--bench-budget", help="bench budget before the train check (default: 45s; 15s with --smoke)")
    parser.add_argument("--train-deadline", help="the train check's deadline (default: 2m30s; 20s with --smoke)")
    parser.add_argument("--steps", type=int, help="timed steps per loop of peers and loss (default: 6; 2 with --smoke)")
    parser.add_argument(
        "--price",
        action="store_true",
        help="print what the checks cost on one H100 (the simulated H100 of the bundled calibration) and stop",
    )
    return parser.parse_args(argv)


def scale_from(args: argparse.Namespace) -> Scale:
    scale = SMOKE if args.smoke else GPU
    changes: dict[str, Any] = {}
    for name in ("lora_budget", "bench_budget", "train_deadline"):
        if getattr(args, name):
            changes[name] = parse_duration(getattr(args, name), f"--{name.replace('_', '-')}")
    if args.steps:
        changes["steps"] = args.steps
    return replace(scale, **changes)


def cuda_problem(smoke: bool) -> str | None:
    """Why the GPU checks cannot start here (no CUDA; Liger missing, too old or not importing), or None."""
    import torch

    if smoke:
        return None
    if not torch.cuda.is_available():
        return "no CUDA device: use --smoke"
    missing = missing_install(REQUIRES_ON_GPU)
    if missing:
        return missing
    from benchtrain.train.step.loss import liger_problem

    liger = liger_problem()
    return f"gpu_check needs a working liger-kernel for the loss check: {liger}" if liger else None


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    if args.smoke:
        # One thread in this process and the commands it starts: on a small shared CPU, OpenMP's
        # threads waiting for a core another job holds make a tiny step 50× slower.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    names = [name.strip() for name in args.checks.split(",") if name.strip()]
    unknown = [name for name in names if name not in CHECKS]
    if unknown:
        print(f"unknown checks {unknown}: choose from {', '.join(CHECKS)}", file=sys.stderr)
        return 2
    scale = scale_from(args)
    if args.price:
        from gpu_check_price import price_checks, price_table

        if args.smoke:
            print("--price prices the H100 sizes, not --smoke's", file=sys.stderr)
            return 2
        print("\n".join(price_table(price_checks(scale, names))))
        return 0
    problem = missing_install(REQUIRES) or cuda_problem(args.smoke)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        ctx = Context(scale, Path(work))
        checks = [run_check(name, ctx) for name in names]
    seconds = time.monotonic() - started
    write_results(Path(args.out), checks, scale, args.smoke, seconds)
    print((Path(args.out) / "gpu_check.md").read_text(encoding="utf-8"))
    return 0 if all(check.value is not None for check in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
