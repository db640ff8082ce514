"""`bench list`: the stored calibrations, newest first, and the bundled ones."""

from __future__ import annotations

from typing import Any

from common.errors import EXIT_OK


def add_parser(commands: Any) -> None:
    listing = commands.add_parser("list", help="list stored calibrations, newest first")
    listing.add_argument("--debug", action="store_true")
    listing.set_defaults(handler=lambda args: list_command())


def list_command() -> int:
    from calibration.setup import describe_setup
    from calibration.store import bundled_calibrations, calibrations_dir, home_hint, list_calibrations, list_unfinished

    # What benches that died kept of their measurements (never a calibration): named first.
    for path, unfinished, _ in list_unfinished():
        if unfinished is None:
            print(f"unfinished bench {path}: unreadable")
            continue
        rows = unfinished.get("measurements") or []
        ok = sum(1 for row in rows if row.get("status") == "ok")
        started = unfinished.get("created_at", "?")
        print(f"unfinished bench {path}: started {started}, {len(rows)} probes measured ({ok} ok), never stored (not a calibration)")
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
        # What was measured, on a line of its own: the row above is already a terminal wide.
        print(f"{'':<4}{describe_setup(data)}")
    return EXIT_OK
