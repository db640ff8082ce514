"""Planning before renting (issue 22): a dry run plans for the device the calibration measured —
its memory, its peak FLOP/s — and the real H100 calibration ships with benchtrain."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import assert_one_line_error, run_main

from benchtrain.calibration.store import BUNDLED_DIR, bundled_calibrations, resolve_calibration

FIXTURES = Path(__file__).parent / "fixtures"
H100 = "h100-llama-3.2-1b"


def test_the_real_h100_calibration_ships_with_the_package() -> None:
    bundled = bundled_calibrations()
    assert bundled[H100] == BUNDLED_DIR / f"{H100}.json"
    # The measurement itself, as the fixture (and /work/shared/gpu) hold it.
    assert bundled[H100].read_bytes() == (FIXTURES / "h100-llama-3.2-1b-fullgrid.json").read_bytes()
    # Package data, not only a test file.
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert '"benchtrain.calibration.bundled" = ["*.json"]' in pyproject
    assert resolve_calibration(H100) == bundled[H100]


def test_a_dry_run_with_the_h100_calibration_plans_for_the_h100(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It checked memory against this CPU ("this device has 24 GiB") and refused without --force."""
    code, out, err = run_main(
        "train",
        ["--use-calibration", H100, "--model", "llama-3.2-1b", "--data", "sample", "--deadline", "1h", "--dry-run"],
        capsys,
    )
    assert code == 0, err
    assert "NVIDIA H100 80GB HBM3" in err and json.loads(bundled_calibrations()[H100].read_text())["id"] in err
    assert "of the 79.18 GiB" in out and "has 79 GiB" in out  # the H100's memory, not this CPU's
    assert "MFU" in out and "of the H100 SXM's 989 TFLOP/s" in out  # the H100's peak, not this CPU's (none)
    assert "tokens are bytes" in out  # presets count bytes, and the plan says so
    # A model that does not fit an H100 is refused on the H100's memory, not this machine's.
    nemo = [
        "--use-calibration",
        H100,
        "--model",
        "mistral-nemo-12b",
        "--data",
        "sample",
        "--deadline",
        "1h",
        "--dry-run",
        "--force",
    ]
    code, _, err = run_main("train", nemo, capsys)
    assert_one_line_error(code, err, "this NVIDIA H100 80GB HBM3 has 79 GiB: use --lora")


def test_training_with_a_calibration_of_another_device_still_needs_force(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_main(
        "train", ["--use-calibration", H100, "--model", "llama-3.2-1b", "--data", "sample", "--deadline", "1h"], capsys
    )
    assert_one_line_error(code, err, "was measured on NVIDIA H100 80GB HBM3")


def test_runs_never_write_into_the_bundled_calibration() -> None:
    from benchtrain.calibration.model import Calibration
    from benchtrain.calibration.schema import read_calibration_file
    from benchtrain.calibration.store import update_calibration
    from benchtrain.common.errors import BenchtrainError
    from benchtrain.train.running.record import feed_back

    path = bundled_calibrations()[H100]
    before = path.read_bytes()
    record = {
        "run_id": "r",
        "plan": {"optimizer_steps": 1},
        "estimate": {"total_seconds": 2.0, "train_seconds": 1.0, "steps": 1},
        "actual": {"status": "completed", "total_seconds": 2.0},
        "losses": [{"step": 1, "seconds": 1.0, "predicted_seconds": 1.0, "tokens": 10}],
    }
    feed_back(Calibration(read_calibration_file(path), path), record)
    with pytest.raises(BenchtrainError, match="ships with benchtrain"):
        update_calibration(path, lambda data: None)
    assert path.read_bytes() == before
