"""The emitted run scripts, killed at every phase: on two torchrun agents of this machine (tests/helpers.py's nodes, as tests/test_launch.py runs them),
a target nobody measured is benched across both nodes, then trained; the same task is killed with -9 during the bench,
a step, a checkpoint write, the final evaluation, the export and the report, each time at that moment
(benchtrain.common.pause), and started again, alternating SkyPilot's and dstack's scripts on the one run folder. It ends
with a final/ that loads and the steps, learning rates and losses of the uninterrupted run.

And the shutdown grace: measured figures of the plan reach torchrun and the engines' kill, and torchrun waits that long
for a worker that saves after its SIGTERM."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from helpers import free_port, kill_nodes, run_main, start_nodes, wait_nodes

from benchtrain.calibration.hardware import Hardware
from benchtrain.common.pause import PAUSE_AT, PAUSE_FILE
from benchtrain.train.export import load_final
from benchtrain.train.launch_command import run_script
from benchtrain.train.planning.rental import GB, DiskSize, Duration, Spot
from benchtrain.train.recipes.launch_task import CALIBRATIONS_DIR, LaunchTask, Target
from benchtrain.train.recipes.machines import Option, Row, Source
from benchtrain.train.running.checkpoint import list_checkpoints

BENCH = (
    "run --gpu cpu --interconnect ethernet --batch-sizes 1,2 --seq-lens 32,64 --workers 0 --accum 1 --no-report --quiet"
)


def cpu_target(bench: str | None, calibration: str | None, after_training_seconds: float = 1.0) -> Target:
    """A CPU target on two nodes, one process each: a row nobody measured (`bench`: its bench run on the nodes) or one
    measured (`calibration`: as the nodes name it); its plan's figures only what the script is written from."""
    chosen = SimpleNamespace(
        config=SimpleNamespace(phrase="to be measured" if bench else "measured"),
        optimizer_steps=4,
        remaining_steps=4,
        step_seconds=0.4,
        bound_fraction=0.0,
        overheads=SimpleNamespace(after_training_seconds=after_training_seconds),
        total_seconds_low=10.0,
        total_seconds_promised=20.0,
    )
    option = Option(None, 2, "ddp", interconnect="ethernet")  # type: ignore[arg-type]
    row = Row(
        Source(option, "predicted" if bench else "measured here", "the test's"),
        Hardware("cpu", "CPU over ethernet", 1, 0),
        run_plan=SimpleNamespace(plan=SimpleNamespace(chosen=chosen)),  # type: ignore[arg-type]
        settle_arguments=tuple(bench.split()) if bench else (),
        settle_seconds=60.0 if bench else 0.0,
    )
    return Target(row, "cpu", None, nodes=2, gpus_per_node=1, calibration=calibration, calibration_file=None)


def task_of(target: Target, arguments: list[str]) -> LaunchTask:
    return LaunchTask(
        "benchtrain-tiny",
        [target],
        [],
        arguments,
        [],
        DiskSize(GB, ""),
        Spot(False, "", 0.0),
        Duration(600.0, ""),
        1800.0,
        "0.1.0",
        "tiny",
    )


def scripts(task: LaunchTask, folder: Path) -> dict[str, Path]:
    """The task's run script as each engine's file holds it."""
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for engine in ("skypilot", "dstack"):
        written[engine] = folder / f"{engine}.sh"
        written[engine].write_text(run_script(task, engine))
    return written


def run_until_paused(
    script: Path, root: Path, logs: Path, engine: str, phase: str, monkeypatch: pytest.MonkeyPatch, processes: int = 2
) -> None:
    """The task on both nodes until `processes` of them reach `phase` (both: every rank does it; one: rank 0 alone
    writes), then every process of both nodes killed with -9."""
    marker = logs.with_suffix(".paused")
    monkeypatch.setenv(PAUSE_AT, phase)
    monkeypatch.setenv(PAUSE_FILE, str(marker))
    nodes = start_nodes(script, root, logs, engine)
    monkeypatch.delenv(PAUSE_AT)
    monkeypatch.delenv(PAUSE_FILE)
    try:
        deadline = time.monotonic() + 400
        while not marker.exists() or len(marker.read_text().splitlines()) < processes:
            ended = [node.poll() for node in nodes if node.poll() is not None]
            if ended or time.monotonic() > deadline:
                pytest.fail(f"the nodes did not reach {phase}: {(logs / 'node0.err').read_text()[-3000:]}")
            time.sleep(0.05)
    finally:
        kill_nodes(nodes)


def record(root: Path) -> dict[str, Any]:
    return json.loads((root / "run" / "run.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_run_scripts_killed_at_every_phase_end_as_the_uninterrupted_run(
    home: Path, heavy_tailed_jsonl: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    arguments = ["--data", str(heavy_tailed_jsonl), "--deadline", "30m", "--effective-batch", "4", "--max-length", "64"]
    arguments += ["--max-steps", "4", "--eval-split", "0.1", "--checkpoint-interval", "0.001s"]
    measured_first = scripts(task_of(cpu_target(BENCH, None), arguments), tmp_path / "scripts")
    root, logs = tmp_path / "root", tmp_path / "logs"

    # Killed during the bench: nothing stored, so the restart benches again (no run.json yet).
    run_until_paused(measured_first["dstack"], root, logs / "bench", "dstack", "bench", monkeypatch, 1)
    assert not (root / "run" / "run.json").exists()
    # Killed before step 3: bench done across both nodes, steps 1 and 2 checkpointed.
    run_until_paused(measured_first["skypilot"], root, logs / "step", "skypilot", "step:3", monkeypatch)
    (calibration_path,) = (root / "run" / "home" / "calibrations").glob("*.json")
    calibration = json.loads(calibration_path.read_text())
    assert calibration["distributed"]["world_size"] == 2 and calibration["hardware"]["interconnect"] == "2x1:ethernet"
    measured = tmp_path / "measured.json"  # as bench stored it, before a run fed its speed back
    shutil.copy(calibration_path, measured)
    assert [path.name for path in list_checkpoints(root / "run" / "checkpoints")][-1] == "step-0000002"
    # Killed while writing checkpoint 3: it is not one (no marker); the restart continues from step 2.
    run_until_paused(measured_first["dstack"], root, logs / "checkpoint", "dstack", "checkpoint:3", monkeypatch, 1)
    assert [path.name for path in list_checkpoints(root / "run" / "checkpoints")][-1] == "step-0000002"
    # Killed during the final evaluation, after the last checkpoint: every step is done, nothing after them.
    run_until_paused(measured_first["skypilot"], root, logs / "evaluation", "skypilot", "evaluation:4", monkeypatch)
    assert list_checkpoints(root / "run" / "checkpoints")[-1].name == "step-0000004"
    killed_in_evaluation = record(root)
    assert killed_in_evaluation["status"] in ("planned", "running") and killed_in_evaluation["phases"]["done"] == []
    assert not (root / "run" / "final").exists()
    # Killed during the export: the steps and the final evaluation ended; final/ is not there (written whole or not).
    run_until_paused(measured_first["dstack"], root, logs / "export", "dstack", "export", monkeypatch, 1)
    stranded = record(root)
    assert stranded["status"] in ("planned", "running") and stranded["phases"]["done"] == ["steps", "evaluation"]
    assert not (root / "run" / "final").exists()
    # Killed during the report: final/ and the status written; the report not.
    run_until_paused(measured_first["skypilot"], root, logs / "report", "skypilot", "report", monkeypatch, 1)
    reported = record(root)
    assert reported["phases"]["done"] == ["steps", "evaluation", "export"] and reported["status"] == "step_limit"
    assert (root / "run" / "final").is_dir() and not (root / "run" / "report.html").exists()
    # The same command once more: the report, and the run is done.
    wait_nodes(start_nodes(measured_first["dstack"], root, logs / "last", "dstack"), logs / "last")
    killed = record(root)

    # The uninterrupted run: the same task from the same calibration, measured already.
    whole_root = tmp_path / "whole"
    (whole_root / "calibrations").mkdir(parents=True)
    shutil.copy(measured, whole_root / "calibrations" / measured.name)
    calibrated = cpu_target(None, f"{CALIBRATIONS_DIR}/{measured.name}")
    whole_script = scripts(task_of(calibrated, arguments), tmp_path / "whole-scripts")["skypilot"]
    wait_nodes(start_nodes(whole_script, whole_root, logs / "whole"), logs / "whole")
    whole = record(whole_root)

    assert killed["calibration_id"] == whole["calibration_id"] == calibration["id"]
    assert killed["plan"]["configuration"] == whole["plan"]["configuration"] and killed["plan"]["world_size"] == 2
    assert killed["resumed"] == 5 and killed["status"] == whole["status"] == "step_limit"
    assert (
        killed["phases"]
        == whole["phases"]
        == {"planned": ["steps", "evaluation", "export", "report"]}
        | {"done": ["steps", "evaluation", "export", "report"]}
    )
    assert [entry["step"] for entry in killed["losses"]] == [entry["step"] for entry in whole["losses"]] == [1, 2, 3, 4]
    assert [entry["learning_rate"] for entry in killed["losses"]] == pytest.approx(
        [entry["learning_rate"] for entry in whole["losses"]]
    )
    assert [entry["loss"] for entry in killed["losses"]] == pytest.approx(
        [entry["loss"] for entry in whole["losses"]], rel=1e-4
    )
    assert killed["evals"][-1]["eval_loss"] == pytest.approx(whole["evals"][-1]["eval_loss"], rel=1e-4)
    assert killed["final"]["partial"] is False and (root / "run" / "report.html").is_file()
    load_final(root / "run" / "final")


# -- the shutdown grace ------------------------------------------------------------------------


def test_the_shutdown_grace_is_the_plans_measured_save_and_reaches_torchrun_and_the_engines(
    home: Path, chats: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A stop after SIGTERM runs the step in flight, then the checkpoint, the final evaluation, final/ and the report:
    the grace is those as the plan priced them from the calibration's measurements, at the plan's bound."""
    argv = ["--dry-run", "--json", "--deadline", "12h", "--model", "llama-3.2-1b", "--use-calibration"]
    argv += ["h100-llama-3.2-1b", "--data", str(chats)]
    tasks = {engine: tmp_path / f"{engine}.yaml" for engine in ("skypilot", "dstack")}
    for engine, path in tasks.items():
        code, out, err = run_main("train", [*argv, "--emit", f"{engine}:{path}"], capsys)
        assert code == 0, err
    chosen = json.loads(out)["plan"]["chosen"]
    overheads = chosen["overheads"]
    after = sum(
        overheads[key]
        for key in ("checkpoint_seconds", "export_seconds", "eval_pass_seconds", "report_seconds", "upload_seconds")
    )
    step = chosen["step_seconds"] / chosen["remaining_steps"]
    grace = math.ceil((step + after) * (1 + chosen["bound_fraction"]))
    assert overheads["checkpoint_seconds"] > 0 and overheads["export_seconds"] > 0  # measured figures, not an allowance
    skypilot = yaml.safe_load(tasks["skypilot"].read_text())
    dstack = yaml.safe_load(tasks["dstack"].read_text())
    for script in (skypilot["run"], dstack["commands"][1]):
        assert f"GRACE={grace}  #" in script and '--shutdown-timeout "$GRACE"' in script
    assert "timeout --signal=TERM --kill-after=$((GRACE + 1)) " in skypilot["run"]
    assert (
        dstack["stop_duration"] == f"{grace + 1}s"
    )  # dstack's stop waits as long, and its kill comes after torchrun's
    assert f"Shutdown grace: {grace}" in tasks["dstack"].read_text().replace(".0s", "")


WORKER = """
import os, signal, sys, time
from pathlib import Path

folder = Path(sys.argv[1])

def save(number, frame):
    time.sleep(3)  # a checkpoint and an export that take longer than a short grace
    (folder / "saved").write_text("saved")
    sys.exit(0)

signal.signal(signal.SIGTERM, save)
(folder / "ready").write_text(str(os.getpid()))
while True:
    time.sleep(1)
"""


def stopped_worker_saved(after_training_seconds: float, folder: Path) -> bool:
    """The SkyPilot run script's own launch (timeout, then torchrun with the target's grace) of a worker that saves
    for 3 s after SIGTERM, stopped as SkyPilot or the duration stops it: whether the worker finished saving."""
    folder.mkdir(parents=True)
    (folder / "worker.py").write_text(WORKER)
    script = run_script(task_of(cpu_target(None, "latest", after_training_seconds), []), "skypilot")
    script = script.replace('-m benchtrain.train "${TRAIN[@]}"', f"{folder / 'worker.py'} {folder}")
    (folder / "run.sh").write_text(script)
    environment = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "SKYPILOT_NODE_IPS": "127.0.0.1",
        "SKYPILOT_NUM_NODES": "1",
        "SKYPILOT_NODE_RANK": "0",
        "SKYPILOT_NUM_GPUS_PER_NODE": "0",
        "BENCHTRAIN_TASK_ROOT": str(folder),
        "BENCHTRAIN_MASTER_PORT": str(free_port()),
    }
    with open(folder / "node.err", "w") as errors:
        node = subprocess.Popen(["bash", str(folder / "run.sh")], env=environment, stderr=errors, stdout=errors)
        deadline = time.monotonic() + 120
        while not (folder / "ready").exists():
            assert node.poll() is None and time.monotonic() < deadline, (folder / "node.err").read_text()[-2000:]
            time.sleep(0.05)
        node.send_signal(signal.SIGTERM)  # to `timeout` (the script execs it), which passes it on to torchrun
        node.wait(timeout=120)
    return (folder / "saved").exists()


@pytest.mark.slow
def test_torchrun_waits_the_grace_for_a_worker_that_saves_after_sigterm(tmp_path: Path) -> None:
    """A grace of 1 s (a plan whose saves take a second) ends the worker before it has saved; one of 7 s lets it save:
    torchrun waits what the script gives it, where its default would kill after 30 s whatever the save takes."""
    assert not stopped_worker_saved(0.5, tmp_path / "short")
    assert stopped_worker_saved(6.0, tmp_path / "long")
