"""A measurement someone paid for is never lost: a calibration older than the schemas read today is refused for
planning in one line that says to measure again or to re-fit it, and `bench refit ID|PATH` reads its probes (rows of
today's shape since schema 2) and stores a new calibration at today's schema that plans; the old file is untouched."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import FIXTURE, assert_one_line_error, dry_run, run_main

from benchtrain.calibration.schema import REFITTABLE_FROM, SCHEMA_VERSION, read_calibration_file, read_for_refit
from benchtrain.common.errors import CalibrationTooOldError

FIXTURES = Path(__file__).parent / "fixtures"
# tests/fixtures/cpu-tiny-fullgrid.json as schema 2 wrote it: its memory fit without the accumulated gradients and
# the optimizer step's floor (schema 3), the basis and the bytes outside the allocator (schema 4).
CPU_SCHEMA_2 = FIXTURES / "cpu-tiny-fullgrid-schema2.json"


def as_schema_2(data: dict) -> dict:
    """A calibration as schema 2 wrote it: what schemas 3 and 4 added taken out of its memory fit and probes."""
    old = json.loads(json.dumps(data))
    old["schema_version"] = 2
    memory = old["fit"]["memory"]
    for name in ("basis", "non_torch_bytes"):
        memory.pop(name, None)
    for name in ("accumulated_gradients", "optimizer_floor"):
        memory["parameters"].pop(name, None)
    for row in old["measurements"]:
        for name in ("peak_reserved_bytes", "non_torch_bytes"):
            row.pop(name, None)
    return old


def stored(home: Path) -> list[Path]:
    return sorted((home / "calibrations").glob("*.json"))


def test_the_fixture_is_the_current_one_as_schema_2_wrote_it() -> None:
    assert json.loads(CPU_SCHEMA_2.read_text()) == as_schema_2(
        json.loads((FIXTURES / "cpu-tiny-fullgrid.json").read_text())
    )


def test_an_old_calibration_is_refused_for_planning_naming_the_refit(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(CalibrationTooOldError) as refused:
        read_calibration_file(CPU_SCHEMA_2)
    message = str(refused.value)
    assert "\n" not in message and "schema_version 2, older than this benchtrain reads" in message
    assert message.endswith(
        f"measure again with `bench run`, or `bench refit {CPU_SCHEMA_2}` to re-fit its probes at schema {SCHEMA_VERSION}"
    )
    code, _, err = run_main("bench", ["show", str(CPU_SCHEMA_2)], capsys)
    assert_one_line_error(code, err, "or `bench refit")
    # In the store, the refusal names it by its id.
    in_store = home / "calibrations" / "cpu-tiny-20261123-060535.json"
    in_store.parent.mkdir(parents=True)
    shutil.copy(CPU_SCHEMA_2, in_store)
    with pytest.raises(CalibrationTooOldError, match="`bench refit cpu-tiny-20261123-060535` to re-fit its probes"):
        read_calibration_file(in_store)


def test_bench_refit_by_id_writes_a_calibration_at_todays_schema_and_leaves_the_old_one(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = json.loads(CPU_SCHEMA_2.read_text())
    in_store = home / "calibrations" / f"{source['id']}.json"
    in_store.parent.mkdir(parents=True)
    shutil.copy(CPU_SCHEMA_2, in_store)
    code, out, err = run_main("bench", ["refit", source["id"]], capsys)
    assert code == 0, err
    assert in_store.read_bytes() == CPU_SCHEMA_2.read_bytes()  # untouched
    (new,) = [path for path in stored(home) if path != in_store]
    refitted = read_calibration_file(new)  # read for planning
    assert refitted["schema_version"] == SCHEMA_VERSION and refitted["refit_of"] == source["id"]
    assert refitted["id"] == new.stem != source["id"] and new.with_suffix(".csv").is_file()
    assert refitted["measurements"] == source["measurements"]  # the probes as measured
    assert (
        refitted["fit"]["memory"]["basis"] == "allocated"
        and "optimizer_floor" in refitted["fit"]["memory"]["parameters"]
    )
    assert f"refit of {source['id']}: held-out median error schema 2's fit set aside" in out
    assert f"stored as {refitted['id']} at schema {SCHEMA_VERSION}" in out


def test_the_h100_probes_at_schema_2_are_refused_for_a_plan_then_refit_and_planned_with(
    home: Path, chats: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A rented H100's probes from two weeks ago: `train --dry-run` refuses them in one line that names the refit;
    `bench refit PATH` stores a calibration at today's schema that `train --dry-run --use-calibration ID` plans with."""
    old = tmp_path / "h100-two-weeks-ago.json"
    old.write_text(json.dumps(as_schema_2(json.loads(FIXTURE.read_text()))))
    argv = ["--model", "llama-3.2-1b", "--data", str(chats), "--no-report"]
    code, _, err = dry_run(capsys, *argv, "--use-calibration", str(old))
    assert_one_line_error(
        code,
        err,
        f"measure again with `bench run`, or `bench refit {old}` to re-fit its probes at schema {SCHEMA_VERSION}",
    )

    code, out, err = run_main("bench", ["refit", str(old)], capsys)
    assert code == 0, err
    (new,) = stored(home)
    refitted = read_calibration_file(new)
    assert refitted["schema_version"] == SCHEMA_VERSION and refitted["refit_of"] == json.loads(old.read_text())["id"]
    code, out, err = dry_run(capsys, *argv, "--use-calibration", refitted["id"])
    assert code == 0, err
    assert refitted["id"] in out


def test_schema_1_probes_are_not_refit(tmp_path: Path) -> None:
    """Schema 1 stored a probe's mean step where today's rows hold the median: nothing to re-fit, measure again."""
    assert REFITTABLE_FROM == 2
    old = as_schema_2(json.loads(CPU_SCHEMA_2.read_text()))
    old["schema_version"] = 1
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(old))
    with pytest.raises(CalibrationTooOldError) as refused:
        read_for_refit(path)
    assert str(refused.value).endswith("measure again with `bench run`") and "refit" not in str(refused.value)
