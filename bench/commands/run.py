"""`bench run`: validate the options, build the workload, probe, fit, store, summarise."""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.space import SearchSpace, default_space, parse_int_list, parse_switch_list
from calibration.step_config import StepConfig
from common.console import say
from common.durations import format_duration, parse_duration
from common.errors import EXIT_OK, BenchtrainError
from train.arguments import add_data_arguments, add_method_arguments, add_step_arguments
from train.step.engine import step_options_from_args
from train.workload.method import method_from_args

RUN_EXAMPLES = """examples:
  bench run --gpu cpu --budget 150s                 # tiny preset, CPU-sized grid, 2.5 minutes
  bench run --gpu h100 --model llama-3.2-1b         # a 1B-class shape on an H100
  bench run --batch-sizes 1,2,4 --workers 0,2 --accum 1,2 --seq-lens 256,512
  bench run --search optuna --trials 20 --budget 10m  # sample the space; resumes if interrupted
  bench run --gpu h100 --model llama-3.1-8b --lora --checkpointing off,on --budget 5m
  bench run --gpu h100 --model mistral-nemo-12b --lora --budget auto   # the budget for a dozen probes, said up front
  bench run --gpu h100 --model llama-3.1-8b --lora --quantize none,4bit --budget 10m   # one calibration, both bases (QLoRA)
  bench run --gpu h100 --model llama-3.1-8b --lora --optimizer adamw,paged-adamw-8bit  # 8-bit optimizer states, measured
  bench run --data train.jsonl --model ./my-model   # real tokens from your data, lengths from its profile
  bench run --gpu h100 --model Qwen/Qwen2.5-7B-Instruct   # a hub id: config.json only, from the cache or the hub
  bench refit latest                                 # fit stored measurements again with this version's model
  bench run --gpu cpu --compile on                   # measure the compiled step (default on CUDA) and its compile time
  accelerate launch --num_processes 4 -m bench run --gpu h200   # a 4-process calibration with its all-reduce model
  accelerate launch --num_processes 4 -m bench run --gpu h200 --model llama-3.1-8b --sharding fsdp   # full fine-tuning sharded

exit codes: 0 stored a calibration; 2 bad input; 4 too few probes succeeded to fit a model (nothing stored)
"""


def add_parser(commands: Any) -> None:
    run = commands.add_parser(
        "run",
        help="run the micro-benchmark and store a calibration",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=RUN_EXAMPLES,
    )
    run.add_argument(
        "--gpu",
        metavar="NAME",
        help="the hardware this calibration is for (h100, h200, a100, cpu, …); checked against the detected device",
    )
    run.add_argument(
        "--model",
        default="tiny",
        metavar="PRESET|DIR|ORG/NAME[@REV]",
        help="preset (tiny, gpt2, llama-3.2-1b, llama-3.1-8b, qwen2.5-7b, mistral-7b, mistral-nemo-12b), a folder with config.json, "
        "or a hub id: only its config is needed, the weights are random as for presets (default: tiny)",
    )
    run.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="tokenizer folder for --data (default: the model folder's, or the built-in byte tokenizer)",
    )
    run.add_argument(
        "--data",
        metavar="PATH|ORG/NAME",
        help="feed real tokens from this dataset (default: synthetic tokens); for chat and prompt/completion data the sequence lengths "
        "measured are the ones train will plan for it (unless --seq-lens)",
    )
    add_data_arguments(run)
    run.add_argument("--batch-sizes", metavar="LIST", help="micro batch sizes, e.g. 1,2,4 (default: sized to the device)")
    run.add_argument("--workers", metavar="LIST", help="DataLoader worker counts, e.g. 0,2")
    run.add_argument("--accum", metavar="LIST", help="gradient accumulation values, e.g. 1,2")
    run.add_argument("--seq-lens", metavar="LIST", help="sequence lengths, e.g. 256,512")
    run.add_argument("--checkpointing", metavar="off,on", help="gradient checkpointing modes to measure, e.g. off,on (default: off)")
    add_method_arguments(run, measured=True)
    add_step_arguments(run)
    run.add_argument("--search", choices=("grid", "optuna"), default="grid", help="grid (default) or optuna sampling")
    run.add_argument("--trials", type=int, metavar="N", help="probes for --search optuna (default: a third of the space)")
    run.add_argument(
        "--budget",
        metavar="DURATION|auto",
        help="bound the whole benchmark, model build, evaluation and checkpoint timings included: 150s, 5m, 1h; "
        "auto = what 12 probes cost at the prices bench works out first (default: the whole space). "
        "What the budget buys is said up front; one too small for a fit is refused in seconds",
    )
    run.add_argument(
        "--max-probe-seconds",
        type=float,
        metavar="S",
        help="seconds each probe may spend timing steps (default: 1%% of --budget, at least 1.5 on CPU and 10 on GPU)",
    )
    run.add_argument("--no-report", action="store_true", help="skip the HTML/PNG report")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.add_argument("--debug", action="store_true", help="show tracebacks")

    run.set_defaults(handler=run_command)


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


def validate_args(args: argparse.Namespace) -> float | str | None:
    """Check everything that needs no torch first, so bad input fails fast. Returns the budget
    (seconds, "auto" or None)."""
    # Parse list options now (against dummy defaults) to fail before any heavy import.
    space_from_args(args, SearchSpace((1,), (0,), (1,), (1,)))
    method_from_args(args)
    step_options_from_args(args)
    if args.trials is not None and args.trials < 1:
        raise BenchtrainError(f"--trials must be a positive integer, got {args.trials}")
    if args.max_probe_seconds is not None and args.max_probe_seconds <= 0:
        raise BenchtrainError("--max-probe-seconds must be positive")
    if args.budget and str(args.budget).strip().lower() == "auto":
        return "auto"
    return parse_duration(args.budget, "--budget") if args.budget else None


def run_command(args: argparse.Namespace) -> int:
    """Each setup asked for (--quantize × --optimizer) measured in turn, within its share of the
    budget, then stored as one calibration: the first at the top, the others as its variants."""
    started = time.monotonic()
    budget_asked = validate_args(args)
    from common.home import writable_subdir
    from train.step.runtime import job_world_size
    from train.workload.model import resolve_model
    from train.workload.variants import measured_methods

    spec = resolve_model(args.model)
    methods = measured_methods(args.quantize, args.optimizer, method_from_args(args))
    if len(methods) > 1 and job_world_size() > 1:
        raise BenchtrainError(
            "several --quantize/--optimizer values are measured one process at a time: run them without `accelerate launch`, or one value per launch"
        )
    writable_subdir("calibrations")
    records = []
    for index, method in enumerate(methods):
        if len(methods) > 1:
            say(f"setup {index + 1} of {len(methods)}: {method.describe()}")
        record = measure_setup(args, spec, method, variant_budget(budget_asked, started, len(methods) - index))
        if record is None:
            return EXIT_OK  # a follower process of a multi-process bench: rank 0 stores
        records.append(record)
    return store_calibration(args, records, started)


def variant_budget(budget_asked: float | str | None, started: float, setups_left: int) -> float | str | None:
    """This setup's share of --budget: what is left of it, split evenly among the setups left."""
    if not isinstance(budget_asked, (int, float)):
        return budget_asked
    return max(0.0, budget_asked - (time.monotonic() - started)) / setups_left


def measure_setup(args: argparse.Namespace, spec: Any, method: Any, budget_asked: float | str | None) -> dict[str, Any] | None:
    """One setup's probes and fit (rank 0's record; None on the other processes)."""
    started = time.monotonic()
    from bench.calibrate import after_probes_seconds, plan_probes
    from bench.outlook import expected_error, settle_budget
    from common.home import writable_subdir

    task, options, need, tokenized = describe_task(args, spec, method, budget_asked)
    planner = plan_probes(task, spec, method, need, options, scratch=writable_subdir("scratch"))
    # What the budget buys, within seconds, before the model is built; refused if too small.
    budget_seconds = settle_budget(
        planner,
        budget_asked,
        time.monotonic() - started,
        after_probes_seconds(task, planner),
        say,
        lambda probes: expected_error(task.hardware["name"], spec.fingerprint, probes),
    )
    workload = build_workload(args, task, spec, tokenized, method, options)
    coordinator = probe_coordinator(workload, task.hardware.get("peak_bf16_flops"))
    if not coordinator.leads:
        coordinator.follow()  # rank 0 decides every probe; this process runs each with it
        return None
    try:
        return measure(args, task, planner, workload, coordinator, budget_seconds, started)
    finally:
        coordinator.finish()
        workload.release()  # the next setup builds its own model


def describe_task(args: argparse.Namespace, spec: Any, method: Any, budget_asked: float | str | None) -> tuple[Any, Any, Any, Any]:
    """What to measure, on what, before anything is built: (the BenchTask, the step options, the
    memory need, the tokenized --data or None). A model too big for the device is one line here."""
    from bench.calibrate import BenchTask
    from bench.timing import ProbeSettings
    from train.planning.memory_check import check_fits
    from train.step.engine import process_layout
    from train.step.hardware import detect_hardware, detect_software, device_label, requested_mismatch

    hardware = detect_hardware()
    options = step_options_from_args(args)
    world_size, sharding = process_layout(options, method)
    # Seconds, before anything is built: a too-big model is one line.
    need = check_fits(spec, method, hardware, sharding, world_size)
    warnings: list[str] = []
    mismatch = requested_mismatch(args.gpu, hardware)
    if mismatch:
        warnings.append(mismatch)
        say(f"warning: {mismatch}")
    space = space_from_args(args, default_space(hardware["device_type"], hardware["memory_bytes"]))
    space = within_positions(space, spec.max_positions, asked=args.seq_lens is not None)
    space, tokenized, data_record = measured_data(args, spec, space)
    settings = ProbeSettings.for_device(hardware["device_type"])
    if args.max_probe_seconds:
        settings = replace(settings, max_seconds=args.max_probe_seconds)
    elif isinstance(budget_asked, (int, float)):
        settings = settings.for_budget(budget_asked)
    task = BenchTask(
        space=space,
        settings=settings,
        hardware=hardware,
        software=detect_software(),
        model={},
        training={},
        device_label=device_label(hardware),
        requested_device=args.gpu,
        data=data_record,
        warnings=warnings,
        search=args.search,
        trials=args.trials or max(4, space.size // 3),
        sharding=sharding,
        world_size=world_size,
        load_before=_load_average(),
        budget_auto=budget_asked == "auto",
    )
    return task, options, need, tokenized


def measured_data(args: argparse.Namespace, spec: Any, space: SearchSpace) -> tuple[SearchSpace, Any, dict[str, Any] | None]:
    """With --data: its tokens, its record, and (unless --seq-lens) the lengths train will plan for it."""
    if not args.data:
        return space, None, None
    from train.planning.lengths import lengths_to_measure
    from train.workload.data import length_profile
    from train.workload.formats import schema_from_args
    from train.workload.prepare import DataSpec, prepare_data
    from train.workload.tokenizer import load_tokenizer

    # The cache's exact tokens when train (or an earlier bench) made them, else a sample: the
    # probes read a few batches of real tokens, and the lengths to measure are its quantiles.
    spec_of_data = DataSpec(args.data, schema=schema_from_args(args), split=args.data_split)
    prepared = prepare_data(spec_of_data, load_tokenizer(spec.directory, args.tokenizer), say)
    view = prepared.view
    tokenized = view if prepared.exact else view.sample
    data_record = {"source": args.data, "format": view.format, "profile": {**length_profile(view.lengths), "sampled": not prepared.exact}}
    if args.seq_lens is None:  # the lengths train will plan for this data
        space = replace(space, seq_lens=lengths_to_measure(view, space.seq_lens, spec.max_positions))
    return space, tokenized, data_record


def build_workload(args: argparse.Namespace, task: Any, spec: Any, tokenized: Any, method: Any, options: Any) -> Any:
    """The model, step and DataLoader the probes run (train's own), described into the task."""
    from bench.probe import Workload
    from bench.runner import study_name
    from common.home import benchtrain_home, writable_subdir
    from train.workload.model import model_record

    say(f"building {spec.name} on {task.hardware['name']} …")
    workload = Workload(spec, tokenized, method, options)
    task.model = model_record(spec, workload.shape)
    task.training = {**workload.training, "flops_terms": workload.shape.flops_terms(method.is_lora)}
    task.compiled = workload.engine.compiled
    task.losses = losses_to_compare(options.loss, workload)
    task.checkpoint_payload = lambda max_bytes: checkpoint_task(workload, writable_subdir("scratch"), max_bytes)
    say(f"training {method.describe()}: {workload.training['trainable_parameters']:,} of {workload.training['total_parameters']:,} parameters trainable")
    if args.search == "optuna":
        task.study = (benchtrain_home() / "studies" / "bench.db", study_name(task.hardware, task.model, task.space, args.data, method.describe()))
    return workload


def measure(args: argparse.Namespace, task: Any, planner: Any, workload: Any, coordinator: Any, budget_seconds: float | None, started: float) -> dict[str, Any]:
    """Rank 0: the probes within the budget and the fit, as a calibration record."""
    from bench.calibrate import after_probes_seconds, calibrate, nothing_fitted
    from bench.outlook import minimum_from_scratch, outlook, refuse_if_too_small
    from bench.runner import Budget

    # The build is measured now: a budget it left too small for a minimum is refused here.
    refuse_if_too_small(outlook(planner, budget_seconds, time.monotonic() - started, after_probes_seconds(task, planner)))
    budget = Budget(budget_seconds, started)
    before_probes = budget.elapsed()
    space = task.space
    total = space.size if args.search == "grid" else min(task.trials, space.size)
    say(f"probing up to {total} of {space.size} configurations ({args.search})" + (f" within {format_duration(budget_seconds)}" if budget_seconds else ""))
    progress = _progress_bar(total, args.quiet, budget_seconds)
    try:
        record, result = calibrate(task, coordinator, planner, budget, workload.build_seconds, progress)
    finally:
        if progress is not None:
            progress.close()
    if record["fit"] is None:
        raise nothing_fitted(record, budget_seconds, minimum_from_scratch(planner, before_probes, after_probes_seconds(task, planner)))
    record["left_out_configs"] = result.left_out  # for the summary; not stored
    return record


def store_calibration(args: argparse.Namespace, records: list[dict[str, Any]], started: float) -> int:
    """One calibration of every setup measured (the first at the top, the others as its variants),
    its report, the summary."""
    from calibration.setup import variant_key, variant_name
    from calibration.store import save_calibration, update_calibration

    left_out = [record.pop("left_out_configs") for record in records]
    record = {**records[0], "variants": [{key: value for key, value in other.items() if key != "id"} for other in records[1:]]}
    if not record["variants"]:
        del record["variants"]
    path = save_calibration(record)
    report_path = None
    if not args.no_report:
        report_started = time.monotonic()
        report_path = _write_report(path)
        if report_path is not None:
            # train's plan counts the report it writes at the end: measured here, for every setup.
            seconds = round(time.monotonic() - report_started, 3)
            def add_report_seconds(data: dict[str, Any]) -> None:
                for entry in (data, *data.get("variants", [])):
                    entry["overheads"]["report_seconds"] = seconds

            update_calibration(path, add_report_seconds)
    for index, (one, not_probed) in enumerate(zip(records, left_out, strict=True)):
        one["id"] = record["id"]  # the id it was saved under
        if len(records) > 1:
            print(f"\n{'first setup' if index == 0 else f'variant {index}'}: {variant_name(*variant_key(one))}")
        last = index == len(records) - 1
        print_summary(one, str(path), not_probed, report_path if last else None, time.monotonic() - started if last else None)
    return EXIT_OK


def losses_to_compare(asked: str, workload: Any) -> tuple[str, ...]:
    """`--loss auto` on an architecture whose head the fused losses support: the one auto picked
    and the other plain-torch ones (Liger's kernels, once installed, stay for all of them)."""
    from train.step.loss import PLAIN_HEAD_MODEL_TYPES

    if asked != "auto" or workload.spec.config_dict.get("model_type") not in PLAIN_HEAD_MODEL_TYPES:
        return ()
    return tuple(dict.fromkeys((workload.engine.loss, "chunked", "plain")))


def checkpoint_task(workload: Any, folder: Path, max_bytes: int) -> dict[str, Any]:
    """Rank 0's decision for the checkpoint measurement, the same on every rank."""
    from bench.disk_write import real_save_fits

    return {
        "folder": str(folder),
        "real_save": real_save_fits(workload, folder, max_bytes),
        "max_bytes": max_bytes,
        "every_rank": workload.engine.sharding == "fsdp",
    }


def probe_coordinator(workload: Any, peak_flops: float | None) -> Any:
    """What every process of a multi-process bench runs when rank 0 says so (bench.distributed)."""
    from bench.disk_write import measure_checkpoint
    from bench.distributed import Coordinator
    from bench.probe import run_eval_probe, run_probe
    from bench.timing import ProbeSettings
    from common.console import is_main_process
    from train.planning.comm import measure_collectives

    return Coordinator(
        {
            "probe": lambda task: run_probe(workload, StepConfig.from_row(task["config"]), ProbeSettings(**task["settings"]), peak_flops),
            "eval": lambda task: run_eval_probe(workload, StepConfig.from_row(task)),
            # FSDP: every rank joins in gathering the state that rank 0 saves (train.running.checkpoint);
            # DDP: rank 0 alone saves. Rank 0's figures are kept.
            "checkpoint": lambda task: (
                measure_checkpoint(workload, Path(task["folder"]), task["real_save"], task["max_bytes"]) if task["every_rank"] or is_main_process() else {}
            ),
            "comm": lambda task: measure_collectives(workload.device, ("all_reduce", "all_gather", "reduce_scatter")),
            "loss_probe": lambda task: (
                workload.set_loss(task["loss"]),
                run_probe(workload, StepConfig.from_row(task["config"]), ProbeSettings(**task["settings"]), peak_flops),
            )[1],
            "set_loss": lambda task: (workload.set_loss(task["loss"]), {})[1],
            # Rank 0 only, and last: the other ranks keep their models, which they no longer use.
            "compile_cache": lambda task: measure_cached_compile(workload, task["row"], task.get("timeout_seconds")) if is_main_process() else {},
        }
    )


def measure_cached_compile(workload: Any, row: dict[str, Any], timeout_seconds: float | None) -> dict[str, Any]:
    """Free this process's model and device memory, then time a fresh `train`-like process
    compiling `row`'s shape from inductor's cache (bench.compile_probe)."""
    from bench.compile_probe import measure_in_new_process

    loss = workload.engine.loss
    workload.release()
    return measure_in_new_process(workload.spec.reference, workload.method, loss, row, timeout_seconds or 900.0) or {}


def _load_average() -> float | None:
    import os

    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _write_report(path: Any) -> Any:
    from reports.calibration_report import write_calibration_report

    return write_calibration_report(path)


def _progress_bar(total: int, quiet: bool, budget_seconds: float | None) -> Any:
    if quiet:
        return None
    from common.progress import BudgetBar, progress_bar

    return BudgetBar(budget_seconds, total) if budget_seconds else progress_bar(total, "probes", "probe")


def print_summary(record: dict[str, Any], path: str, left_out: list[dict[str, int]], report_path: Any, total_seconds: float | None = None) -> None:
    """The calibration in words; the closing lines (time taken, where it is) after the last setup's
    (`total_seconds`: of the whole command), not after the others'."""
    from bench.describe import describe_calibration

    print("\n".join(describe_calibration(record, path)))
    if left_out:
        sample = ", ".join(StepConfig.from_row(c).label for c in left_out[:6])
        more = f" and {len(left_out) - 6} more" if len(left_out) > 6 else ""
        print(f"\nnot probed: {sample}{more}")
    if total_seconds is None:
        return
    print(f"\nbenchmark took {format_duration(total_seconds)}; calibration {record['id']} saved to {path}")
    if report_path:
        print(f"report: {report_path}")
