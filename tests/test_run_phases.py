"""What a run does after its last step (its final evaluation, the export of final/, the push, the report) is said in
run.json's `phases` as each ends, and a restart after a kill during any of them does what is left from the last
checkpoint: final/ that loads, the same steps and losses, and nothing done twice that had ended. The kills themselves,
on two torchrun agents: tests/test_launch_phases.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import run_main, train_arguments

from benchtrain.train.export import load_final

ARGUMENTS = ("--max-steps", "3", "--eval-split", "0.1", "--checkpoint-interval", "0.001s", "--deadline", "30m")


def train(data: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    return run_main("train", [*train_arguments(data, out, *ARGUMENTS), "--resume", "auto"], capsys)


def left_as(out: Path, status: str, done: list[str]) -> dict:
    """run.json as a kill leaves it after the phases `done` (its earlier sections kept)."""
    path = out / "run.json"
    record = json.loads(path.read_text())
    record["status"], record["phases"]["done"] = status, done
    path.write_text(json.dumps(record))
    return record


@pytest.mark.slow
def test_a_kill_after_the_last_checkpoint_is_finished_by_the_restart(
    calibrated_home: Path, heavy_tailed_jsonl: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = calibrated_home / "run"
    code, _, err = train(heavy_tailed_jsonl, out, capsys)
    assert code == 0, err
    whole = json.loads((out / "run.json").read_text())
    assert whole["phases"] == {
        "planned": ["steps", "evaluation", "export", "report"],
        "done": whole["phases"]["planned"],
    }
    assert [entry["step"] for entry in whole["losses"]] == [1, 2, 3] and whole["evals"][-1]["step"] == 3

    # Killed during the export: every step and the final evaluation done, final/ not there, the status still running.
    left_as(out, "running", ["steps", "evaluation"])
    for written in ("final", "report.html"):
        path = out / written
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    code, printed, err = train(heavy_tailed_jsonl, out, capsys)
    assert code == 0, err
    assert (
        "every step ran; doing what came after them from its last checkpoint (already done: steps, evaluation)"
        in printed
    )
    finished = json.loads((out / "run.json").read_text())
    assert finished["status"] == whole["status"] and finished["phases"]["done"] == whole["phases"]["planned"]
    assert [entry["loss"] for entry in finished["losses"]] == [entry["loss"] for entry in whole["losses"]]
    assert finished["evals"] == whole["evals"]  # the final evaluation that had ended: kept, not done again
    assert finished["final"]["partial"] is False and (out / "report.html").is_file()
    load_final(out / "final")

    # Killed during the report: the status already says completed; only the report is written again.
    left_as(out, finished["status"], ["steps", "evaluation", "export"])
    (out / "report.html").unlink()
    exported = (out / "final" / "model.safetensors").stat().st_mtime_ns
    code, _, err = train(heavy_tailed_jsonl, out, capsys)
    assert code == 0, err
    assert (out / "report.html").is_file() and (out / "final" / "model.safetensors").stat().st_mtime_ns == exported
    assert json.loads((out / "run.json").read_text())["phases"]["done"] == whole["phases"]["planned"]

    # Once every phase ended, the same command has nothing to do.
    code, _, err = train(heavy_tailed_jsonl, out, capsys)
    assert code == 0 and "already ended" in err
