"""`bench`: measure the trainer's own step on this device and store a calibration.

Heavy imports (torch, transformers) happen inside the handlers so `--help` is instant.
"""

from __future__ import annotations

import argparse
import sys

from bench.commands import data, push, refit, run, show
from bench.commands import list as listing
from bench.commands.run import RUN_EXAMPLES
from common.errors import EXIT_OK, OneLineParser, guard_cli


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="bench",
        description="Measure the training step on this device across a grid and fit a throughput/memory model.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=RUN_EXAMPLES,
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    commands = parser.add_subparsers(dest="command", metavar="{run,list,show,refit,data,push}")

    for command in (run, listing, show, refit, data, push):
        command.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    from common.durations import join_negative_values

    parser = build_parser()
    args = parser.parse_args(join_negative_values(sys.argv[1:] if argv is None else argv))
    if args.command is None:
        parser.print_help()
        return EXIT_OK
    return args.handler(args)


def entry_point() -> None:
    from train.step.runtime import leave

    leave(guard_cli(main))


if __name__ == "__main__":
    entry_point()
