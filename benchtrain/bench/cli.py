"""`bench`: the parser and a handler per command (run, list, show, refit, data, push).

Heavy imports (torch, transformers) happen inside the handlers so `--help` is instant.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from datetime import datetime
from typing import TYPE_CHECKING, TypeAlias

from benchtrain.bench.record import refit_record
from benchtrain.bench.space import parse_int_list, parse_switch_list
from benchtrain.calibration.accuracy import describe_estimate_error, estimate_error_pct
from benchtrain.calibration.comm import describe_collectives
from benchtrain.calibration.dimensions import DIMENSIONS, switches
from benchtrain.calibration.model import Calibration
from benchtrain.calibration.schema import (
    OLDEST_READABLE,
    SCHEMA_VERSION,
    read_calibration_file,
    read_for_refit,
    variant_data,
)
from benchtrain.calibration.setup import describe_setup, variant_name, variant_of
from benchtrain.calibration.slices import describe_slices
from benchtrain.calibration.step_config import StepConfig
from benchtrain.calibration.store import (
    calibrations_dir,
    home_hint,
    list_calibrations,
    resolve_calibration,
    save_calibration,
    update_calibration,
)
from benchtrain.calibration.topology import parse_interconnect
from benchtrain.calibration.training import Training
from benchtrain.common.console import say
from benchtrain.common.durations import format_duration, join_negative_values, parse_duration
from benchtrain.common.errors import EXIT_OK, BenchtrainError, OneLineParser, guard_cli
from benchtrain.common.home import writable_subdir
from benchtrain.common.json_types import JsonDict, JsonValue
from benchtrain.train.arguments import add_data_arguments, add_method_arguments, add_step_arguments
from benchtrain.train.step.engine import step_options_from_args
from benchtrain.train.step.hardware import require_requested_device
from benchtrain.train.step.runtime import job_world_size
from benchtrain.train.workload.formats import schema_from_args
from benchtrain.train.workload.method import measured_methods, method_from_args
from benchtrain.train.workload.model import resolve_model
from benchtrain.train.workload.prepare import DataSpec

if TYPE_CHECKING:
    from pathlib import Path

    from benchtrain.bench.variant_measurement import BenchRequest
    from benchtrain.common.progress import Bar

    # What `add_subparsers` returns: each command adds its parser to it.
    Subcommands: TypeAlias = argparse._SubParsersAction[OneLineParser]

RUN_EXAMPLES = """examples:
  bench run --gpu cpu --budget 150s                 # tiny preset, CPU-sized grid, 2.5 minutes
  bench run --gpu h100 --model llama-3.2-1b         # a 1B-class shape on an H100
  bench run --batch-sizes 1,2,4 --workers 0,2 --accum 1,2 --seq-lens 256,512
  bench run --search optuna --trials 20 --budget 10m  # sample the space; resumes if interrupted
  bench run --gpu h100 --model llama-3.1-8b --lora --checkpointing off,on --budget 5m
  bench run --gpu h100 --model mistral-nemo-12b --lora --budget auto   # the budget for a dozen probes, said up front
  bench run --gpu h100 --model llama-3.1-8b --lora --quantize none,4bit --budget 10m   # one calibration, both bases (QLoRA)
  bench run --gpu h100 --model llama-3.1-8b --lora --optimizer adamw,paged-adamw-8bit  # 8-bit optimizer states, measured
  bench run --gpu h100 --model llama-3.2-1b --optimizer adamw,sgd   # SGD with momentum: half the state, its own measured setup
  bench run --data train.jsonl --model ./my-model   # real tokens from your data, lengths from its profile
  bench run --gpu h100 --model Qwen/Qwen2.5-7B-Instruct   # a hub id: config.json only, from the cache or the hub
  bench refit latest                                 # fit stored measurements again with this version's model
  bench run --gpu cpu --compile on                   # measure the compiled step (default on CUDA) and its compile time
  bench run --gpu h100 --model llama-3.1-8b --layers auto --budget 5m   # slices of the real architecture, planned whole
  bench run --gpu cpu --model gpt2 --layers 2,4,6   # 2, 4 and 6 of gpt2's 12 layers; the 6-layer probes test the extrapolation
  accelerate launch --num_processes 4 -m benchtrain.bench run --gpu h200   # a 4-process calibration with its all-reduce model
  accelerate launch --num_processes 4 -m benchtrain.bench run --gpu h200 --model llama-3.1-8b --sharding fsdp   # full fine-tuning sharded
  accelerate launch --num_processes 8 -m benchtrain.bench run --gpu h100 --model llama-3.1-70b --lora --sharding fsdp --layers auto   # LoRA's base sharded

exit codes: 0 stored a calibration; 2 bad input; 4 too few probes succeeded to fit a model (nothing stored)
"""

DATA_EXAMPLES = """examples:
  bench data list                                              # every cached dataset: key, source, records, tokens, size, last used
  bench data prepare --data chats.jsonl --model llama-3.2-1b --tokenizer tok/   # tokenize everything now (train then plans exactly)
  bench data clear 3fa2c81e09d4b7aa51c6e2d0                    # one dataset's tokens (and its samples)
  bench data clear --all                                       # the whole cache
"""

PUSH_EXAMPLES = """examples:
  bench push my-org/gpu-calibrations                  every stored calibration (`bench list`)
  bench push my-org/gpu-calibrations latest           the newest one
  bench push my-org/gpu-calibrations ID1 ./other.json these (ids, bundled names or paths)

then, on any machine (a dry run needs no GPU):
  train --dry-run --use-calibration hub:my-org/gpu-calibrations --model llama-3.2-1b --data chats.jsonl --deadline 12h
  train --dry-run --use-calibration all,hub:my-org/gpu-calibrations --model llama-3.2-1b --data chats.jsonl --deadline 12h
  train --use-calibration hub:my-org/gpu-calibrations/ID --model llama-3.2-1b --data chats.jsonl --deadline 12h

One commit: calibrations/<id>.json for each (an id pushed again replaces its file) and a README.md
card listing every calibration in the repository (device, interconnect, model, method, quantization,
processes, software, who measured it). The token comes from `hf auth login` or HF_TOKEN, as for
`train --push-to-hub`; its user is written into each file as who measured it. Local paths of the
data or a model folder go up as their file names only."""


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="bench",
        description="Measure the training step on this device across a grid and fit a throughput/memory model.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=RUN_EXAMPLES,
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    commands = parser.add_subparsers(dest="command", metavar="{run,list,show,refit,data,push}")

    for add_parser in (
        add_run_parser,
        add_list_parser,
        add_show_parser,
        add_refit_parser,
        add_data_parser,
        add_push_parser,
    ):
        add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(join_negative_values(sys.argv[1:] if argv is None else argv))
    if args.command is None:
        parser.print_help()
        return EXIT_OK
    return args.handler(args)


def entry_point() -> None:
    from benchtrain.train.step.runtime import leave

    leave(guard_cli(main))


def add_run_parser(commands: Subcommands) -> None:
    run = commands.add_parser(
        "run",
        help="run the micro-benchmark and store a calibration",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=RUN_EXAMPLES,
    )
    run.add_argument(
        "--gpu",
        metavar="NAME",
        help="the hardware this calibration is for (h100, h200, a100, cpu, …); checked against the detected device: "
        "a GPU name where torch sees no usable CUDA is refused (exit 2), cpu measures the CPU",
    )
    run.add_argument(
        "--model",
        metavar="PRESET|DIR|ORG/NAME[@REV]",
        help="preset (tiny, gpt2, llama-3.2-1b, llama-3.1-8b, qwen2.5-7b, mistral-7b, mistral-nemo-12b), a folder with config.json, "
        "or a hub id: only its config is needed, the weights are random as for presets (default: tiny; with --extend: the calibration's)",
    )
    run.add_argument(
        "--extend",
        metavar="latest|ID|PATH",
        help="measure a stored calibration further: the values given (--seq-lens 1024,2048; the other dimensions: what it "
        "measured) with its step, method and probe timing on the same device, its probes chosen by the same planner within "
        "--budget; stored as a new calibration whose `extends` names it (the old file is left as it was)",
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
    for dimension in DIMENSIONS.values():  # the grid: one option per dimension
        run.add_argument(dimension.flag, metavar="off,on" if dimension.switch else "LIST", help=dimension.help)
    add_method_arguments(run, measured=True)
    add_step_arguments(run)
    run.add_argument("--search", choices=("grid", "optuna"), default="grid", help="grid (default) or optuna sampling")
    run.add_argument(
        "--trials", type=int, metavar="N", help="probes for --search optuna (default: a third of the space)"
    )
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
    run.add_argument(
        "--layers",
        metavar="auto|K1,K2[,…]",
        help="measure slices of the real architecture with K decoder layers at each depth and plan the whole model from them "
        "(time and activations fitted as a fixed part + a per-layer part, the extrapolation's held-out error recorded); auto: the whole "
        "model when it fits and the budget buys a usable fit of it, else 2,4,6 layers (1,2,3 or 1,2 where those do not fit). "
        "Architectures whose layers differ are measured whole",
    )
    run.add_argument(
        "--interconnect",
        metavar="WORD",
        help="how this job's devices are linked, recorded with the calibration and matched when a run or a comparison picks "
        "one: nvlink, nvswitch, pcie, ib, ethernet, loopback, or NODESxGPUS:nvlink+ib across nodes, e.g. 2x8:nvlink+ib "
        "(default: detected: NVML's active NVLinks on CUDA, loopback on CPU; several nodes are not detected)",
    )
    run.add_argument("--no-report", action="store_true", help="skip the HTML/PNG report")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.add_argument("--debug", action="store_true", help="show tracebacks")

    run.set_defaults(handler=run_command)


def asked_space(args: argparse.Namespace) -> dict[str, tuple[int, ...]]:
    """The grid's lists given (--batch-sizes, --workers, --accum, --seq-lens, --checkpointing, …),
    by search space axis; the others are the device's defaults."""
    asked: dict[str, tuple[int, ...]] = {}
    for dimension in DIMENSIONS.values():
        text = getattr(args, dimension.flag.removeprefix("--").replace("-", "_"), None)
        if text is not None:
            parse = (
                parse_switch_list(text, dimension.flag)
                if dimension.switch
                else parse_int_list(text, dimension.flag, minimum=dimension.minimum)
            )
            asked[dimension.axis] = parse
    return asked


def validate_args(args: argparse.Namespace) -> float | str | None:
    """Check everything that needs no torch first, so bad input fails fast. Returns the budget (seconds, "auto" or None)."""
    # Parse list options now to fail before any heavy import.
    asked_space(args)
    method_from_args(args)
    step_options_from_args(args)
    if args.trials is not None and args.trials < 1:
        raise BenchtrainError(f"--trials must be a positive integer, got {args.trials}")
    if args.max_probe_seconds is not None and args.max_probe_seconds <= 0:
        raise BenchtrainError("--max-probe-seconds must be positive")
    from benchtrain.bench.layer_slices import parse_layers

    parse_layers(getattr(args, "layers", None))
    interconnect_word(args)
    if args.budget and str(args.budget).strip().lower() == "auto":
        return "auto"
    return parse_duration(args.budget, "--budget") if args.budget else None


def interconnect_word(args: argparse.Namespace) -> str | None:
    """--interconnect as calibration.topology's word for this job's processes; None without it."""
    if not getattr(args, "interconnect", None):
        return None
    return parse_interconnect(args.interconnect).placed(job_world_size()).word


def request_from_args(args: argparse.Namespace) -> BenchRequest:
    """The options (validated) as what one variant's measurement needs (bench.variant_measurement)."""
    from benchtrain.bench.variant_measurement import BenchRequest

    data = DataSpec(args.data, schema=schema_from_args(args), split=args.data_split) if args.data else None
    return BenchRequest(
        options=step_options_from_args(args),
        space_asked=asked_space(args),
        requested_device=args.gpu,
        data=data,
        tokenizer=args.tokenizer,
        search=args.search,
        trials=args.trials,
        max_probe_seconds=args.max_probe_seconds,
    )


def run_command(args: argparse.Namespace) -> int:
    """Each variant asked for (--quantize × --optimizer) measured in turn, within its share of the
    budget, then stored as one calibration: the first at the top, the others as its variants."""
    started = time.monotonic()
    budget_asked = validate_args(args)
    if args.extend:
        return extend_command(args, budget_asked, started)
    args.model = args.model or "tiny"
    # A GPU asked for that torch cannot use is refused, not measured on the CPU under its name.
    require_requested_device(args.gpu)
    # Imported once the options are valid: the planner's modules are not needed before (nor for --help).
    from benchtrain.bench.variant_measurement import measure_variant

    request = request_from_args(args)
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
        budget = variant_budget(budget_asked, started, len(methods) - index)
        bar = lambda total, seconds: _progress_bar(total, args.quiet, seconds)  # noqa: E731
        if getattr(args, "layers", None) is not None:
            from benchtrain.bench.layer_slices import measure_layers, parse_layers

            layers = parse_layers(args.layers)
            assert layers is not None
            record = measure_layers(request, spec, method, budget, layers, bar)
        else:
            record = measure_variant(request, spec, method, budget, bar)
        if record is None:
            return EXIT_OK  # a follower process of a multi-process bench: rank 0 stores
        records.append(record)
    return store_calibration(args, records, started)


def extend_command(args: argparse.Namespace, budget_asked: float | str | None, started: float) -> int:
    """`bench run --extend ID`: the values asked for measured with the calibration's own step, stored as a new calibration."""
    from benchtrain.bench.extend import extend, extension_source

    asked = asked_space(args)
    if not asked:
        raise BenchtrainError(
            "bench run --extend: name the values to measure, e.g. --seq-lens 1024,2048 (the other dimensions: what it measured)"
        )
    if budget_asked == "auto":
        raise BenchtrainError("bench run --extend: --budget takes a duration (60s, 5m) or nothing")
    assert not isinstance(budget_asked, str)
    path = resolve_calibration(args.extend, on_skip=lambda message: print(f"warning: {message}", file=sys.stderr))
    found = extension_source(path, args.model)
    source, spec = found.data, found.spec
    writable_subdir("calibrations")
    record = extend(source, spec, asked, budget_asked, lambda total, seconds: _progress_bar(total, args.quiet, seconds))
    saved = save_calibration(record)
    print("\n".join(describe_calibration(record, str(saved))))
    extension = record["search"]["extensions"][-1]
    print(
        f"\nextended {source['id']} with {extension['ok']} of {extension['probes']} probes in "
        f"{format_duration(time.monotonic() - started)}: stored as {record['id']} ({saved}); {source['id']} is unchanged"
    )
    return EXIT_OK


def variant_budget(budget_asked: float | str | None, started: float, variants_left: int) -> float | str | None:
    """This variant's share of --budget: what is left of it, split evenly among the variants left."""
    if not isinstance(budget_asked, (int, float)):
        return budget_asked
    return max(0.0, budget_asked - (time.monotonic() - started)) / variants_left


def store_calibration(args: argparse.Namespace, records: list[JsonDict], started: float) -> int:
    """One calibration of every variant measured, its report, the summary."""
    left_out = [record.pop("left_out_configs") for record in records]
    word = interconnect_word(args)
    if word is not None:  # what the user says overrides what was detected
        for one in records:
            one["hardware"] = {**one["hardware"], "interconnect": word, "interconnect_from": "--interconnect"}
    record = {
        **records[0],
        "variants": [{key: value for key, value in other.items() if key != "id"} for other in records[1:]],
    }
    if not record["variants"]:
        del record["variants"]
    path = save_calibration(record)
    report_path = None
    if not args.no_report:
        report_started = time.monotonic()
        from benchtrain.reports.calibration_report import write_calibration_report

        report_path = write_calibration_report(path)
        if report_path is not None:
            # train's plan counts the report it writes at the end: measured here, for every variant.
            seconds = round(time.monotonic() - report_started, 3)

            def add_report_seconds(data: JsonDict) -> None:
                for entry in (data, *data.get("variants", [])):
                    entry["overheads"]["report_seconds"] = seconds

            update_calibration(path, add_report_seconds)
    for index, (one, not_probed) in enumerate(zip(records, left_out, strict=True)):
        one["id"] = record["id"]  # the id it was saved under
        if len(records) > 1:
            print(f"\n{'first setup' if index == 0 else f'variant {index}'}: {variant_name(*variant_of(one))}")
        last = index == len(records) - 1
        print_summary(
            one, str(path), not_probed, report_path if last else None, time.monotonic() - started if last else None
        )
    return EXIT_OK


def _progress_bar(total: int, quiet: bool, budget_seconds: float | None) -> Bar | None:
    if quiet:
        return None
    from benchtrain.common.progress import BudgetBar, progress_bar

    return BudgetBar(budget_seconds, total) if budget_seconds else progress_bar(total, "probes", "probe")


def print_summary(
    record: JsonDict,
    path: str,
    left_out: list[dict[str, int]],
    report_path: Path | None,
    total_seconds: float | None = None,
) -> None:
    """The calibration in words; the closing lines only after the last variant's (`total_seconds`)."""
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


def add_list_parser(commands: Subcommands) -> None:
    listing = commands.add_parser("list", help="list stored calibrations, newest first")
    listing.add_argument("--debug", action="store_true")
    listing.set_defaults(handler=lambda args: list_command())


def list_command() -> int:
    from benchtrain.calibration.store import bundled_calibrations, list_unfinished

    # What benches that died kept of their measurements (never a calibration): named first.
    for path, unfinished, _ in list_unfinished():
        if unfinished is None:
            print(f"unfinished bench {path}: unreadable")
            continue
        rows = unfinished.get("measurements") or []
        ok = sum(1 for row in rows if row.get("status") == "ok")
        started = unfinished.get("created_at", "?")
        print(
            f"unfinished bench {path}: started {started}, {len(rows)} probes measured ({ok} ok), never stored (not a calibration)"
        )
    entries = list_calibrations()
    # The bundled ones are addressed by name: plan for a device before renting it (--dry-run).
    bundled = ", ".join(bundled_calibrations())
    if not entries:
        print(
            f"no calibrations in {calibrations_dir()}: run `bench run`{home_hint()}; bundled, to plan with: {bundled}"
        )
        return EXIT_OK
    print(f"bundled, to plan with (train --use-calibration NAME --dry-run): {bundled}")
    for path, data, error in entries:
        if data is None:
            print(f"{path.stem:<44} unreadable: {error}")
            continue
        ok = sum(1 for row in data["measurements"] if row["status"] == "ok")
        fit = data.get("fit") or {}
        median = (fit.get("held_out_error") or {}).get("median_abs_pct")
        error_text = f"held-out median error {median:.1f}%" if median is not None else "no fit"
        print(
            f"{data['id']:<44} {data['created_at']}  {data['hardware']['name'][:28]:<28}  {data['model']['name']:<14} {ok:>3} ok probes, {error_text}"
        )
        # What was measured, on a line of its own: the row above is already a terminal wide.
        print(f"{'':<4}{describe_setup(data)}")
    return EXIT_OK


def add_show_parser(commands: Subcommands) -> None:
    show = commands.add_parser("show", help="explain a calibration: fit, error, best configurations")
    show.add_argument("reference", nargs="?", default="latest", metavar="latest|ID|PATH")
    show.add_argument("--json", action="store_true", help="print the calibration JSON")
    show.add_argument("--debug", action="store_true")
    show.set_defaults(handler=lambda args: show_command(args.reference, args.json))


def show_command(reference: str, as_json: bool) -> int:
    path = resolve_calibration(reference, on_skip=lambda message: print(f"warning: {message}", file=sys.stderr))
    data = read_calibration_file(path)
    if as_json:
        json.dump(data, sys.stdout, indent=2)
        print()
        return EXIT_OK
    # Each variant the calibration measured (bench run --quantize none,4bit …), the first first.
    for index in (None, *range(len(data.get("variants") or []))):
        if index is not None:
            entry = variant_data(data, index)
            print(f"\nvariant {index + 1}: {variant_name(*variant_of(entry))}")
        print("\n".join(describe_calibration(variant_data(data, index), str(path))))
    return EXIT_OK


def add_refit_parser(commands: Subcommands) -> None:
    refit = commands.add_parser(
        "refit",
        help="fit a stored calibration's measurements again with this version's model; stores a new calibration",
        description="Re-fit the measurements of a stored calibration with the current fitting code (measurements unchanged) and store "
        "the result as a new calibration whose refit_of names the source.",
    )
    refit.add_argument("reference", nargs="?", default="latest", metavar="latest|ID|PATH")
    refit.add_argument("--debug", action="store_true")
    refit.set_defaults(handler=lambda args: refit_command(args.reference))


def refit_command(reference: str) -> int:
    path = resolve_calibration(reference, on_skip=lambda message: print(f"warning: {message}", file=sys.stderr))
    # A file planning refuses as too old is read too: its probes are what someone paid for (schema.read_for_refit).
    source = read_for_refit(path)
    record = refit_record(source.data)
    saved = save_calibration(record)
    print("\n".join(describe_calibration(record, str(saved))))
    before = source.held_out_median_pct
    after = record["fit"]["held_out_error"]["median_abs_pct"]
    was = f"{before:.1f}%" if before is not None else "no fit"
    if source.schema_version < OLDEST_READABLE:
        was = f"schema {source.schema_version}'s fit set aside"
    print(
        f"\nrefit of {source.data['id']}: held-out median error {was} → {after:.1f}% ({record['fit']['kind']}); stored as {record['id']}"
        + (f" at schema {SCHEMA_VERSION}" if source.schema_version < OLDEST_READABLE else "")
    )
    return EXIT_OK


def add_data_parser(commands: Subcommands) -> None:
    data = commands.add_parser(
        "data",
        help="the tokenized-data cache: list, clear, prepare",
        description="Tokenized data is cached once per dataset under $BENCHTRAIN_HOME/data, keyed by the data's content, the tokenizer, "
        "its chat template, the format and columns and what the loss is on.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=DATA_EXAMPLES,
    )
    actions = data.add_subparsers(dest="data_command", metavar="{list,clear,prepare}", required=True)
    listing = actions.add_parser("list", help="the cached datasets, newest use first")
    listing.add_argument("--debug", action="store_true")
    listing.set_defaults(handler=lambda args: data_list_command())
    clear = actions.add_parser("clear", help="remove cached datasets by key (or --all)")
    clear.add_argument("keys", nargs="*", metavar="KEY")
    clear.add_argument("--all", action="store_true", help="remove every cached dataset")
    clear.add_argument("--debug", action="store_true")
    clear.set_defaults(handler=clear_command)
    prepare = actions.add_parser("prepare", help="tokenize every record of --data now, into the cache")
    prepare.add_argument("--data", required=True, metavar="PATH|ORG/NAME", help="the data, as train --data takes it")
    prepare.add_argument(
        "--model", default="tiny", metavar="PRESET|DIR|ORG/NAME[@REV]", help="whose tokenizer (default: tiny)"
    )
    prepare.add_argument("--tokenizer", metavar="DIR", help="tokenizer folder (default: the model's)")
    prepare.add_argument(
        "--train-on",
        default="assistant",
        choices=("assistant", "all"),
        help="chat data: the loss on the assistant's turns or all",
    )
    add_data_arguments(prepare)
    prepare.add_argument("--debug", action="store_true")
    prepare.set_defaults(handler=prepare_command)


def data_list_command() -> int:
    from benchtrain.train.workload.data_cache import data_root, list_stores

    rows = list_stores()
    if not rows:
        print(f"no tokenized data in {data_root()}")
        return EXIT_OK
    total = sum(row["bytes"] for row in rows)
    print(
        f"tokenized data in {data_root()}: {len(rows)} stores, {total / 1e9:,.2f} GB (clear with `bench data clear KEY` or `--all`)"
    )
    for row in sorted(rows, key=lambda row: -row["used"]):
        documents = f"{row['documents']:,}" if row["documents"] is not None else "?"
        tokens = f"{row['tokens']:,}" if row["tokens"] is not None else "?"
        state = "" if row["complete"] else "  (incomplete: rebuilt when used)"
        used = datetime.fromtimestamp(row["used"]).strftime("%Y-%m-%d %H:%M")
        size = f"{row['bytes'] / 1e6:,.1f} MB"
        print(
            f"{row['key']:<38} {row['kind']:<6} {documents:>11} records {tokens:>15} tokens {size:>12}  used {used}  {row['source']}{state}"
        )
    return EXIT_OK


def clear_command(args: argparse.Namespace) -> int:
    from benchtrain.train.workload.data_cache import clear_stores

    if not args.keys and not args.all:
        raise BenchtrainError("bench data clear: name the KEYs to remove (bench data list shows them), or pass --all")
    removed = clear_stores(None if args.all else list(args.keys))
    if not removed and args.keys:
        raise BenchtrainError(
            f"bench data clear: no cached data with key {', '.join(args.keys)} (bench data list shows them)"
        )
    print(f"removed {len(removed)} store(s): {', '.join(removed) if removed else 'none'}")
    return EXIT_OK


def prepare_command(args: argparse.Namespace) -> int:
    from benchtrain.train.workload.data import resolve_data_path
    from benchtrain.train.workload.prepare import prepare_data
    from benchtrain.train.workload.tokenizer import load_tokenizer

    started = time.perf_counter()
    spec = resolve_model(args.model)
    tokenizer = load_tokenizer(spec.directory, args.tokenizer)
    path = resolve_data_path(args.data)
    prepared = prepare_data(
        DataSpec(path, args.train_on, schema_from_args(args), args.data_split), tokenizer, say, exact=True
    )
    data = prepared.view
    size = sum(path.stat().st_size for path in prepared.folder.rglob("*") if path.is_file())
    print(
        f"{prepared.records:,} records of {args.data}: {len(data):,} samples, {int(data.lengths.sum()):,} tokens "
        f"in {prepared.folder} ({size / 1e6:,.1f} MB; {time.perf_counter() - started:.1f}s)"
    )
    return EXIT_OK


def add_push_parser(commands: Subcommands) -> None:
    push = commands.add_parser(
        "push",
        help="share calibrations on the Hugging Face hub (a dataset repository)",
        description="Upload calibrations to a dataset repository on the Hugging Face hub, with a card listing them.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=PUSH_EXAMPLES,
    )
    push.add_argument(
        "repo",
        metavar="ORG/NAME",
        help="the dataset repository (made when missing); NAME alone: the token's own namespace",
    )
    push.add_argument(
        "ids",
        nargs="*",
        metavar="ID",
        help="latest, ids (`bench list`), bundled names or paths; default: every stored calibration",
    )
    push.add_argument("--debug", action="store_true", help="show tracebacks")
    push.set_defaults(handler=lambda args: push_command(args.repo, args.ids))


def push_command(repo: str, references: list[str]) -> int:
    from benchtrain.calibration.hub import push_calibrations
    from benchtrain.common.hub_access import valid_repo_id, writing_user

    valid_repo_id(repo, "bench push")
    calibrations = calibrations_to_push(references)
    user = writing_user("bench push", again="push again")
    if "/" not in repo:  # NAME alone: the token's own namespace, as the hub reads it
        if not user:
            raise BenchtrainError(f"bench push {repo}: the token names no user: name the repository as ORG/NAME")
        repo = f"{user}/{repo}"
    pushed = push_calibrations(repo, calibrations, user)
    print(
        f"pushed {len(pushed.files)} calibration(s) to {pushed.url} ({pushed.listed} there now): {', '.join(data['id'] for data in calibrations)}"
    )
    if pushed.commit_url:
        print(f"  commit: {pushed.commit_url}")
    print(
        f"  plan with them anywhere: train --dry-run --use-calibration hub:{repo} --model MODEL --data DATA --deadline DURATION"
    )
    return EXIT_OK


def calibrations_to_push(references: list[str]) -> list[JsonDict]:
    """The calibrations named (each once), or every readable one in the store; an unreadable one in the store is said and left out."""

    def warn(message: str) -> None:
        print(f"warning: {message}", file=sys.stderr)

    if references:
        return [
            read_calibration_file(resolve_calibration(reference, on_skip=warn))
            for reference in dict.fromkeys(references)
        ]
    found = []
    for path, data, error in list_calibrations():
        if data is None:
            warn(f"left out {path}: {error}")
        else:
            found.append(data)
    if not found:
        raise BenchtrainError(
            f"bench push: no calibration in {calibrations_dir()} to push: run `bench run` first, or name one{home_hint()}"
        )
    return found


Column = tuple[str, str, str | None]  # the row's key, the column's title, its format

SIZE_COLUMNS: tuple[Column, ...] = (
    ("micro_batch_size", "batch", "{:d}"),
    ("num_workers", "workers", "{:d}"),
    ("grad_accum", "accum", "{:d}"),
    ("seq_len", "seq_len", "{:d}"),
)
MEASURED_COLUMNS: tuple[Column, ...] = (
    ("tokens_per_second", "tokens/s", "{:,.0f}"),
    ("step_seconds", "step s", "{:.4f}"),
    ("mfu", "MFU", "{:.1%}"),
    ("peak_memory_bytes", "peak MiB", None),
    ("data_wait_share", "data wait", "{:.1%}"),
    ("status", "status", "{}"),
)


def format_table(rows: list[JsonDict]) -> str:
    """The measurement rows as a text table: the sizes, each switch (titled by its label: ckpt), then what was measured."""
    columns = (
        *SIZE_COLUMNS,
        *((dimension.name, dimension.label.lstrip("/"), "{:d}") for dimension in switches()),
        *MEASURED_COLUMNS,
    )
    header = [title for _, title, _ in columns]
    body = [[_cell(row.get(key), key, style) for key, _, style in columns] for row in rows]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(line, widths, strict=True)) for line in [header, *body]]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def _cell(value: JsonValue, key: str, style: str | None) -> str:
    if value is None or value == "":
        return "-"
    if key == "peak_memory_bytes":
        return f"{value / 2**20:,.0f}"
    try:
        return style.format(value) if style else str(value)
    except (ValueError, TypeError):
        return str(value)


def describe_step(training: JsonDict, overheads: JsonDict) -> str:
    """How THE step ran: compiled or eager (with the measured compile time), and its loss."""
    loss = training.get("loss", "plain")
    if not training.get("compile"):
        return f"eager, {loss} loss"
    cold = overheads.get("compile_seconds_per_shape", 0.0)
    cached = overheads.get("compile_cached_seconds_per_shape")
    from_cache = f", {cached:.1f}s from inductor's cache" if cached is not None else ""
    return f"torch.compile, {loss} loss; compiling a batch shape took {cold:.1f}s ({overheads.get('compile_shapes_measured', 0)} measured){from_cache}"


def describe_calibration(data: JsonDict, path: str) -> list[str]:
    hardware, model = data["hardware"], data["model"]
    counts = Counter(row["status"] for row in data["measurements"])
    lines = [
        f"calibration {data['id']}  ({path})",
        f"  created {data['created_at']} on {hardware['name']} ×{hardware['count']} "
        f"({hardware['memory_bytes'] / 2**30:.1f} GiB), model {model['name']} ({model['parameter_count']:,} parameters)",
        "  setup: " + describe_setup(data),
        "  probes: " + ", ".join(f"{count} {status}" for status, count in sorted(counts.items())),
        "  step: " + describe_step(data.get("training") or {}, data.get("overheads") or {}),
    ]
    trainer = Training.from_record(data.get("training")).trainer
    if trainer is not None:
        lines.append(f"  measured: {trainer.words()}")
    if data.get("slices"):
        lines.append("  " + describe_slices(data["slices"]))
    distributed = data.get("distributed")
    if distributed:
        processes = f"{distributed['world_size']} ({distributed['backend']}, {distributed['sharding']})"
        lines.append(f"  processes: {processes}; {describe_collectives(distributed)}")
    search = data.get("search") or {}
    if search.get("stopped_by_budget"):
        lines.append(
            f"  the budget stopped the benchmark: {len(search.get('left_out', []))} configurations were not probed"
        )
    drift = search.get("drift") or {}
    if drift.get("applied"):
        reference = drift["reference"]
        lines.append(
            f"  drift: the reference probe (batch {reference['micro_batch_size']}, length {reference['seq_len']}) varied "
            f"{drift['spread_pct']:.1f}% over {len(drift['measurements'])} repeats; measurements were rescaled to its median speed"
        )
    for warning in data.get("warnings", []):
        lines.append(f"  warning: {warning}")
    if data.get("fit"):
        lines += ["", "fit:", *(f"  {line}" for line in Calibration(data).explain())]
    best = sorted(
        (row for row in data["measurements"] if row["status"] == "ok"), key=lambda row: -row["tokens_per_second"]
    )[:5]
    lines += ["", "best configurations measured:", format_table(best)]
    history = data.get("history", [])
    if history:
        lines += ["", "how past estimates fared:"]
        for entry in history[-10:]:
            lines.append(
                f"  run {entry.get('run_id', '?')}: predicted {entry.get('predicted_tokens_per_second', 0):,.0f} tok/s, "
                f"actual {entry.get('actual_tokens_per_second', 0):,.0f} tok/s; estimate error "
                f"{describe_estimate_error(estimate_error_pct(entry.get('predicted_total_seconds'), entry.get('actual_total_seconds')))}"
            )
    return lines


if __name__ == "__main__":
    entry_point()
