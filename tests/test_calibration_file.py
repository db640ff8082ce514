"""Schema round-trip, every corrupt-file case, the store (ids, latest, atomic, concurrent)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
from helpers import synthetic_calibration
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchtrain import calibration
from benchtrain.bench.cli import main as bench_main
from benchtrain.calibration import schema
from benchtrain.calibration.step_config import StepConfig
from benchtrain.calibration.store import list_calibrations, resolve_calibration, save_calibration, update_calibration
from benchtrain.common.errors import (
    EXIT_USAGE,
    BenchtrainError,
    CalibrationFileError,
    CalibrationTooOldError,
    guard_cli,
)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_round_trip_through_the_store(home: Path) -> None:
    data = synthetic_calibration()
    path = save_calibration(data)
    loaded = calibration.load("latest")
    assert loaded.path == path
    assert loaded.data == json.loads(path.read_text())
    assert loaded.predict(StepConfig(2, 2, 2, 256)).tokens_per_second > 0
    assert calibration.load(data["id"]).id == data["id"]
    assert calibration.load(str(path)).id == data["id"]
    assert path.with_suffix(".csv").read_text().startswith("micro_batch_size,num_workers,grad_accum,seq_len,status")


def test_latest_is_the_newest_and_ids_never_collide(home: Path) -> None:
    first = save_calibration(synthetic_calibration(created_at="2026-01-01T00:00:00+00:00"))
    second = save_calibration(synthetic_calibration(created_at="2026-02-01T00:00:00+00:00"))
    assert first != second  # same id asked for twice: the second gets a suffix
    assert resolve_calibration("latest") == second
    assert [p for p, _, _ in list_calibrations()] == [second, first]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"schema_version": 4}', "missing field"),
        ('{"schema_version": "1"}', "schema_version"),
        ('{"schema_version": 99}', "newer than this benchtrain"),
        ('{"schema_version": 2}', "has schema_version 2, older than this benchtrain reads"),
    ],
)
def test_corrupt_files_give_one_line_naming_the_file(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path / "bad.json", text)
    with pytest.raises(CalibrationFileError, match=message) as caught:
        schema.read_calibration_file(path)
    assert str(path) in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["hardware"].pop("name"), "hardware: missing field 'name'"),
        (lambda d: d["model"].update(parameter_count="many"), "parameter_count' should be int"),
        (lambda d: d["measurements"][0].update(status="fine"), "status is 'fine'"),
        (lambda d: d["measurements"][0].update(step_seconds="fast"), "step_seconds should be a number"),
        (lambda d: d["measurements"][0].update(micro_batch_size=0), "out of range"),
        (lambda d: d["fit"]["parameters"].pop("per_token"), "parameters.per_token"),
        (lambda d: d.update(measurements={}), "'measurements' should be list"),
    ],
)
def test_wrong_fields_and_types_are_named(tmp_path: Path, mutate, message: str) -> None:
    data = synthetic_calibration()
    mutate(data)
    path = write(tmp_path / "c.json", json.dumps(data))
    with pytest.raises(CalibrationFileError, match=message.replace("(", r"\(")):
        schema.read_calibration_file(path)


def test_a_too_old_calibration_is_refused_in_one_line_naming_its_version(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = synthetic_calibration()
    old["schema_version"] = schema.OLDEST_READABLE - 1
    path = write(tmp_path / "old.json", json.dumps(old))
    with pytest.raises(CalibrationTooOldError, match=f"schema_version {old['schema_version']}, older"):
        schema.read_calibration_file(path)
    assert guard_cli(bench_main, ["show", str(path)]) == EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and f"schema_version {old['schema_version']}" in err


def test_the_version_before_the_current_one_is_read(tmp_path: Path) -> None:
    previous = synthetic_calibration()
    previous["schema_version"] = schema.SCHEMA_VERSION - 1
    previous["fit"]["memory"].pop("basis", None)
    loaded = schema.read_calibration_file(write(tmp_path / "previous.json", json.dumps(previous)))
    assert loaded["schema_version"] == schema.SCHEMA_VERSION and loaded["fit"]["memory"]["basis"] == "allocated"


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=5),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=JSON)
def test_loading_arbitrary_json_never_crashes(tmp_path: Path, payload: object) -> None:
    path = write(tmp_path / "any.json", json.dumps(payload))
    try:
        schema.read_calibration_file(path)
    except CalibrationFileError as error:
        assert "\n" not in str(error)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(["hardware", "model", "measurements", "fit", "history"]), value=JSON)
def test_replacing_a_section_with_arbitrary_json_fails_cleanly(tmp_path: Path, field: str, value: object) -> None:
    data = synthetic_calibration()
    data[field] = value
    path = write(tmp_path / "any.json", json.dumps(data))
    try:
        loaded = schema.read_calibration_file(path)
    except CalibrationFileError:
        return
    calibration.Calibration(loaded).predict(StepConfig(1, 0, 1, 128)) if loaded.get("fit") else None


def test_a_failed_write_leaves_the_old_file_intact(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = save_calibration(synthetic_calibration())
    before = path.read_bytes()

    def crash(*_args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        update_calibration(path, lambda data: data.update(id="changed"))
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")] == []


def test_concurrent_history_updates_lose_nothing(home: Path) -> None:
    path = save_calibration(synthetic_calibration())

    def append(index: int) -> None:
        update_calibration(path, lambda data: data["history"].append({"run_id": str(index)}))

    threads = [threading.Thread(target=append, args=(i,)) for i in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    history = json.loads(path.read_text())["history"]
    assert sorted(int(entry["run_id"]) for entry in history) == list(range(12))


def test_concurrent_saves_get_distinct_files(home: Path) -> None:
    paths: list[Path] = []
    threads = [
        threading.Thread(target=lambda: paths.append(save_calibration(synthetic_calibration()))) for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(paths)) == 8
    for path in paths:
        schema.read_calibration_file(path)


def test_unknown_references_are_one_line_errors(home: Path) -> None:
    with pytest.raises(BenchtrainError, match=r"no calibration in .* can be used"):
        resolve_calibration("latest")
    with pytest.raises(BenchtrainError, match="unknown calibration 'nope'"):
        resolve_calibration("nope")
    with pytest.raises(BenchtrainError, match="does not exist"):
        resolve_calibration("/no/such/file.json")
