"""A run folder that moves: a stopped run copied or moved elsewhere resumes there with
`--resume --out NEW`, on the loss curve of the run that was never stopped, and its report and
final/ work from the new place. run.json keeps the paths inside the run folder relative to it."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from helpers import FakeClock, lora_calibration, run_main, train_arguments

from benchtrain.calibration.store import save_calibration
from benchtrain.common.run_paths import run_path, stored_path
from benchtrain.train.export import load_final

PROMPT = torch.tensor([[5, 17, 99, 42, 7, 250, 3, 64]])
LORA = ["--lora", "--lora-rank", "4"]


def save_lora_calibration() -> None:
    save_calibration(lora_calibration(rank=4))


def absolute_paths_of(folder: Path, record: dict) -> list[str]:
    text = json.dumps(record)
    return [str(path) for path in {folder, folder.resolve()} if str(path) in text]


def logits(final: Path) -> torch.Tensor:
    model = load_final(final)
    model.eval()
    with torch.no_grad():
        return model(input_ids=PROMPT).logits


@pytest.mark.parametrize("method", ["full", "lora"])
def test_a_stopped_run_moved_elsewhere_resumes_on_the_same_loss_curve_and_its_report_and_model_work(
    method: str,
    calibrated_home: Path,
    heavy_tailed_jsonl: Path,
    tmp_path: Path,
    clock: FakeClock,
    capsys: pytest.CaptureFixture[str],
) -> None:
    extra = LORA if method == "lora" else []
    if method == "lora":
        save_lora_calibration()
    straight = tmp_path / "straight"
    code, _, err = run_main(
        "train",
        [
            *train_arguments(heavy_tailed_jsonl, straight, "--deadline", "30m", "--max-steps", "6", "--no-report"),
            *extra,
        ],
        capsys,
    )
    assert code == 0, err
    uninterrupted = json.loads((straight / "run.json").read_text())

    out = tmp_path / "run"
    clock.on_step = lambda step: os.kill(os.getpid(), signal.SIGINT) if step == clock.steps_at_start + 3 else None
    clock.steps_at_start = clock.steps
    code, _, err = run_main(
        "train",
        [*train_arguments(heavy_tailed_jsonl, out, "--deadline", "30m", "--max-steps", "6", "--no-report"), *extra],
        capsys,
    )
    assert code == 130, err
    clock.on_step = None
    stopped = json.loads((out / "run.json").read_text())
    assert stopped["actual"]["steps"] == 3 and stopped["actual"]["last_checkpoint"] == "checkpoints/step-0000003"
    assert stopped["final"]["path"] == "final" and stopped["final"]["partial"] is True
    assert absolute_paths_of(out, stopped) == []

    (tmp_path / "elsewhere").mkdir()
    moved = Path(shutil.move(out, tmp_path / "elsewhere" / "moved-run"))
    assert not out.exists()
    code, printed, err = run_main(
        "train",
        [*train_arguments(heavy_tailed_jsonl, moved, "--deadline", "45m", "--no-report"), *extra, "--resume"],
        capsys,
    )
    assert code == 0, err
    assert "resuming from step 3 of 6" in printed and f"model: {moved / 'final'}" in printed
    resumed = json.loads((moved / "run.json").read_text())
    assert resumed["actual"]["steps"] == 6 and resumed["final"] == {
        **resumed["final"],
        "path": "final",
        "partial": False,
    }
    assert [entry["loss"] for entry in resumed["losses"]] == pytest.approx(
        [entry["loss"] for entry in uninterrupted["losses"]], rel=1e-5
    )
    assert absolute_paths_of(out, resumed) == [] and absolute_paths_of(moved, resumed) == []

    # Moved once more after it finished: the report and final/ from the new place.
    again = Path(shutil.move(moved, tmp_path / "again"))
    code, printed, err = run_main("report", [str(again)], capsys)
    assert code == 0, err
    assert (again / "report.html").is_file() and printed.strip() == str(again / "report.html")
    final = run_path(json.loads((again / "run.json").read_text())["final"]["path"], again)
    assert final == again / "final"
    assert torch.allclose(logits(final), logits(straight / "final"), atol=1e-4)


def test_paths_inside_the_run_folder_are_stored_relative_and_old_absolute_ones_still_resolve(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step-0000005").mkdir(parents=True)
    (run_dir / "final").mkdir()
    assert stored_path(run_dir / "checkpoints" / "step-0000005", run_dir) == "checkpoints/step-0000005"
    assert stored_path(run_dir / "final", run_dir) == "final" and stored_path(None, run_dir) is None
    assert stored_path("/data/chats.jsonl", run_dir) == "/data/chats.jsonl"  # an input outside the run: as given
    assert run_path("final", run_dir) == run_dir / "final"
    # A record written before issue 34 (absolute), read after the folder moved from /old/place/run.
    assert run_path("/old/place/run/final", run_dir) == run_dir / "final"
    assert run_path("/old/place/run/checkpoints/step-0000005", run_dir) == run_dir / "checkpoints" / "step-0000005"
    # An absolute path that exists, and one that exists nowhere, are left as they are.
    assert run_path(str(run_dir / "final"), tmp_path / "elsewhere") == run_dir / "final"
    assert run_path("/old/place/run/final-merged", run_dir) == Path("/old/place/run/final-merged")
