"""Nothing lost, nothing executed (issue 14): disk space up front, ENOSPC mid-run, safe loading,
kill -9 at any moment, one train per run folder, the run's own calibration, concurrent benches."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import assert_one_line_error, pretend_interrupted, run_main, synthetic_calibration

from benchtrain.train.running.checkpoint import OPTIMIZER_FILE, list_checkpoints

RUN_JSON_BEFORE = Path(__file__).parent / "fixtures" / "run-json-before-42.json"  # an interrupted run
RUN = ["--deadline", "30m", "--effective-batch", "4", "--no-report"]


def run_train(data: Path, out: Path, *extra: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    return run_main("train", ["--data", str(data), *RUN, "--out", str(out), *extra], capsys)


def test_too_little_space_is_refused_up_front(
    calibrated_home: Path, heavy_tailed_jsonl: Path, monkeypatch, capsys
) -> None:
    import benchtrain.train.planning.disk

    monkeypatch.setattr(benchtrain.train.planning.disk, "free_bytes", lambda folder: 1_000_000)
    out = calibrated_home / "small"
    code, _, err = run_train(heavy_tailed_jsonl, out, "--max-steps", "2", capsys=capsys)
    assert_one_line_error(
        code,
        err,
        "for 2 checkpoints and the final model, 0.00 GB free; free space, lower --keep-checkpoints",
        expected_code=5,
    )
    assert not list_checkpoints(out / "checkpoints")


def test_a_real_tiny_filesystem_is_refused_up_front(
    calibrated_home: Path, heavy_tailed_jsonl: Path, tmp_path: Path, capsys
) -> None:
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if (
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True).returncode
        != 0
    ):
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        code, _, err = run_train(heavy_tailed_jsonl, mount / "run", "--max-steps", "2", capsys=capsys)
        assert_one_line_error(
            code, err, "GB free; free space, lower --keep-checkpoints, or use --out elsewhere", expected_code=5
        )
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint_and_the_run_resumes(
    calibrated_home: Path, heavy_tailed_jsonl: Path, monkeypatch, capsys
) -> None:
    import safetensors.torch

    real_save = safetensors.torch.save_file
    saves = {"count": 0}

    def full_on_the_third_save(tensors, filename, *args, **kwargs):
        saves["count"] += 1
        if saves["count"] == 3:
            with open(filename, "wb") as handle:
                handle.write(b"partial")  # what a full disk leaves behind
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", full_on_the_third_save)
    out = calibrated_home / "run"
    code, _, err = run_train(
        heavy_tailed_jsonl, out, "--max-steps", "6", "--checkpoint-interval", "0.001s", capsys=capsys
    )
    assert_one_line_error(code, err, "the disk is full; the last checkpoint, step-0000002, is intact", expected_code=5)
    assert f"train --resume --out {out}" in err
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step-0000001", "step-0000002"]
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]  # the partial folder is gone
    monkeypatch.setattr(safetensors.torch, "save_file", real_save)
    code, out_text, err = run_train(heavy_tailed_jsonl, out, "--max-steps", "6", "--resume", capsys=capsys)
    assert code == 0, err
    assert "resuming from step 2 of 6" in out_text
    assert json.loads((out / "run.json").read_text())["actual"]["steps"] == 6


class RunsCode:
    """A pickle that would create a file when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_whose_pickle_would_run_code_is_refused_without_running_it(
    calibrated_home: Path, heavy_tailed_jsonl: Path, tmp_path: Path, capsys
) -> None:
    import torch

    out = calibrated_home / "run"
    code, _, err = run_train(heavy_tailed_jsonl, out, "--max-steps", "2", capsys=capsys)
    assert code == 0, err
    latest = list_checkpoints(out / "checkpoints")[-1]
    marker = tmp_path / "code-ran"
    torch.save({"optimizer": RunsCode(marker)}, latest / OPTIMIZER_FILE)
    pretend_interrupted(out, 4)
    code, _, err = run_train(heavy_tailed_jsonl, out, "--max-steps", "4", "--resume", capsys=capsys)
    assert_one_line_error(code, err, "cannot be loaded safely")
    assert not marker.exists()


def test_a_corrupt_latest_checkpoint_offers_the_previous_one(
    calibrated_home: Path, heavy_tailed_jsonl: Path, capsys
) -> None:
    out = calibrated_home / "run"
    code, _, err = run_train(
        heavy_tailed_jsonl, out, "--max-steps", "3", "--checkpoint-interval", "0.001s", capsys=capsys
    )
    assert code == 0, err
    found = list_checkpoints(out / "checkpoints")
    (found[-1] / "model.safetensors").write_bytes(b"\x00" * 64)
    pretend_interrupted(out, 4)
    code, _, err = run_train(heavy_tailed_jsonl, out, "--max-steps", "4", "--resume", capsys=capsys)
    assert_one_line_error(code, err, f"the previous checkpoint, {found[-2].name}, is intact")


def test_resume_auto_passes_over_an_unreadable_newest_checkpoint(
    calibrated_home: Path, heavy_tailed_jsonl: Path, capsys
) -> None:
    """Unattended (an engine restarting the task), a newest checkpoint that cannot be loaded gives way to the one before,
    with a warning; the run still ends at its steps."""
    out = calibrated_home / "run"
    code, _, err = run_train(
        heavy_tailed_jsonl, out, "--max-steps", "3", "--checkpoint-interval", "0.001s", capsys=capsys
    )
    assert code == 0, err
    found = list_checkpoints(out / "checkpoints")
    (found[-1] / "model.safetensors").write_bytes(b"\x00" * 64)
    pretend_interrupted(out, 4)
    code, _, err = run_train(heavy_tailed_jsonl, out, "--max-steps", "4", "--resume", "auto", capsys=capsys)
    assert code == 0, err
    assert f"resuming from the one before, {found[-2].name}" in err
    record = json.loads((out / "run.json").read_text())
    assert [entry["step"] for entry in record["losses"]][-1] == 4


def test_a_new_run_in_a_reused_out_keeps_its_checkpoints_and_its_resume_continues_it(tmp_path: Path) -> None:
    """A new run in an --out that holds another run's checkpoints (of later steps): pruning keeps the new run's, and a
    resume of the new run continues from its own, never the old run's."""
    import torch

    from benchtrain.train.running.checkpoint import checkpoint_name, save_checkpoint
    from benchtrain.train.running.resume import what_to_continue

    out = tmp_path / "run"
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in (40, 50):  # the old run's
        save_checkpoint(
            out / "checkpoints" / checkpoint_name(step), model, optimizer, None, {"step": step, "run_id": "old"}
        )
    for step in (2, 3):  # the new run's, keeping 2
        save_checkpoint(
            out / "checkpoints" / checkpoint_name(step), model, optimizer, None, {"step": step, "run_id": "new"}, keep=2
        )
    names = [folder.name for folder in list_checkpoints(out / "checkpoints")]
    assert names == ["step-0000002", "step-0000003", "step-0000040", "step-0000050"]
    record = {**json.loads(RUN_JSON_BEFORE.read_text()), "run_id": "new", "status": "interrupted"}
    (out / "run.json").write_text(json.dumps(record))
    continued = what_to_continue("auto", str(out), False, time.monotonic())
    assert continued.completed == 3 and [one.name for one in continued.checkpoints] == ["step-0000002", "step-0000003"]


def test_one_train_per_run_folder_and_a_stale_lock_is_taken(
    calibrated_home: Path, heavy_tailed_jsonl: Path, capsys
) -> None:
    from benchtrain.train.planning.disk import LOCK_FILE, run_lock

    out = calibrated_home / "run"
    with run_lock(out):
        code, _, err = run_train(heavy_tailed_jsonl, out, "--max-steps", "2", capsys=capsys)
        assert_one_line_error(code, err, f"is in use by another train (pid {os.getpid()})")
    (out / LOCK_FILE).write_text("999999")  # left by a crashed run: no process holds it
    code, _, err = run_train(heavy_tailed_jsonl, out, "--max-steps", "2", capsys=capsys)
    assert code == 0, err


def test_resume_plans_with_the_run_s_own_calibration(calibrated_home: Path, heavy_tailed_jsonl: Path, capsys) -> None:
    from benchtrain.calibration.store import save_calibration
    from benchtrain.train.step.hardware import detect_hardware
    from benchtrain.train.workload.model import resolve_model

    out = calibrated_home / "run"
    code, _, err = run_train(heavy_tailed_jsonl, out, "--max-steps", "2", capsys=capsys)
    assert code == 0, err
    own = json.loads((out / "run.json").read_text())["calibration_id"]
    newer = synthetic_calibration(
        hardware=detect_hardware(),
        model={"name": "tiny", "parameter_count": 1, "fingerprint": resolve_model("tiny").fingerprint},
        id="newer-calibration",
        created_at="2030-01-01T00:00:00+00:00",
    )
    save_calibration(newer)
    pretend_interrupted(out, 3)
    code, _, err = run_train(heavy_tailed_jsonl, out, "--max-steps", "3", "--resume", capsys=capsys)
    assert code == 0, err
    pretend_interrupted(out, 4)
    assert json.loads((out / "run.json").read_text())["calibration_id"] == own  # not the newer latest
    code, _, err = run_train(
        heavy_tailed_jsonl, out, "--max-steps", "4", "--resume", "--use-calibration", "newer-calibration", capsys=capsys
    )
    assert_one_line_error(code, err, f"this run was planned with calibration {own}, not newer-calibration")
    code, _, err = run_train(
        heavy_tailed_jsonl,
        out,
        "--max-steps",
        "4",
        "--resume",
        "--use-calibration",
        "newer-calibration",
        "--force",
        capsys=capsys,
    )
    assert code == 0, err


def test_bench_times_a_big_checkpoint_with_a_bounded_write(tmp_path: Path, monkeypatch) -> None:
    import benchtrain.bench.disk_write as disk_write
    from benchtrain.bench.probe import Workload
    from benchtrain.train.workload.model import resolve_model

    written: list[int] = []
    real = disk_write.write_bandwidth
    monkeypatch.setattr(disk_write, "MAX_WRITE_BYTES", 1_000_000)  # the tiny model's checkpoint is "too big"
    monkeypatch.setattr(disk_write, "write_bandwidth", lambda folder, size: written.append(size) or real(folder, size))
    result = disk_write.measure_checkpoint(Workload(resolve_model("tiny")), tmp_path)
    assert result["checkpoint_extrapolated"] == 1 and written == [1_000_000]
    assert result["checkpoint_bytes"] > 1_000_000 and result["checkpoint_save_seconds"] > 0
    assert not list(tmp_path.iterdir())  # the scratch file is gone


def _save_many(home: str, worker: int, count: int) -> None:
    os.environ["BENCHTRAIN_HOME"] = home
    from benchtrain.calibration.store import save_calibration, update_calibration

    for index in range(count):
        path = save_calibration(synthetic_calibration(id="same-second-id"))
        update_calibration(path, lambda data, w=worker, i=index: data["history"].append({"run_id": f"{w}-{i}"}))


def test_concurrent_benches_keep_every_calibration(home: Path) -> None:
    from benchtrain.calibration.schema import read_calibration_file

    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_save_many, args=(str(home), worker, 12)) for worker in range(3)]
    for process in workers:
        process.start()
    for process in workers:
        process.join(120)
        assert process.exitcode == 0
    files = sorted((home / "calibrations").glob("*.json"))
    assert len(files) == 36
    ids = {read_calibration_file(path)["id"] for path in files}  # every one valid JSON, every id unique
    assert len(ids) == 36
    assert all(len(read_calibration_file(path)["history"]) == 1 for path in files)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_kill_9_at_any_moment_leaves_a_resumable_run_on_the_same_loss_curve(
    calibrated_home: Path, heavy_tailed_jsonl: Path, fork_server
) -> None:
    # Each command is a real process, forked from one that has imported torch and transformers
    # already (tests/forkserver.py), so a dozen kills cost seconds rather than minutes of imports.
    env = {"BENCHTRAIN_HOME": str(calibrated_home)}
    steps = "100"  # 12 kills get through well before (8 epochs of 14 steps, cut at 100)
    common = ["--data", str(heavy_tailed_jsonl), *RUN, "--epochs", "8", "--max-steps", steps, "--keep-checkpoints", "2"]
    stderr = calibrated_home / "stderr.txt"

    def run_to_the_end(*arguments: str) -> None:
        assert fork_server.wait(fork_server.start("train", [*common, *arguments], stderr, env=env)) == 0, (
            stderr.read_text()[-2000:]
        )

    reference = calibrated_home / "reference"
    run_to_the_end("--out", str(reference))
    expected = [entry["loss"] for entry in json.loads((reference / "run.json").read_text())["losses"]]

    out = calibrated_home / "killed"
    rng = random.Random(0)
    kills = 0
    while kills < 12:
        resume = ["--resume"] if list_checkpoints(out / "checkpoints") else []
        # Checkpoint after every step: most of the time is spent inside a save.
        # (the plan counts one checkpoint per step: a deadline far away keeps the guard out of it)
        command = [*common, "--out", str(out), "--checkpoint-interval", "0.001s", "--deadline", "1000h", *resume]
        before = {p.name for p in list_checkpoints(out / "checkpoints")}
        pid = fork_server.start("train", command, stderr, env=env)
        deadline = time.monotonic() + 120
        while (
            fork_server.poll(pid) is None
            and {p.name for p in list_checkpoints(out / "checkpoints")} <= before
            and time.monotonic() < deadline
        ):
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.25))
        code = fork_server.poll(pid)
        if code is not None:
            assert code == 0, stderr.read_text()[-2000:]  # it finished: start again from scratch
            break
        os.kill(pid, signal.SIGKILL)
        assert fork_server.wait(pid) == -signal.SIGKILL
        kills += 1
        assert list_checkpoints(out / "checkpoints"), "a kill left no complete checkpoint"
    assert kills >= 12
    run_to_the_end("--out", str(out), "--resume")
    record = json.loads((out / "run.json").read_text())
    assert [entry["step"] for entry in record["losses"]] == list(range(1, int(steps) + 1))
    assert [entry["loss"] for entry in record["losses"]] == expected
