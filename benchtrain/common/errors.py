"""User-facing errors and the guard every console script runs inside.

A `BenchtrainError` is a problem with the user's input or environment: it is shown as one line
that names the problem and the fix, with exit code 2 and no traceback (unless `--debug`).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Callable, Sequence
from typing import NamedTuple, NoReturn

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_DEADLINE = 3
EXIT_NO_FIT = 4
EXIT_DISK = 5
EXIT_PUSH_FAILED = 6  # trained; the push to the hub failed (final/ intact, the retry command said)
EXIT_INTERRUPTED = 130


class BenchtrainError(Exception):
    """A problem the user can fix; its message is one line."""

    exit_code = EXIT_USAGE


class DoesNotFitError(BenchtrainError):
    """Nothing the plan could choose fits the device's memory."""


class CalibrationFileError(BenchtrainError):
    """A calibration file that cannot be read: corrupt, incomplete or from a future version."""


class CalibrationTooOldError(CalibrationFileError):
    """A calibration file of a schema version this benchtrain no longer reads (it names the version)."""


class RunFileError(BenchtrainError):
    """A run.json that cannot be read: not JSON, or a key the code reads missing or of another type."""


class MeasurementError(BenchtrainError):
    """A benchmark that measured too little to fit a model: nothing usable was stored."""

    exit_code = EXIT_NO_FIT


class DeadlineError(BenchtrainError):
    """Nothing fits the deadline."""

    exit_code = EXIT_DEADLINE


class DiskSpaceError(BenchtrainError):
    """Too little room on the disk for what is about to be written."""

    exit_code = EXIT_DISK


def guard_cli(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Run a CLI entry point, turning known errors into one line and an exit code."""
    args = sys.argv[1:] if argv is None else argv
    debug = "--debug" in args
    try:
        return main(args)
    except BenchtrainError as error:
        if debug:
            raise
        print(f"error: {first_line(str(error))}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as error:
        if debug:
            raise
        print(
            f"internal error: {type(error).__name__}: {first_line(str(error))} (run again with --debug for the traceback)",
            file=sys.stderr,
        )
        return EXIT_INTERNAL


def first_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else "unknown error"


class KnownArguments(NamedTuple):
    """What argparse's parse_known_args returns, by name: the options it knew and the tokens it did not."""

    namespace: argparse.Namespace
    extras: list[str]


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line (a BenchtrainError for guard_cli) instead of the usage
    block, with a did-you-mean for a mistyped option: `--dealine` → `--deadline`."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> KnownArguments:
        # Narrower than argparse's overloads on purpose: no command here passes its own namespace class.
        self._given = [str(token) for token in (sys.argv[1:] if args is None else args)]
        return KnownArguments(*super().parse_known_args(args, namespace))

    def error(self, message: str) -> NoReturn:
        raise BenchtrainError(f"{message}{self._did_you_mean()}; `{self.prog} --help` lists the options")

    def _options(self) -> list[str]:
        """Every option this command knows, its subcommands' too (their unknown arguments end up here)."""
        names = list(self._option_string_actions)
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for parser in action.choices.values():
                    names += (
                        parser._options() if isinstance(parser, OneLineParser) else list(parser._option_string_actions)
                    )
        return sorted(set(names))

    def _did_you_mean(self) -> str:
        known = self._options()
        hints = []
        for token in getattr(self, "_given", []):
            option = token.split("=", 1)[0]
            if not option.startswith("--") or option in known or any(name.startswith(option) for name in known):
                continue
            close = difflib.get_close_matches(option, known, n=1, cutoff=0.6)
            if close:
                hints.append(f"{option}: did you mean {close[0]}?")
        return f" ({'; '.join(hints)})" if hints else ""
