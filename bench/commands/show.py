"""`bench show`: explain a calibration (fit, error, best configurations), or print its JSON."""

from __future__ import annotations

import json
import sys
from typing import Any

from common.errors import EXIT_OK


def add_parser(commands: Any) -> None:
    show = commands.add_parser("show", help="explain a calibration: fit, error, best configurations")
    show.add_argument("reference", nargs="?", default="latest", metavar="latest|ID|PATH")
    show.add_argument("--json", action="store_true", help="print the calibration JSON")
    show.add_argument("--debug", action="store_true")
    show.set_defaults(handler=lambda args: show_command(args.reference, args.json))


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
    from calibration.schema import variant_data
    from calibration.setup import variant_name, variant_of

    # Each variant the calibration measured (bench run --quantize none,4bit …), the first first.
    for index in (None, *range(len(data.get("variants") or []))):
        if index is not None:
            entry = variant_data(data, index)
            print(f"\nvariant {index + 1}: {variant_name(*variant_of(entry))}")
        print("\n".join(describe_calibration(variant_data(data, index), str(path))))
    return EXIT_OK
