"""Experiment trackers through accelerate (issue 11): TensorBoard read back, W&B offline, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import assert_one_line_error, run_main

TRAIN = ["--deadline", "30m", "--effective-batch", "4", "--max-steps", "4", "--no-report"]


def test_tensorboard_events_hold_the_loss_series(
    calibrated_home: Path, heavy_tailed_jsonl: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    code, _, err = run_main(
        "train",
        ["--data", str(heavy_tailed_jsonl), *TRAIN, "--eval-split", "0.1", "--report-to", "tensorboard"],
        capsys,
    )
    assert code == 0, err
    run_dir = next((calibrated_home / "runs").iterdir())
    record = json.loads((run_dir / "run.json").read_text())
    events = sorted((run_dir / "tensorboard").rglob("events.out.tfevents.*"))
    assert events
    scalars: dict[str, list] = {}
    for path in events:
        accumulator = EventAccumulator(str(path))
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend(accumulator.Scalars(tag))
    losses = sorted(scalars["train/loss"], key=lambda event: event.step)
    assert [event.step for event in losses] == [1, 2, 3, 4]
    assert [event.value for event in losses] == pytest.approx([entry["loss"] for entry in record["losses"]], rel=1e-6)
    for tag in (
        "train/learning_rate",
        "train/tokens_per_second",
        "train/data_wait_share",
        "train/eta_seconds",
        "eval/loss",
        "estimate/total_seconds",
    ):
        assert tag in scalars, tag


def test_wandb_offline_writes_its_run_folder(
    calibrated_home: Path, heavy_tailed_jsonl: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    code, _, err = run_main("train", ["--data", str(heavy_tailed_jsonl), *TRAIN, "--report-to", "wandb"], capsys)
    assert code == 0, err
    run_dir = next((calibrated_home / "runs").iterdir())
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and list(offline[0].glob("*.wandb"))


@pytest.mark.parametrize(
    ("value", "fragment"), [("mlflow", "pip install 'benchtrain[mlflow]'"), ("neptune", "unknown tracker")]
)
def test_a_missing_or_unknown_tracker_is_one_line(
    calibrated_home: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    value: str,
    fragment: str,
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    code, _, err = run_main(
        "train", ["--data", "sample", "--deadline", "30m", "--dry-run", "--report-to", value], capsys
    )
    assert_one_line_error(code, err, fragment)
