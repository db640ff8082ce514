"""`bench refit`: fit a stored calibration's measurements again with this version's model (bench.record)."""

from __future__ import annotations

import sys
from typing import Any

from common.errors import EXIT_OK


def add_parser(commands: Any) -> None:
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
    from bench.describe import describe_calibration
    from bench.record import refit_record
    from calibration.schema import read_calibration_file
    from calibration.store import resolve_calibration, save_calibration

    path = resolve_calibration(reference, on_skip=lambda message: print(f"warning: {message}", file=sys.stderr))
    source = read_calibration_file(path)
    record = refit_record(source)
    saved = save_calibration(record)
    print("\n".join(describe_calibration(record, str(saved))))
    before = (source.get("fit") or {}).get("held_out_error", {}).get("median_abs_pct")
    after = record["fit"]["held_out_error"]["median_abs_pct"]
    was = f"{before:.1f}%" if before is not None else "no fit"
    print(f"\nrefit of {source['id']}: held-out median error {was} → {after:.1f}% ({record['fit']['kind']}); stored as {record['id']}")
    return EXIT_OK
