"""`bench`: measure the trainer's own step on this device and store a calibration.

Heavy imports (torch, transformers) happen inside the handlers so `--help` is instant.
"""

from __future__ import annotations

import argparse
import json
import sys

from common.errors import EXIT_OK, OneLineParser, guard_cli
from train.step.engine import add_step_arguments
from train.workload.formats import add_data_arguments
from train.workload.method import add_method_arguments

RUN_EXAMPLES = """examples:
  bench run --gpu cpu --budget 150s                 # tiny preset, CPU-sized grid, 2.5 minutes
  bench run --gpu h100 --model llama-3.2-1b         # a 1B-class shape on an H100
  bench run --batch-sizes 1,2,4 --workers 0,2 --accum 1,2 --seq-lens 256,512
  bench run --search optuna --trials 20 --budget 10m  # sample the space; resumes if interrupted
  bench run --gpu h100 --model llama-3.1-8b --lora --checkpointing off,on --budget 5m
  bench run --gpu h100 --model mistral-nemo-12b --lora --budget auto   # the budget for a dozen probes, said up front
  bench run --data train.jsonl --model ./my-model   # real tokens from your data, lengths from its profile
  bench run --gpu h100 --model Qwen/Qwen2.5-7B-Instruct   # a hub id: config.json only, from the cache or the hub
  bench refit latest                                 # fit stored measurements again with this version's model
  bench run --gpu cpu --compile on                   # measure the compiled step (default on CUDA) and its compile time
  accelerate launch --num_processes 4 -m bench run --gpu h200   # a 4-process calibration with its all-reduce model
  accelerate launch --num_processes 4 -m bench run --gpu h200 --model llama-3.1-8b --sharding fsdp   # full fine-tuning sharded

exit codes: 0 stored a calibration; 2 bad input; 4 too few probes succeeded to fit a model (nothing stored)
"""


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="bench",
        description="Measure the training step on this device across a grid and fit a throughput/memory model.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=RUN_EXAMPLES,
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    commands = parser.add_subparsers(dest="command", metavar="{run,list,show,refit}")

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
    add_method_arguments(run)
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

    listing = commands.add_parser("list", help="list stored calibrations, newest first")
    listing.add_argument("--debug", action="store_true")

    show = commands.add_parser("show", help="explain a calibration: fit, error, best configurations")
    show.add_argument("reference", nargs="?", default="latest", metavar="latest|ID|PATH")
    show.add_argument("--json", action="store_true", help="print the calibration JSON")
    show.add_argument("--debug", action="store_true")

    refit = commands.add_parser(
        "refit",
        help="fit a stored calibration's measurements again with this version's model; stores a new calibration",
        description="Re-fit the measurements of a stored calibration with the current fitting code (measurements unchanged) and store "
        "the result as a new calibration whose refit_of names the source.",
    )
    refit.add_argument("reference", nargs="?", default="latest", metavar="latest|ID|PATH")
    refit.add_argument("--debug", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    from common.durations import join_negative_values

    parser = build_parser()
    args = parser.parse_args(join_negative_values(sys.argv[1:] if argv is None else argv))
    if args.command is None:
        parser.print_help()
        return EXIT_OK
    if args.command == "run":
        from bench.run_command import run_command

        return run_command(args)
    if args.command == "list":
        return list_command()
    if args.command == "refit":
        from bench.refit import refit_command

        return refit_command(args.reference)
    return show_command(args.reference, args.json)


def list_command() -> int:
    from calibration.store import bundled_calibrations, calibrations_dir, home_hint, list_calibrations

    entries = list_calibrations()
    # The bundled ones are addressed by name: plan for a device before renting it (--dry-run).
    bundled = ", ".join(bundled_calibrations())
    if not entries:
        print(f"no calibrations in {calibrations_dir()}: run `bench run`{home_hint()}; bundled, to plan with: {bundled}")
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
        print(f"{data['id']:<44} {data['created_at']}  {data['hardware']['name'][:28]:<28}  {data['model']['name']:<14} {ok:>3} ok probes, {error_text}")
    return EXIT_OK


def show_command(reference: str, as_json: bool) -> int:
    from calibration.schema import read_calibration_file
    from calibration.store import resolve_calibration

    path = resolve_calibration(reference, on_skip=lambda message: print(f"warning: {message}", file=sys.stderr))
    data = read_calibration_file(path)
    if as_json:
        json.dump(data, sys.stdout, indent=2)
        print()
        return EXIT_OK
    from bench.describe import describe_calibration

    print("\n".join(describe_calibration(data, str(path))))
    return EXIT_OK


def entry_point() -> None:
    from train.step.runtime import leave

    leave(guard_cli(main))


if __name__ == "__main__":
    entry_point()
