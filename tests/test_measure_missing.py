"""`train` measures the lengths its plan needs and the calibration never measured (`bench run --extend` in a child
process) before planning, within --measure-budget; --no-measure plans as before; the old calibration is left as it was."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from helpers import run_main

from benchtrain.calibration.schema import read_calibration_file

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def short_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A BENCHTRAIN_HOME holding a real calibration of the tiny model on this machine, measured at lengths 32 and 64 only."""
    from benchtrain.bench.cli import main
    from benchtrain.common.errors import guard_cli

    home = tmp_path_factory.mktemp("short") / "home"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BENCHTRAIN_HOME", str(home))
        argv = ["run", "--batch-sizes", "1,2", "--workers", "0", "--accum", "1,2", "--seq-lens", "32,64"]
        assert guard_cli(main, [*argv, "--no-report", "--quiet"]) == 0  # the whole grid: 8 probes
    return home


@pytest.fixture()
def calibrated(short_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the short calibration's home for this test; returns the calibration's file."""
    home = tmp_path / "home"
    shutil.copytree(short_home, home)
    monkeypatch.setenv("BENCHTRAIN_HOME", str(home))
    (path,) = (home / "calibrations").glob("*.json")
    return path


@pytest.fixture()
def long_chats(tmp_path: Path) -> Path:
    """Chats whose samples need 250–300 tokens (bytes): past every length the calibration measured."""
    rng = random.Random(3)
    path = tmp_path / "long.jsonl"
    with path.open("w") as handle:
        for _ in range(64):
            answer = "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(200, 250)))
            messages = [{"role": "user", "content": "say it"}, {"role": "assistant", "content": answer}]
            handle.write(json.dumps({"messages": messages}) + "\n")
    return path


def plan(capsys: pytest.CaptureFixture[str], data: Path, calibration: Path, *more: str) -> tuple[dict, str]:
    argv = ["--dry-run", "--json", "--deadline", "2h", "--data", str(data), "--use-calibration", str(calibration)]
    code, out, err = run_main("train", [*argv, *more], capsys)
    assert code == 0, err
    return json.loads(out), err


def test_a_dry_run_measures_the_lengths_the_data_needs(
    calibrated: Path, long_chats: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = calibrated.read_bytes()
    old = read_calibration_file(calibrated)
    without, _ = plan(capsys, long_chats, calibrated, "--no-measure")
    assert without["plan"]["chosen"]["max_length"] > 64  # the data needs what was never measured

    measured, err = plan(capsys, long_chats, calibrated, "--measure-budget", "90s")

    said = [line for line in err.splitlines() if "measuring" in line and "first" in line]
    assert len(said) == 1 and "measured lengths up to 64" in said[0] and "--no-measure" in said[0], err
    assert calibrated.read_bytes() == before  # the old calibration untouched, byte for byte
    assert measured["calibration_id"] != old["id"]
    new = read_calibration_file(Path(measured["calibration_path"]))
    assert new["extends"] == old["id"]
    length = measured["plan"]["chosen"]["max_length"]
    added = [row for row in new["measurements"] if row.get("extends") == old["id"] and row["status"] == "ok"]
    assert added and all(row["seq_len"] > 64 for row in added)
    assert any(row["seq_len"] >= length for row in added)
    assert len(new["measurements"]) == len(old["measurements"]) + len(
        [row for row in new["measurements"] if row.get("extends")]
    )
    assert measured["plan"]["bound_fraction"] < without["plan"]["bound_fraction"]


def test_no_measure_plans_as_before(calibrated: Path, long_chats: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result, err = plan(capsys, long_chats, calibrated, "--no-measure")
    assert result["calibration_id"] == read_calibration_file(calibrated)["id"]
    assert "measuring" not in err
    assert len(list(calibrated.parent.glob("*.json"))) == 1  # nothing stored
    assert any("extrapolates" in note for note in result["plan"]["notes"])


def test_a_budget_too_small_says_so_and_plans_as_before(
    calibrated: Path, long_chats: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    without, _ = plan(capsys, long_chats, calibrated, "--no-measure")
    result, err = plan(capsys, long_chats, calibrated, "--measure-budget", "0.01s")
    said = [line for line in err.splitlines() if "--measure-budget" in line]
    assert len(said) == 1 and "more than --measure-budget" in said[0] and "planning without it" in said[0], err
    assert result["calibration_id"] == without["calibration_id"]
    assert result["plan"]["bound_fraction"] == without["plan"]["bound_fraction"]
    assert len(list(calibrated.parent.glob("*.json"))) == 1
    assert any("extrapolates" in note for note in result["plan"]["notes"])


def test_a_bad_measure_budget_is_one_line(long_chats: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(
        "train", ["--dry-run", "--deadline", "1h", "--data", str(long_chats), "--measure-budget", "soon"], capsys
    )
    assert code == 2 and "--measure-budget" in err and "Traceback" not in err
