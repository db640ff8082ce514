"""`train --use-calibration latest`: profile the data, plan to the deadline, train, keep the promise."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from benchtrain.calibration.dimensions import switches
from benchtrain.common.console import say
from benchtrain.common.errors import EXIT_OK, OneLineParser, guard_cli
from benchtrain.train.arguments import add_data_arguments, add_method_arguments, add_step_arguments

EXAMPLES = """examples:
  train --use-calibration latest --data sample --deadline 5m            # bundled sample data, tiny preset
  train --data chats.jsonl --model ./my-model --deadline 12h --epochs 3 --priority quality
  train --data sharegpt.jsonl --model Qwen/Qwen2.5-7B-Instruct --lora --deadline 6h   # hub id: the cache first, the hub when online
  train --data alpaca.json --model meta-llama/Llama-3.1-8B-Instruct@main --deadline 3h --dry-run
  train --data ORG/dataset --data-split train --messages-field dialog --deadline 2h  # a hub dataset with its own column name
  train --data train.parquet --deadline 2h --dry-run                    # print the plan only
  train --data chats-600k.jsonl --model llama-3.2-1b --tokenizer tok/ --deadline 12h --dry-run   # a plan from a sample, in seconds
  train --data fineweb/ --token-dtype uint16 --document-separator 50256 --model gpt2 --deadline 6h   # pre-tokenized shards
  train --data train.jsonl --deadline 1h --fit-deadline                 # cut steps to fit the deadline
  train --data train.jsonl --deadline 1h --resume --out runs/my-run     # continue from the last checkpoint (same options)
  train --data train.jsonl --deadline 1h --resume auto --out runs/my-run   # continue if there is a checkpoint, else start
  train --consider h100:8,h200:8 --model llama-3.1-8b --data /data/chats.jsonl --deadline 12h --dry-run --emit skypilot:task.yaml
  train --use-calibration h100-llama-3.2-1b --model llama-3.2-1b --data chats.jsonl --deadline 2h --dry-run   # plan an H100 before renting one
  train --use-calibration all --price-per-hour h100=2.5,h200=3.8 --model llama-3.2-1b --data chats.jsonl --deadline 12h --dry-run   # which GPU?
  train --use-calibration all,hub:my-org/gpu-calibrations --model llama-3.2-1b --data chats.jsonl --deadline 12h --dry-run   # and what others measured
  train --consider h100:1,h100:2:nvlink,h200:1,a100-40gb:4:pcie --price-per-hour h100=2.5,h200=3.8,a100=1.2 \
        --model llama-3.2-1b --data chats.jsonl --deadline 12h --dry-run   # which machine, before renting any
  train --data chats.jsonl --model llama-3.1-8b --lora --gradient-checkpointing auto --deadline 3h
  train --data chats.jsonl --model llama-3.1-8b --lora --deadline 3h     # --quantize/--optimizer auto: the fastest setup bench measured
  train --data chats.jsonl --model mistral-nemo-12b --lora --quantize 4bit --optimizer paged-adamw-8bit --deadline 6h   # QLoRA
  train --data chats.jsonl --model mistral-nemo-12b --lora --deadline 6h --dry-run --device-memory 24GiB   # which base fits a 24 GiB card?
  train --data chats.jsonl --eval-split 0.05 --eval-every 500steps --report-to tensorboard --deadline 3h
  train --data train.jsonl --deadline 1h --compile on --loss chunked     # what the calibration measured (auto: on for CUDA)
  train --data chats.jsonl --model llama-3.1-8b --lora --deadline 3h --push-to-hub my-org/llama-chat --hub-private   # model card from run.json
  train --out runs/my-run --push-to-hub my-org/llama-chat --push-only   # push a finished run again (the retry a failed push prints)
  accelerate launch --num_processes 4 -m benchtrain.train --data train.jsonl --deadline 1h --lr-scaling sqrt --base-batch 16
  train --data train.jsonl --deadline 1h --learning-rate 2e-5 --lr-scheduler-type linear --warmup-steps 100 --weight-decay 0.01
  train --data train.jsonl --deadline 1h --lr-scheduler-type constant_with_warmup --warmup-ratio 0.1 --max-grad-norm 0 --adam-beta2 0.999
  train --data train.jsonl --deadline 1h --optimizer sgd --learning-rate 0.01 --weight-decay 0   # a calibration that measured sgd
  accelerate launch --num_processes 4 -m benchtrain.train --data train.jsonl --model llama-3.1-8b --sharding fsdp --deadline 6h

exit codes:
  0  trained (or, with --dry-run, the plan fits the deadline)
  2  bad input: one line says what and how to fix it
  3  the plan (or a resumed run's steps left) does not fit the deadline (with --dry-run too); the line lists options, or use --fit-deadline
  5  no room on the disk for the run, or a checkpoint save failed (the previous one is intact)
  6  trained, but --push-to-hub failed: final/ is intact and the line says the command that retries the push
  130 interrupted (SIGINT/SIGTERM): the step in flight finishes, a checkpoint is saved and the resume command printed
"""


def build_parser() -> argparse.ArgumentParser:
    from benchtrain.train.planning.types import PRIORITIES
    from benchtrain.train.recipes.config import option_default
    from benchtrain.train.running.guard import OVERRUN_ACTIONS, overrun_help
    from benchtrain.train.step.hyperparameters import DEFAULT_LEARNING_RATE, LR_SCALINGS

    p = OneLineParser(
        prog="train",
        description="Plan batch size, accumulation, workers and max length from a measured calibration, then train before the deadline.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EXAMPLES,
    )
    # What to train: the calibration, the data, the model, the deadline and the shape of the work.
    p.add_argument(
        "--use-calibration",
        metavar="latest|ID|PATH|hub:ORG/NAME[/ID]|A,B,C|all",
        help="calibration to plan with: latest (default; with --resume, the one the run started with), an id, a .json file, "
        "or a bundled one (h100-llama-3.2-1b: a dry run plans for the device a calibration measured), or one shared on the hub "
        "(hub:ORG/NAME/ID, written by `bench push`); with --dry-run, A,B,C, all (the stored and bundled ones of this model and method) "
        "or hub:ORG/NAME (those of that hub repository) compares them: a row each, the cheapest that meets the deadline first",
    )
    p.add_argument(
        "--consider",
        metavar="DEVICE[:GPUS[:LINK]],…",
        help="with --dry-run: one row per machine one might rent (h100:1,h100:2:nvlink,h200:1,a100-40gb:4:pcie), each from the best "
        "source among the calibrations (--use-calibration, default all): measured here, measured by someone (hub), predicted (collectives "
        "by topology), translated (datasheet ratios, same vendor) or not plannable; time and cost bracketed, judged at the upper end",
    )
    p.add_argument(
        "--data",
        required=True,
        metavar="PATH|ORG/NAME",
        help="JSONL/JSON/CSV/Parquet file, saved datasets folder or hub dataset; 'sample' or 'sample-chat' for the bundled data. "
        "Formats: text, messages, sharegpt, alpaca, prompt_completion (detected from the columns)",
    )
    add_data_arguments(p)
    p.add_argument(
        "--model",
        default=option_default("model"),
        metavar="PRESET|DIR|ORG/NAME[@REV]",
        help="preset, model folder, or hub id (the hub cache first; HF_HUB_OFFLINE=1 reads only the cache) (default: %(default)s)",
    )
    p.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="tokenizer folder (default: the model folder's, or the byte tokenizer for presets)",
    )
    p.add_argument(
        "--deadline",
        required=True,
        metavar="DURATION",
        help="wall-clock limit for the whole command: 90s, 15m, 12h, 1h30m",
    )
    epochs = option_default("epochs")
    p.add_argument(
        "--epochs", type=float, default=epochs, help=f"passes over the data (default: {epochs:g}; fractions allowed)"
    )
    p.add_argument(
        "--priority",
        default=option_default("priority"),
        choices=PRIORITIES,
        help="what to optimise (default: %(default)s)",
    )
    p.add_argument(
        "--effective-batch",
        type=int,
        metavar="N",
        help="samples (or packed rows) per optimizer step, held fixed (default: 16)",
    )
    p.add_argument(
        "--max-length",
        default=option_default("max_length"),
        metavar="N|auto",
        help="token limit per sample; auto covers 99.5%% of samples (100%% for quality)",
    )
    p.add_argument(
        "--train-on",
        default=option_default("train_on"),
        choices=("assistant", "all"),
        help="chat data (messages, sharegpt, alpaca): the loss on the assistant's turns (default) or on every token",
    )
    p.add_argument(
        "--exact-profile",
        action="store_true",
        help="tokenize every record before planning (the exact length profile; fills the cache). Default: a cold cache plans from a "
        "random sample sized for a ±1%% token total, and the records are tokenized once, in parallel, when training starts",
    )
    p.add_argument("--workers", type=int, metavar="N", help="force the DataLoader worker count (default: planned)")
    add_method_arguments(p)
    add_step_arguments(p)
    # The run: evaluation, trackers, the run folder, the deadline guard, checkpoints.
    p.add_argument("--eval-data", metavar="PATH", help="held-out data to evaluate on (same formats as --data)")
    p.add_argument(
        "--eval-split",
        type=float,
        metavar="FRACTION",
        help="hold out this share of --data for evaluation (deterministic by --seed)",
    )
    p.add_argument(
        "--eval-every",
        metavar="DURATION|Nsteps",
        help="evaluate every N optimizer steps (500steps) or every DURATION (10m) as well as at the end (default: at the end only)",
    )
    p.add_argument(
        "--report-to",
        default=option_default("report_to"),
        metavar="none|tensorboard|wandb|mlflow|trackio",
        help="experiment trackers, a comma list (default: %(default)s); W&B offline with WANDB_MODE=offline",
    )
    p.add_argument(
        "--merge-lora", action="store_true", help="with --lora: also write the merged full model to final-merged/"
    )
    add_hub_push(p)
    for dimension in switches():  # the step's switches (calibration.dimensions): auto, on or off each
        p.add_argument(
            dimension.plan_flag,
            dest=dimension.name,
            default="auto",
            choices=("auto", "on", "off"),
            help=dimension.plan_help,
        )
    p.add_argument("--out", metavar="DIR", help="run folder (default: $BENCHTRAIN_HOME/runs/<run id>)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and stop")
    p.add_argument(
        "--device-memory",
        metavar="SIZE",
        help="plan for a device with this much memory (24GiB, 48G, 80GB; plain numbers are GiB): e.g. a 24 GiB card from an H100 "
        "calibration, told which bases (none/8bit/4bit) fit",
    )
    p.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        choices=("auto",),
        help="continue the run in --out from its last checkpoint: its configuration, steps and learning-rate schedule (a finished run is not resumed); "
        "--resume auto: continue it if it has a complete checkpoint, else start it, the deadline counted from its first start (what a "
        "rented machine runs, so a restart after a preemption continues)",
    )
    p.add_argument(
        "--on-overrun",
        default=option_default("on_overrun"),
        choices=tuple(OVERRUN_ACTIONS),
        help=overrun_help(),
    )
    p.add_argument(
        "--fit-deadline",
        action="store_true",
        help="if the plan does not fit, cut the number of steps so that it does (planned with the shortened run's own checkpoints and export)",
    )
    p.add_argument(
        "--measure-budget",
        default=option_default("measure_budget"),
        metavar="DURATION",
        help="when the plan needs what the calibration never measured (a max length longer than its lengths, an accumulation "
        "or worker count outside them), measure it first within this (`bench run --extend`: priced and said before it runs, "
        "under --dry-run too; stored as a new calibration, the old one left as it was) (default: %(default)s)",
    )
    p.add_argument(
        "--no-measure",
        action="store_true",
        help="plan from the calibration as it is, extrapolating where the data needs what it never measured",
    )
    p.add_argument(
        "--max-steps", type=int, metavar="N", help="stop after N optimizer steps (with --resume: at most the run's own)"
    )
    p.add_argument(
        "--checkpoint-interval",
        default=option_default("checkpoint_interval"),
        metavar="DURATION",
        help="time between checkpoints (default: %(default)s)",
    )
    p.add_argument(
        "--keep-checkpoints",
        type=int,
        default=option_default("keep_checkpoints"),
        metavar="N",
        help="checkpoints kept (default: %(default)s)",
    )
    p.add_argument(
        "--margin",
        type=float,
        default=option_default("margin"),
        metavar="FRACTION",
        help="share of the deadline held back as safety margin (default: %(default)s)",
    )
    # The plan and the learning rate: cost, output, learning rate, seed and the escape hatches.

    p.add_argument(
        "--price-per-hour",
        metavar="USD|DEVICE=USD,…|FILE",
        help="price per device-hour (one device per process) to show the cost: 2.5 for every device, h100=2.5,h200=3.8 "
        "per device (words of its name, or a calibration id), or a file of such pairs",
    )
    p.add_argument(
        "--json", action="store_true", help="with --dry-run: print the plan (or the comparison of calibrations) as JSON"
    )
    p.add_argument(
        "--emit",
        metavar="ENGINE:FILE",
        help="with --dry-run: write the task that runs the plan on the recommended machine, the other rows that meet the deadline as "
        "fallbacks, for skypilot (sky launch / sky jobs launch FILE) or dstack (dstack apply -f FILE); docs/launch.md",
    )
    p.add_argument(
        "--for-trainer",
        action="store_true",
        help="with --dry-run: the plan as your own Trainer's TrainingArguments / TRL SFTConfig fields (JSON with --json) and a Python snippet",
    )
    p.add_argument(
        "--learning-rate",
        type=float,
        metavar="LR",
        help=f"peak learning rate at --base-batch (default: {DEFAULT_LEARNING_RATE:.0e}; with --resume: the run's)".replace(
            "e-0", "e-"
        ),
    )
    p.add_argument(
        "--lr-scaling",
        choices=LR_SCALINGS,
        default=option_default("lr_scaling"),
        help="scale the learning rate with effective batch / --base-batch (effective = micro-batch × processes × accumulation)",
    )
    p.add_argument(
        "--base-batch",
        type=int,
        metavar="N",
        help="the effective batch --learning-rate was tuned for (default: the planned one)",
    )
    add_hyperparameters(p)
    p.add_argument("--seed", type=int, default=option_default("seed"))
    p.add_argument(
        "--force",
        action="store_true",
        help="use a calibration made for another device or model; --resume with other data, model, method or max length than the run's",
    )
    p.add_argument("--no-report", action="store_true", help="skip the HTML/PNG report")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def add_hub_push(p: argparse.ArgumentParser) -> None:
    """--push-to-hub and its options: checked before any work, pushed after training."""
    p.add_argument(
        "--push-to-hub",
        metavar="ORG/NAME",
        help="after training, upload final/ (final-merged/ with --merge-lora) and a model card to this hub repository; "
        "the token and the hub are checked before any work, and the upload is part of the plan",
    )
    p.add_argument("--hub-private", action="store_true", help="with --push-to-hub: create the repository private")
    p.add_argument(
        "--hub-revision", metavar="BRANCH", help="with --push-to-hub: push to this branch (created if missing)"
    )
    p.add_argument(
        "--push-only",
        action="store_true",
        help="with --push-to-hub and --out RUN: push that finished run's model again (no training)",
    )


def add_hyperparameters(p: argparse.ArgumentParser) -> None:
    """The schedule's and the optimizer's hyper-parameters, as HF TrainingArguments names them (not named: the default)."""
    from benchtrain.train.step.hyperparameters import (
        DEFAULT_BETAS,
        DEFAULT_EPSILON,
        DEFAULT_MAX_GRAD_NORM,
        DEFAULT_WARMUP_RATIO,
        DEFAULT_WEIGHT_DECAY,
        SCHEDULER_CHOICES,
    )

    p.add_argument(
        "--lr-scheduler-type",
        choices=SCHEDULER_CHOICES,
        help="after the warm-up: cosine (default) or linear decay to 0, constant_with_warmup; constant has no warm-up",
    )
    p.add_argument(
        "--warmup-ratio",
        type=float,
        metavar="FRACTION",
        help=f"share of the optimizer steps warming up linearly from 0 (default: {DEFAULT_WARMUP_RATIO})",
    )
    p.add_argument("--warmup-steps", type=int, metavar="N", help="optimizer steps warming up: overrides --warmup-ratio")
    p.add_argument(
        "--weight-decay",
        type=float,
        metavar="W",
        help=f"decoupled weight decay on matrices, none on biases and norms (default: {DEFAULT_WEIGHT_DECAY})",
    )
    p.add_argument(
        "--max-grad-norm",
        type=float,
        metavar="NORM",
        help=f"clip the gradients' global norm to this; 0: no clipping (default: {DEFAULT_MAX_GRAD_NORM})",
    )
    p.add_argument("--adam-beta1", type=float, metavar="B1", help=f"AdamW's beta1 (default: {DEFAULT_BETAS[0]})")
    p.add_argument("--adam-beta2", type=float, metavar="B2", help=f"AdamW's beta2 (default: {DEFAULT_BETAS[1]})")
    p.add_argument("--adam-epsilon", type=float, metavar="EPS", help=f"AdamW's epsilon (default: {DEFAULT_EPSILON:g})")


def push_parser() -> argparse.ArgumentParser:
    """`train --out RUN --push-to-hub ORG/NAME --push-only`: the options a push of a finished run takes."""
    p = OneLineParser(
        prog="train --push-only", description="Push a finished run's final/ and its model card to the hub."
    )
    p.add_argument("--out", required=True, metavar="DIR", help="the run folder")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    add_hub_push(p)
    return p


def full_option_names(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`argv` with each abbreviated option (`--dry` for --dry-run) under its full name, as argparse resolved it: what
    reads the command line again (the launch task's node command, the resume command) finds every option by name."""
    names = parser._option_string_actions
    full: list[str] = []
    for index, token in enumerate(argv):
        if token == "--":
            return [*full, *argv[index:]]
        name, equals, value = token.partition("=")
        if name.startswith("--") and name not in names:
            matches = [option for option in names if option.startswith(name)]
            name = matches[0] if len(matches) == 1 else name  # argparse refused an ambiguous one already
        full.append(f"{name}{equals}{value}")
    return full


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    from benchtrain.common.durations import join_negative_values

    argv = sys.argv[1:] if argv is None else argv
    if "--push-only" in argv:  # a finished run's model to the hub: no data, deadline or plan
        from benchtrain.train.recipes.hub_push import push_existing_run

        return push_existing_run(push_parser().parse_args(argv))
    parser = build_parser()
    args = parser.parse_args(join_negative_values(argv))
    args.command_line = full_option_names(parser, list(argv))  # for the resume command printed after a stop
    from benchtrain.train.running.resume import what_to_continue

    continuation = what_to_continue(args.resume, args.out, args.dry_run, started)
    # the same command again after the run ended (an engine that restarts a task): nothing to do
    if continuation.finished:
        say(
            f"--resume auto: the run in {args.out} already ended ({continuation.finished}): its model is in {args.out}/final; nothing to resume"
        )
        return EXIT_OK
    from benchtrain.train.recipes.config import is_comparison

    if args.consider and args.use_calibration is None:
        args.use_calibration = "all"  # the machines are planned from every calibration there is
    if is_comparison(args.use_calibration) or args.consider:
        from benchtrain.train.compare_command import run_comparison

        return run_comparison(args, started, continuation)
    from benchtrain.train.launch_command import emit_task
    from benchtrain.train.recipes.recipe import run_training

    return run_training(args, started, continuation, write_run_report, emit_task)


def write_run_report(out_dir: Path) -> Path:
    from benchtrain.reports.run_report import write_run_report

    return write_run_report(out_dir)


def entry_point() -> None:
    from benchtrain.train.step.runtime import leave

    # Everything is written and every rank has finished (train.step.runtime.finish_together).
    leave(guard_cli(main))


if __name__ == "__main__":
    entry_point()
