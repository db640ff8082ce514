"""`bench run`: validate the options, build the workload, probe, fit, store, summarise."""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench.space import ProbeConfig, SearchSpace, default_space, parse_int_list, parse_switch_list
from calibration.durations import format_duration, parse_duration
from calibration.errors import EXIT_OK, BenchtrainError, MeasurementError
from train.engine import step_options_from_args
from train.method import method_from_args


def space_from_args(args: argparse.Namespace, defaults: SearchSpace) -> SearchSpace:
    return SearchSpace(
        parse_int_list(args.batch_sizes, "--batch-sizes") if args.batch_sizes is not None else defaults.batch_sizes,
        parse_int_list(args.workers, "--workers", minimum=0) if args.workers is not None else defaults.workers,
        parse_int_list(args.accum, "--accum") if args.accum is not None else defaults.accums,
        parse_int_list(args.seq_lens, "--seq-lens") if args.seq_lens is not None else defaults.seq_lens,
        parse_switch_list(args.checkpointing, "--checkpointing") if args.checkpointing is not None else defaults.checkpointing,
    )


def within_positions(space: SearchSpace, max_positions: int, asked: bool) -> SearchSpace:
    """The sequence lengths the model's position table holds, known before the model is built:
    lengths asked for (`asked`) beyond it are a one-line error; default ones beyond it (a big
    GPU's 2048 for gpt2's 1024 positions) are left out, the table's own size probed instead."""
    too_long = [length for length in space.seq_lens if length > max_positions]
    if not too_long:
        return space
    if asked:
        raise BenchtrainError(f"--seq-lens {too_long} exceed the model's {max_positions} positions")
    return replace(space, seq_lens=tuple(sorted({length for length in space.seq_lens if length < max_positions} | {max_positions})))


def validate_args(args: argparse.Namespace) -> float | None:
    """Check everything that needs no torch first, so bad input fails fast. Returns the budget."""
    # Parse list options now (against dummy defaults) to fail before any heavy import.
    space_from_args(args, SearchSpace((1,), (0,), (1,), (1,)))
    method_from_args(args)
    step_options_from_args(args)
    if args.trials is not None and args.trials < 1:
        raise BenchtrainError(f"--trials must be a positive integer, got {args.trials}")
    if args.max_probe_seconds is not None and args.max_probe_seconds <= 0:
        raise BenchtrainError("--max-probe-seconds must be positive")
    return parse_duration(args.budget, "--budget") if args.budget else None


def run_command(args: argparse.Namespace) -> int:
    started = time.monotonic()
    budget_seconds = validate_args(args)
    from calibration.home import benchtrain_home, writable_subdir
    from train.model import resolve_model

    spec = resolve_model(args.model)
    method = method_from_args(args)
    writable_subdir("calibrations")

    from bench.probe import ProbeSettings, Workload
    from bench.record import build_calibration
    from bench.runner import Budget, run_grid, run_optuna, study_name
    from calibration.store import save_calibration, update_calibration
    from train.hardware import detect_hardware, detect_software, device_label, requested_mismatch
    from train.model import model_record

    hardware = detect_hardware()
    load_before = _load_average()
    from train.engine import check_sharding
    from train.memory_check import check_fits
    from train.runtime import job_world_size
    from train.sharding import sharding_in_use

    options = step_options_from_args(args)
    check_sharding(options, method)
    world_size = job_world_size()
    # Seconds, before anything is built: a too-big model is one line.
    check_fits(spec, method, hardware, sharding_in_use(options.sharding, world_size), world_size)
    warnings: list[str] = []
    mismatch = requested_mismatch(args.gpu, hardware)
    if mismatch:
        warnings.append(mismatch)
        _say(f"warning: {mismatch}")
    space = space_from_args(args, default_space(hardware["device_type"], hardware["memory_bytes"]))
    space = within_positions(space, spec.max_positions, asked=args.seq_lens is not None)

    data_record = None
    tokenized = None
    if args.data:
        from train.data import length_profile, load_tokenized
        from train.tokenizer import load_tokenizer

        tokenized = load_tokenized(args.data, load_tokenizer(spec.directory, args.tokenizer))
        data_record = {"source": args.data, "format": tokenized.format, "profile": length_profile(tokenized.lengths)}

    _say(f"building {spec.name} on {hardware['name']} …")
    workload = Workload(spec, tokenized, method, options)
    model = model_record(spec, workload.shape)
    _say(f"training {method.describe()}: {workload.training['trainable_parameters']:,} of {workload.training['total_parameters']:,} parameters trainable")

    peak_flops = hardware.get("peak_bf16_flops")
    coordinator = probe_coordinator(workload, peak_flops)
    if not coordinator.leads:
        coordinator.follow()  # rank 0 decides every probe; this process runs each with it
        return EXIT_OK
    try:
        trials = args.trials or max(4, space.size // 3)
        total = space.size if args.search == "grid" else min(trials, space.size)
        settings = ProbeSettings.for_device(hardware["device_type"])
        if args.max_probe_seconds:
            settings = replace(settings, max_seconds=args.max_probe_seconds)
        elif budget_seconds:
            # Share the budget between the probes (warm-up and loader start take about as long again).
            share = (budget_seconds - (time.monotonic() - started)) / (2.2 * total)
            settings = replace(settings, max_seconds=max(0.5, min(settings.max_seconds * 3, share)))

        def probe(config: ProbeConfig, remaining: float | None) -> dict[str, Any]:
            capped = settings if remaining is None else replace(settings, max_seconds=max(0.5, min(settings.max_seconds, remaining / 2)))
            return coordinator.run("probe", {"config": config.as_dict(), "settings": asdict(capped)})

        budget = Budget(budget_seconds, started)
        _say(f"probing {total} of {space.size} configurations ({args.search})" + (f" within {format_duration(budget_seconds)}" if budget_seconds else ""))
        progress = _progress_bar(total, args.quiet, budget.remaining() if budget_seconds else None)
        try:
            if args.search == "grid":
                result = run_grid(space, probe, budget, progress)
            else:
                name = study_name(hardware, model, space, args.data)
                result = run_optuna(space, probe, budget, trials, benchtrain_home() / "studies" / "bench.db", name, progress)
        finally:
            if progress is not None:
                progress.close()

        eval_rows = measure_evaluation(result.rows, lambda config: coordinator.run("eval", config.as_dict()))

        overheads = {
            "model_build_seconds": round(workload.build_seconds, 4),
            **coordinator.run("checkpoint", checkpoint_task(workload, writable_subdir("scratch"))),
            "warmup_steps": settings.warmup_steps,
            **{name: round(value, 4) for name, value in warmup_costs(result.rows, settings.warmup_steps, workload.engine.compiled).items()},
        }
        training = dict(workload.training)
        if workload.engine.compiled:
            from train.compile import compile_cache_record

            overheads.update(measure_cached_compile(workload, result.rows, overheads["warmup_extra_seconds"]))
            training["compile_cache"] = compile_cache_record()
        search = {
            "method": args.search,
            "space": space.as_dict(),
            "trials": trials if args.search == "optuna" else None,
            "budget_seconds": budget_seconds,
            "settings": settings.__dict__,
            "load_average_before": load_before,
        }
        record = build_calibration(
            hardware=hardware,
            software=detect_software(),
            model=model,
            device_label=device_label(hardware),
            requested_device=args.gpu,
            result=result,
            search=search,
            overheads=overheads,
            data=data_record,
            warnings=warnings,
            training=training,
        )
        from calibration.fit import fit_eval

        record["eval"] = {"measurements": eval_rows, "fit": fit_eval(eval_rows)}
        if coordinator.world_size > 1:
            record["distributed"] = distributed_record(coordinator.run("comm", {}), workload.engine.sharding)
        record["overheads"]["benchmark_seconds"] = round(time.monotonic() - started, 2)
        if record["fit"] is None:
            raise _nothing_fitted(record, budget_seconds)
        path = save_calibration(record)
        report_path = None
        if not args.no_report:
            report_started = time.monotonic()
            report_path = _write_report(path)
            if report_path is not None:
                # train's plan counts the report it writes at the end: measured here.
                seconds = round(time.monotonic() - report_started, 3)
                update_calibration(path, lambda data: data["overheads"].update(report_seconds=seconds))
        print_summary(record, str(path), result.left_out, report_path)
        return EXIT_OK
    finally:
        coordinator.finish()


def distributed_record(collectives: dict[str, dict[str, Any]], sharding: str) -> dict[str, Any]:
    """World size, backend, sharding and the measured collectives of a multi-process bench: every
    collective's (bytes, seconds) rows and latency + bandwidth fit (train.comm); `comm` is the
    all-reduce's, which predicts DDP at other world sizes."""
    from train.comm import world

    world_size, backend = world()
    return {
        "world_size": world_size,
        "backend": backend,
        "sharding": sharding,
        "all_reduce": collectives["all_reduce"]["measurements"],
        "comm": collectives["all_reduce"]["fit"],
        "collectives": collectives,
    }


def checkpoint_task(workload: Any, folder: Path) -> dict[str, Any]:
    """Rank 0's decision for the checkpoint measurement, the same on every rank."""
    from bench.disk_write import real_save_fits

    return {"folder": str(folder), "real_save": real_save_fits(workload, folder), "every_rank": workload.engine.sharding == "fsdp"}


def probe_coordinator(workload: Any, peak_flops: float | None) -> Any:
    """What every process of a multi-process bench runs when rank 0 says so (bench.distributed)."""
    from bench.disk_write import measure_checkpoint
    from bench.distributed import Coordinator
    from bench.probe import ProbeSettings, run_eval_probe, run_probe
    from train.comm import measure_collectives
    from train.console import is_main_process

    return Coordinator(
        {
            "probe": lambda task: run_probe(workload, ProbeConfig.of(task["config"]), ProbeSettings(**task["settings"]), peak_flops),
            "eval": lambda task: run_eval_probe(workload, ProbeConfig.of(task)),
            # FSDP: every rank joins in gathering the state that rank 0 saves (train.checkpoint);
            # DDP: rank 0 alone saves. Rank 0's figures are kept.
            "checkpoint": lambda task: measure_checkpoint(workload, Path(task["folder"]), task["real_save"]) if task["every_rank"] or is_main_process() else {},
            "comm": lambda task: measure_collectives(workload.device, ("all_reduce", "all_gather", "reduce_scatter")),
        }
    )


def measure_cached_compile(workload: Any, rows: list[dict[str, Any]], warmup_extra: float) -> dict[str, Any]:
    """A later `train` process on this machine finds bench's compiled kernels in inductor's cache:
    start one (bench.compile_probe) on the first probed shape and time its first step against its
    steady one, less the warm-up every run pays anyway."""
    from bench.compile_probe import measure_in_new_process

    ok = [row for row in rows if row["status"] == "ok"]
    if not ok:
        return {}
    reference = str(workload.spec.directory) if workload.spec.directory else workload.spec.name
    measured = measure_in_new_process(reference, workload.method, workload.engine.loss, ok[0])
    if measured is None:
        return {}
    cached = max(0.0, measured["first_step_seconds"] - measured["step_seconds"] - warmup_extra)
    return {"compile_cached_seconds_per_shape": round(cached, 4)}


def measure_evaluation(rows: list[dict[str, Any]], eval_probe: Any) -> list[dict[str, Any]]:
    """Forward-only eval batches at the corners of what trained fine (smallest and largest batch
    and length, checkpointing off): what `train` needs to plan evaluation time."""
    ok = [row for row in rows if row["status"] == "ok" and not row.get("gradient_checkpointing")]
    if not ok:
        return []
    batches = sorted({row["micro_batch_size"] for row in ok})
    lengths = sorted({row["seq_len"] for row in ok})
    corners = sorted({(b, s) for b in (batches[0], batches[-1]) for s in (lengths[0], lengths[-1])})
    return [eval_probe(ProbeConfig(b, 0, 1, s)) for b, s in corners]


def _nothing_fitted(record: dict[str, Any], budget_seconds: float | None) -> MeasurementError:
    """Too few probes to fit: keep the measurements aside (never as a usable calibration, so that
    `latest` does not pick it) and say what a fit needs."""
    from calibration.fit import MIN_ROWS_FOR_FIT
    from calibration.store import save_failed

    rows = record["measurements"]
    ok = sum(1 for row in rows if row["status"] == "ok")
    kept = save_failed(record)
    took = format_duration(record["overheads"]["benchmark_seconds"])
    advice = "raise --budget or narrow the grid (--batch-sizes, --seq-lens)" if budget_seconds else "widen the grid or check the failed probes"
    return MeasurementError(
        f"only {ok} of {len(rows)} probes succeeded in {took}; a fit needs at least {MIN_ROWS_FOR_FIT}: {advice}. "
        f"Nothing was stored as a calibration; the measurements are in {kept}"
    )


def _load_average() -> float | None:
    import os

    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def warmup_costs(rows: list[dict[str, Any]], warmup_steps: int, compiled: bool) -> dict[str, float]:
    """How much longer the first steps take than steady state, from the probes' warm-up.

    - `warmup_extra_seconds`: DataLoader start, allocator, kernel selection; from the probes that
      compiled nothing (a shape seen before), or from all of them when the step is not compiled.
    - `compile_seconds_per_shape` (compiled steps): what the first probe of each new shape paid
      beyond that, i.e. one compilation."""
    import statistics

    def extras(selected: list[dict[str, Any]]) -> list[float]:
        return [max(0.0, row["warmup_seconds"] - warmup_steps * row["step_seconds"]) for row in selected if row.get("warmup_seconds") is not None]

    ok = [row for row in rows if row["status"] == "ok"]
    if not compiled:
        found = extras(ok)
        return {"warmup_extra_seconds": statistics.median(found) if found else 0.0}
    repeated = extras([row for row in ok if not row.get("new_shape")])
    warmup = statistics.median(repeated) if repeated else 0.0
    new = extras([row for row in ok if row.get("new_shape")])
    compile_seconds = max(0.0, statistics.median(new) - warmup) if new else 0.0
    return {"warmup_extra_seconds": warmup, "compile_seconds_per_shape": compile_seconds, "compile_shapes_measured": len(new)}


def _write_report(path: Any) -> Any:
    from reports.calibration_report import write_calibration_report

    return write_calibration_report(path)


def _progress_bar(total: int, quiet: bool, budget_seconds: float | None) -> Any:
    if quiet:
        return None
    from calibration.progress import BudgetBar, progress_bar

    return BudgetBar(budget_seconds, total) if budget_seconds else progress_bar(total, "probes", "probe")


def _say(message: str) -> None:
    import sys

    from train.console import is_main_process

    if is_main_process():
        print(message, file=sys.stderr, flush=True)


def print_summary(record: dict[str, Any], path: str, left_out: list[dict[str, int]], report_path: Any) -> None:
    from bench.describe import describe_calibration

    print("\n".join(describe_calibration(record, path)))
    if left_out:
        sample = ", ".join(f"B{c['micro_batch_size']}/W{c['num_workers']}/A{c['grad_accum']}/S{c['seq_len']}" for c in left_out[:6])
        more = f" and {len(left_out) - 6} more" if len(left_out) > 6 else ""
        print(f"\nnot probed: {sample}{more}")
    print(f"\nbenchmark took {format_duration(record['overheads']['benchmark_seconds'])}; calibration {record['id']} saved to {path}")
    if report_path:
        print(f"report: {report_path}")
