"""What a `train` command continues, decided in one place (train.running.resume.what_to_continue): the run folder,
its run.json and plan, the calibration it was planned with, the checkpoint, the deadline's budget already used; and
the one-line refusals."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from benchtrain.calibration.run_file import COMPLETED
from benchtrain.common.errors import BenchtrainError
from benchtrain.train.running.checkpoint import MARKER_FILE, PROGRESS_FILE
from benchtrain.train.running.resume import Continuation, PlannedCalibration, what_to_continue

BEFORE = Path(__file__).parent / "fixtures" / "run-json-before-42.json"  # an interrupted run of 483 steps
CALIBRATION = Path(__file__).parent / "fixtures" / "cpu-tiny-fullgrid.json"  # the calibration it was planned with
PLANNED_ID = "cpu-tiny-20261123-060535"


def interrupted_run(out: Path, steps_done: int, **record: object) -> Path:
    """A run folder as an interrupted run leaves it: its run.json and a complete checkpoint at `steps_done`."""
    out.mkdir(parents=True)
    (out / "run.json").write_text(json.dumps({**json.loads(BEFORE.read_text()), **record}))
    checkpoint = out / "checkpoints" / f"step-{steps_done:07d}"
    checkpoint.mkdir(parents=True)
    (checkpoint / PROGRESS_FILE).write_text(json.dumps({"step": steps_done}))
    (checkpoint / MARKER_FILE).write_text("")
    return checkpoint


def test_a_fresh_run_continues_nothing(tmp_path: Path) -> None:
    assert what_to_continue(False, None, False, time.monotonic()) == Continuation()
    fresh = what_to_continue(False, str(tmp_path / "run"), False, time.monotonic())
    assert fresh == Continuation(out_dir=tmp_path / "run") and not fresh.resuming


def test_resume_of_an_interrupted_run_continues_its_plan_from_its_last_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "run"
    checkpoint = interrupted_run(out, 9)
    found = what_to_continue(True, str(out), False, time.monotonic())
    assert found.resuming and found.out_dir == out and found.checkpoints == (checkpoint,) and found.completed == 9
    assert found.run is not None and found.earlier is not None
    assert (found.run.run_id, found.run.total_steps, found.run.status) == ("tiny-20261127-044307", 483, "interrupted")
    assert found.run.configuration == found.earlier.configuration  # the batches it trained, in its plan
    assert found.budget_used == 0.0 and found.finished is None  # a plain --resume: a new deadline, from now


def test_resume_auto_with_no_run_starts_one(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert what_to_continue("auto", str(out), False, time.monotonic()) == Continuation(out_dir=out)
    with pytest.raises(BenchtrainError, match="--resume auto needs --out DIR"):
        what_to_continue("auto", None, False, time.monotonic())


def test_resume_auto_counts_the_deadline_from_the_run_s_first_start(tmp_path: Path) -> None:
    out = tmp_path / "run"
    interrupted_run(out, 9, deadline_started_at=time.time() - 600.0)
    found = what_to_continue("auto", str(out), False, time.monotonic())
    assert found.resuming and found.budget_used == pytest.approx(600.0, abs=30.0)


def test_a_completed_run_is_not_resumed(tmp_path: Path) -> None:
    out = tmp_path / "run"
    interrupted_run(out, 483, status=COMPLETED)
    with pytest.raises(BenchtrainError, match="already did all 483 of its optimizer steps"):
        what_to_continue(True, str(out), False, time.monotonic())
    # --resume auto (an engine restarting a finished task): nothing to do, which the command says and exits 0.
    assert what_to_continue("auto", str(out), False, time.monotonic()).finished == COMPLETED
    with pytest.raises(BenchtrainError, match="already did all 483"):  # a dry run says why it plans nothing
        what_to_continue("auto", str(out), True, time.monotonic())


def test_a_run_stopped_after_its_last_checkpoint_does_what_is_left(tmp_path: Path) -> None:
    """A kill after the last step's checkpoint (during the final evaluation, the export, the push or the report) leaves
    every step done: the restart finishes the run from that checkpoint instead of refusing, and does not do again what
    run.json says ended."""
    out = tmp_path / "run"
    interrupted_run(out, 483, status="running")  # killed during the export: no phases said yet (an older run.json)
    found = what_to_continue("auto", str(out), False, time.monotonic())
    assert found.resuming and found.steps_done and found.completed == 483 and found.phases_done == ()
    assert what_to_continue(True, str(out), False, time.monotonic()).steps_done  # a plain --resume too

    planned = ["steps", "evaluation", "export", "report"]
    killed_in_report = tmp_path / "report"
    interrupted_run(
        killed_in_report, 483, status=COMPLETED, phases={"planned": planned, "done": ["steps", "evaluation", "export"]}
    )
    found = what_to_continue("auto", str(killed_in_report), False, time.monotonic())
    assert found.finished is None and found.steps_done and found.phases_done == ("steps", "evaluation", "export")

    # Stopped during its last step: its checkpoint has every step, but its partial final/ and report are done again.
    stopped = tmp_path / "stopped"
    interrupted_run(stopped, 483, status="interrupted", phases={"planned": planned, "done": ["export", "report"]})
    found = what_to_continue("auto", str(stopped), False, time.monotonic())
    assert found.steps_done and found.phases_done == ()

    done = tmp_path / "done"
    interrupted_run(done, 483, status=COMPLETED, phases={"planned": planned, "done": planned})
    assert what_to_continue("auto", str(done), False, time.monotonic()).finished == COMPLETED
    with pytest.raises(BenchtrainError, match="already did all 483 of its optimizer steps"):
        what_to_continue(True, str(done), False, time.monotonic())


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda out: None, "--resume needs --out DIR"),
        (lambda out: out.mkdir(), "has no run.json to continue"),
        (lambda out: (out.mkdir(), (out / "run.json").write_text(BEFORE.read_text())), "--resume: no checkpoint in"),
    ],
)
def test_resume_with_nothing_to_continue_is_one_line(tmp_path: Path, make, fragment: str) -> None:
    out = tmp_path / "run"
    make(out)
    with pytest.raises(BenchtrainError, match=fragment):
        what_to_continue(True, str(out) if "--out" not in fragment else None, False, time.monotonic())


def test_resume_names_the_calibration_the_run_was_planned_with(tmp_path: Path, home: Path) -> None:
    out = tmp_path / "run"
    interrupted_run(out, 9, calibration_path=str(CALIBRATION))
    planned = what_to_continue(True, str(out), False, time.monotonic()).calibration
    # Its file first, then its id in the store.
    assert planned == PlannedCalibration(PLANNED_ID, str(CALIBRATION), (str(CALIBRATION), PLANNED_ID))
    assert planned.load().id == PLANNED_ID  # from its file: the store (an empty home) does not hold it
    assert what_to_continue(False, str(out), False, time.monotonic()).calibration is None  # a new run: latest, or named


def test_a_resumed_run_s_calibration_that_is_gone_is_one_line_when_it_plans(tmp_path: Path, home: Path) -> None:
    out = tmp_path / "run"
    gone = tmp_path / "elsewhere" / "calibration.json"
    interrupted_run(out, 9, calibration_path=str(gone))
    planned = what_to_continue(True, str(out), False, time.monotonic()).calibration
    assert planned is not None and planned.references == (PLANNED_ID,)  # a path no longer there is not looked up
    with pytest.raises(BenchtrainError) as refused:
        planned.load()
    assert str(refused.value) == (
        f"--resume: the run's calibration {PLANNED_ID} is gone ({gone}); pass --use-calibration ID --force to plan with another"
    )


def base_folder(folder: Path, value: float) -> Path:
    """A local base of the tiny architecture: its config and weights (`value` everywhere)."""
    import torch
    from safetensors.torch import save_file

    from benchtrain.train.workload.model import resolve_model

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(resolve_model("tiny").config_dict))
    save_file({"lm_head.weight": torch.full((4, 4), value)}, str(folder / "model.safetensors"))
    return folder


def test_a_lora_resume_on_another_base_of_the_same_architecture_is_one_line(tmp_path: Path) -> None:
    """The fingerprint covers the architecture; LoRA's checkpoint holds the adapters only: a resume names the base
    weights it trained on, and another base (same shape, other weights) is refused unless --force."""
    from benchtrain.train.running.resume import check_same_run, resumed_method
    from benchtrain.train.workload.method import MethodConfig
    from benchtrain.train.workload.model import resolve_model, weights_identity

    trained_on = resolve_model(str(base_folder(tmp_path / "base", 1.0)))
    other = resolve_model(str(base_folder(tmp_path / "instruct", 2.0)))
    assert trained_on.fingerprint == other.fingerprint and weights_identity(trained_on) != weights_identity(other)
    out = tmp_path / "run"
    record = json.loads(BEFORE.read_text())
    record["model"] = {
        **record["model"],
        "fingerprint": trained_on.fingerprint,
        "weights": weights_identity(trained_on),
    }
    record["plan"] = {**record["plan"], "method": "lora", "lora": {"rank": 16, "alpha": 32.0}}
    interrupted_run(out, 9, **record)
    found = what_to_continue(True, str(out), False, time.monotonic())
    assert found.run is not None and found.run.model_weights == weights_identity(trained_on)
    earlier = resumed_method(found.run.method)
    method = MethodConfig(**{**earlier.__dict__})
    assert check_same_run(found.run, earlier, trained_on, method, None, False) == []
    with pytest.raises(BenchtrainError) as refused:
        check_same_run(found.run, earlier, other, method, None, False)
    assert "other weights" in str(refused.value) and "\n" not in str(refused.value)
    assert check_same_run(found.run, earlier, other, method, None, True)  # --force: said, then continued
