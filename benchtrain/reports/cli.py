"""`report RUN_DIR|CALIBRATION`: write report.html and its PNG figures."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchtrain.common.errors import EXIT_OK, OneLineParser, guard_cli

EXAMPLES = """examples:
  report ~/.benchtrain/runs/tiny-20261121-140141     # a run: estimate vs actual
  report latest                                      # the newest calibration
  report cpu-tiny-20261121-135852 --out /tmp/cal     # a calibration by id, into a folder
  report ~/.benchtrain/plans/llama-3.2-1b-20261123-120000   # a comparison of calibrations (train --dry-run --use-calibration A,B)
"""


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="report",
        description="Write a self-contained HTML report (and PNG figures) for a run folder or a calibration.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EXAMPLES,
    )
    parser.add_argument(
        "target",
        metavar="RUN_DIR|CALIBRATION",
        help="a run folder (with run.json), or latest / a calibration id / a calibration JSON path",
    )
    parser.add_argument(
        "--out", metavar="DIR", help="folder for a calibration report (default: beside the calibration)"
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    target = Path(args.target).expanduser()
    if target.name == "run.json" and target.is_file():
        target = target.parent
    if target.is_dir() and (target / "comparison.json").is_file() and not (target / "run.json").is_file():
        # a dry run's comparison of calibrations
        from benchtrain.reports.comparison_report import (
            write_comparison_report,
        )

        path = write_comparison_report(target)
    elif target.is_dir():
        from benchtrain.reports.run_report import write_run_report

        path = write_run_report(target)
    else:
        from benchtrain.calibration.store import home_hint, resolve_calibration
        from benchtrain.common.errors import BenchtrainError
        from benchtrain.reports.calibration_report import write_calibration_report

        try:
            calibration_path = resolve_calibration(args.target)
        except BenchtrainError as error:
            if args.target == "latest" or target.exists():
                raise
            raise BenchtrainError(
                f"{args.target} is neither a run folder nor a calibration: pass a run folder (with run.json), latest, "
                f"a calibration id (`bench list`) or a calibration .json{home_hint()}"
            ) from error
        path = write_calibration_report(calibration_path, Path(args.out) if args.out else None)
    print(path)
    return EXIT_OK


def entry_point() -> None:
    sys.exit(guard_cli(main))


if __name__ == "__main__":
    entry_point()
