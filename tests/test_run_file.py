"""run.json as calibration.run_file reads and writes it: a file written before the typed run file
(issue 42) loads, writes back the same JSON, and says what a resume needs; a file that cannot be
read is one line (exit 2) through `train --resume`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import assert_one_line_error, run_main

from benchtrain.calibration.run_file import RunFile
from benchtrain.calibration.step_config import StepConfig
from benchtrain.common.errors import RunFileError

BEFORE = Path(__file__).parent / "fixtures" / "run-json-before-42.json"  # an interrupted run, written before the change
CALIBRATION = Path(__file__).parent / "fixtures" / "cpu-tiny-fullgrid.json"


OLD_FLAT_KEYS = ("micro_batch_size", "grad_accum", "num_workers", "max_length", "world_size", "gradient_checkpointing")


def test_a_run_json_from_before_loads_and_writes_its_step_configuration_once(tmp_path: Path) -> None:
    """The old file held the step three times (the plan's row, the plan's flat keys, `chosen`'s,
    its length as max_length); written back it holds it once, the rest as it was."""
    before = json.loads(BEFORE.read_text())
    assert all(key in before["plan"] and key in before["chosen"] for key in OLD_FLAT_KEYS)
    written = json.loads(RunFile.read(BEFORE).write(tmp_path).read_text())
    assert written["plan"]["configuration"] == {
        "micro_batch_size": 8,
        "num_workers": 0,
        "grad_accum": 2,
        "seq_len": 256,
        "gradient_checkpointing": 0,
    }
    assert written["plan"]["world_size"] == 1
    assert not any(key in written["chosen"] for key in OLD_FLAT_KEYS)
    assert not any(key in written["plan"] for key in OLD_FLAT_KEYS if key != "world_size")
    unchanged = {key: value for key, value in before.items() if key not in ("plan", "chosen")}
    assert {key: value for key, value in written.items() if key not in ("plan", "chosen")} == unchanged
    assert list(written) == list(before)  # the sections in the same order
    again = RunFile.read(tmp_path / "run.json")
    assert again.resumed() == RunFile.read(BEFORE).resumed()  # what a resume reads is the same, either form


def test_what_a_resume_reads_of_it_is_typed() -> None:
    resumed = RunFile.read(BEFORE).resumed()
    assert resumed.run_id == "tiny-20261127-044307" and resumed.status == "interrupted"
    assert resumed.configuration == StepConfig(micro_batch_size=8, num_workers=0, grad_accum=2, seq_len=256)
    assert (resumed.epochs, resumed.total_steps, resumed.max_length, resumed.sharding) == (3.0, 483, 256, "none")
    assert (resumed.method.method, resumed.method.optimizer) == ("full", "adamw")
    assert resumed.model_name == "tiny" and resumed.model_fingerprint == "e93a0dc2f32d106d"
    assert resumed.calibration_id == "cpu-tiny-20261123-060535" and resumed.base_learning_rate == 0.0003
    assert resumed.hyperparameters is not None and resumed.hyperparameters["lr_scheduler_type"] == "cosine"
    assert (resumed.data.preparation_key, resumed.data.count, resumed.data.total_tokens) == (
        "333dc0a394e6b15f50017f66",
        3000,
        657826,
    )
    assert resumed.with_length(128).configuration.seq_len == 128 and resumed.with_length(None) is resumed


def test_the_step_configuration_and_the_estimate_error_are_written_from_one_value() -> None:
    run_file = RunFile.read(BEFORE)
    run_file.configuration = StepConfig(
        micro_batch_size=4, num_workers=1, grad_accum=3, seq_len=128, switches=("gradient_checkpointing",)
    )
    run_file.update(estimate_check={**(run_file.get("estimate_check") or {}), "error_pct": 7.5})  # type: ignore[dict-item]
    written = run_file.to_json()
    plan, chosen = written["plan"], written["chosen"]
    assert isinstance(plan, dict) and isinstance(chosen, dict)
    assert plan["configuration"] == {
        "micro_batch_size": 4,
        "num_workers": 1,
        "grad_accum": 3,
        "seq_len": 128,
        "gradient_checkpointing": 1,
    }
    assert "max_length" not in plan and "micro_batch_size" not in chosen
    assert written["estimate_error_pct"] == 7.5


def _broken(tmp_path: Path, text: str) -> Path:
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text(text)
    return out


def _without_plan() -> str:
    document = json.loads(BEFORE.read_text())
    del document["plan"]
    return json.dumps(document)


def _epochs_as_text() -> str:
    document = json.loads(BEFORE.read_text())
    document["plan"]["epochs"] = "three"
    return json.dumps(document)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        (_without_plan(), "plan should be an object, found missing"),
        (_epochs_as_text(), "plan.epochs should be a number, found str 'three'"),
        ("{not json", "is not valid JSON"),
        ("[]", "expected a JSON object, got list"),
    ],
)
def test_a_bad_run_json_is_one_line(tmp_path: Path, text: str, fragment: str) -> None:
    out = _broken(tmp_path, text)
    with pytest.raises(RunFileError, match=fragment) as raised:
        RunFile.read(out / "run.json").resumed()
    assert str(out / "run.json") in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.parametrize("text", [_without_plan(), _epochs_as_text(), "{not json"])
def test_a_bad_run_json_ends_a_resume_with_one_line(
    home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str
) -> None:
    out = _broken(tmp_path, text)
    argv = [
        "--use-calibration",
        str(CALIBRATION),
        "--data",
        "sample",
        "--deadline",
        "10m",
        "--resume",
        "--out",
        str(out),
        "--dry-run",
    ]
    code, _, err = run_main("train", argv, capsys)
    assert_one_line_error(code, err, f"run file {out / 'run.json'}")


def test_an_older_run_json_without_the_configuration_row_loads(tmp_path: Path) -> None:
    """Before the plan's `configuration` row, the flat keys held it (its length as max_length)."""
    document = json.loads(BEFORE.read_text())
    del document["plan"]["configuration"]
    (tmp_path / "run.json").write_text(json.dumps(document))
    resumed = RunFile.read(tmp_path / "run.json").resumed()
    assert resumed.configuration == StepConfig(micro_batch_size=8, num_workers=0, grad_accum=2, seq_len=256)


@pytest.mark.parametrize("rewritten", [False, True])
def test_the_report_draws_a_run_of_either_form(tmp_path: Path, rewritten: bool) -> None:
    """A run.json from before (the step as flat keys) and one written now (the configuration once)
    both make a report whose plan names the step."""
    from benchtrain.reports.run_report import write_run_report

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    if rewritten:
        RunFile.read(BEFORE).write(run_dir)
    else:
        (run_dir / "run.json").write_text(BEFORE.read_text())
    html = write_run_report(run_dir).read_text()
    if rewritten:
        assert "batch 8 × accum 2, 0 workers, max length 256" in html
    else:
        assert "max_length" in html and ">256<" in html
