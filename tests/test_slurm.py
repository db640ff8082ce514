"""`train --dry-run --emit slurm:FILE` on a real scheduler: Debian's slurm-wlm, slurmctld and slurmd on this machine
(scripts/slurm.sh, started here when absent). The emitted sbatch script completes with a final/ that loads; a job whose
--time is shorter than its run is signalled, saves, is requeued and ends with the steps, learning rates and losses of an
uninterrupted run; `scancel --signal=USR1 --batch` does the same. And the task installs the benchtrain that made the
plan: the wheel written beside it, in a fresh environment, from a folder with a decoy train.py. No network."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers import cpu_calibration, run_main

from benchtrain.calibration.store import save_calibration
from benchtrain.train.running.checkpoint import list_checkpoints

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "slurm.sh"


@pytest.fixture(scope="session")
def slurm() -> dict[str, str]:
    """The environment SLURM's clients need (SLURM_CONF), with the daemons running: started by scripts/slurm.sh when
    absent. Skipped only where they cannot be (no root to install or start them)."""
    if os.geteuid() != 0:
        pytest.skip("SLURM tests: scripts/slurm.sh installs and starts slurmctld/slurmd as root, and this is not root")
    started = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=600)
    if started.returncode != 0 or shutil.which("sbatch") is None:
        pytest.skip(f"SLURM tests: scripts/slurm.sh could not install or start SLURM: {started.stderr.strip()[-500:]}")
    return {"SLURM_CONF": started.stdout.strip().splitlines()[-1]}


def chat_texts(path: Path, count: int) -> Path:
    rng = random.Random(7)
    with path.open("w") as handle:
        for _ in range(count):
            length = min(900, max(10, int(rng.lognormvariate(4.2, 0.8))))
            handle.write(json.dumps({"text": "".join(rng.choice("abcdefgh ") for _ in range(length))}) + "\n")
    return path


def emit_slurm(capsys: pytest.CaptureFixture[str], tmp_path: Path, data: Path, *options: str) -> Path:
    """The sbatch script of a 1-process CPU plan of the tiny model."""
    save_calibration(cpu_calibration("cpu-one"))
    script = tmp_path / "job.sh"
    argv = ["--dry-run", "--use-calibration", "cpu-one", "--data", str(data), "--deadline", "30m"]
    code, _, err = run_main("train", [*argv, *options, "--emit", f"slurm:{script}"], capsys)
    assert code == 0, err
    return script


def test_the_sbatch_script_holds_the_plan(home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The #SBATCH lines come from the plan: one node, one agent per node, --time the maximum duration with a
    preemption, the signal's lead what the plan measured, requeue and appended output; bash reads the script."""
    from benchtrain.train.launch_slurm import slurm_time

    data = chat_texts(tmp_path / "data.jsonl", 300)
    script = emit_slurm(capsys, tmp_path, data, "--effective-batch", "4", "--json")
    text = script.read_text()
    settings = dict(re.findall(r"^#SBATCH --([a-z-]+)=?(\S*)", text, re.MULTILINE))
    assert settings["nodes"] == "1" and settings["ntasks-per-node"] == "1" and "gpus-per-node" not in settings
    assert "requeue" in settings and settings["open-mode"] == "append"
    lead = int(settings["signal"].removeprefix("B:USR1@"))
    assert 1 <= lead < 60  # a step, a checkpoint and an export of the tiny model on CPU
    limit = re.search(r"^# Time limit: .*", text, re.MULTILINE)
    assert limit is not None and "one preemption" in limit.group(0) and "to install benchtrain" in limit.group(0)
    # at most the deadline + the install (the guard has stopped the run by then), at least a minute
    assert slurm_time(60) <= settings["time"] <= slurm_time(30 * 60 + 15 * 60)
    assert "benchtrain==" not in text and (tmp_path / "benchtrain-0.1.0-py3-none-any.whl").is_file()
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in text and "--resume auto" in text
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def test_the_task_installs_the_package_that_made_the_plan(
    home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The emitted setup installs the wheel written beside the task (the running benchtrain, its files as they are
    here) into a fresh environment; `import benchtrain` there finds it, from a folder with a decoy train.py."""
    import benchtrain

    data = chat_texts(tmp_path / "data.jsonl", 50)
    task = tmp_path / "task" / "task.yaml"
    save_calibration(cpu_calibration("cpu-one"))
    argv = ["--dry-run", "--use-calibration", "cpu-one", "--data", str(data), "--deadline", "30m"]
    code, _, err = run_main("train", [*argv, "--emit", f"skypilot:{task}"], capsys)
    assert code == 0, err
    loaded = yaml.safe_load(task.read_text())
    (wheel,) = (tmp_path / "task").glob("benchtrain-*.whl")
    assert loaded["file_mounts"][f"/benchtrain/{wheel.name}"] == str(wheel)
    assert "benchtrain==" not in loaded["setup"]
    # The node: the uploads under the task's root, a fresh environment (the machine's packages seen, not ours).
    root = tmp_path / "node"
    root.mkdir()
    shutil.copy(wheel, root / wheel.name)
    fresh = tmp_path / "fresh"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--system-site-packages", "--without-pip", str(fresh)], check=True)
    environment = {
        **{key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")},
        "PATH": f"{fresh / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "BENCHTRAIN_TASK_ROOT": str(root),
        "PIP_NO_INDEX": "1",  # no network: the wheel alone (its dependencies are the node's business)
        "PIP_NO_DEPS": "1",
    }
    installed = subprocess.run(["bash", "-c", loaded["setup"]], env=environment, capture_output=True, text=True)
    assert installed.returncode == 0, installed.stderr
    decoy = tmp_path / "elsewhere"
    decoy.mkdir()
    (decoy / "train.py").write_text("raise SystemExit('the decoy train.py was imported')\n")
    found = subprocess.run(
        [str(fresh / "bin" / "python"), "-c", "import benchtrain, sys; print(benchtrain.__file__)"],
        cwd=decoy,
        env=environment,
        capture_output=True,
        text=True,
    )
    assert found.returncode == 0, found.stderr
    location = Path(found.stdout.strip())
    assert location.is_relative_to(fresh) and location.parent.name == "benchtrain"
    ours = Path(benchtrain.__file__).parent
    for name in ("train/launch_slurm.py", "train/recipes/launch_task.py"):
        assert (location.parent / name).read_bytes() == (ours / name).read_bytes()


# -- on the scheduler -------------------------------------------------------------------------


def submit(slurm: dict[str, str], script: Path, root: Path, *options: str) -> str:
    """sbatch the script with the task's root at `root`, where the environment is already set up (this venv)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "venv").symlink_to(Path(sys.prefix))
    environment = {
        **os.environ,
        **slurm,
        "BENCHTRAIN_TASK_ROOT": str(root),
        "BENCHTRAIN_MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
        # Each step waits (benchtrain.common.pause): the run trains for over two minutes on any machine, so SLURM's
        # signal (sent up to 60 s early: its checks come about every 30-60 s) comes while it trains; waits cost no CPU.
        "BENCHTRAIN_TEST_STEP_SECONDS": "3",
    }
    command = ["sbatch", "--parsable", f"--output={root}/job.out", *options, str(script)]
    submitted = subprocess.run(command, env=environment, capture_output=True, text=True, cwd=root, check=True)
    return submitted.stdout.strip().split(";")[0]


def free_port() -> int:
    """A port nobody listens on now (the rendezvous store's)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def job_field(slurm: dict[str, str], job: str, field: str) -> str | None:
    shown = subprocess.run(
        ["scontrol", "show", "job", job], env={**os.environ, **slurm}, capture_output=True, text=True
    )
    found = re.search(rf"\b{field}=(\S*)", shown.stdout)
    return found.group(1) if found else None


def control(slurm: dict[str, str], *arguments: str) -> None:
    subprocess.run(arguments, env={**os.environ, **slurm}, check=True, capture_output=True)


def wait_for(condition: object, what: str, log: Path, seconds: float = 400) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return
        time.sleep(0.5)
    pytest.fail(
        f"{what}: not within {seconds:.0f}s; the job's output: {log.read_text()[-3000:] if log.exists() else ''}"
    )


def requeued_again(slurm: dict[str, str], job: str, restarts: int) -> bool:
    """Back in the queue after its `restarts`-th stop: made eligible in 5 s (a requeued job waits ~2 minutes otherwise)."""
    if job_field(slurm, job, "Restarts") != str(restarts) or job_field(slurm, job, "JobState") != "PENDING":
        return False
    # Eligible a few seconds from now, not now: slurmd refuses a job's new credential made in the same second it revoked
    # the old one ("Job credential revoked": its times are whole seconds), which a start at once can hit.
    control(slurm, "scontrol", "update", f"JobId={job}", "StartTime=now+5", "TimeLimit=30")
    return True


ALL_STEPS = ("completed", "step_limit")  # every planned step ran (a resumed run reaching its total says step_limit)


def ended(slurm: dict[str, str], job: str, run: Path) -> bool:
    if job_field(slurm, job, "JobState") not in (None, "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
        return False
    return (run / "run.json").is_file() and json.loads((run / "run.json").read_text())["status"] in ALL_STEPS


@pytest.mark.slow
@pytest.mark.scheduler
@pytest.mark.timeout(900)
def test_sbatch_runs_the_plan_and_a_signal_saves_requeues_and_continues(
    home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], slurm: dict[str, str]
) -> None:
    """Two jobs of the same emitted script at once: one as emitted (the uninterrupted run: it ends with a final/ that
    loads), one with --time=3: SLURM's signal comes before the limit, the run saves a checkpoint and stops, the job
    requeues itself; started again it continues, and `scancel --signal=USR1 --batch` stops it the same way; it ends
    with the uninterrupted run's steps, learning rates and losses."""
    from transformers import AutoModelForCausalLM

    data = chat_texts(tmp_path / "data.jsonl", 1000)
    script = emit_slurm(capsys, tmp_path, data, "--effective-batch", "4", "--checkpoint-interval", "1s", "--no-report")
    whole, signalled = tmp_path / "whole", tmp_path / "signalled"
    reference = submit(slurm, script, whole)
    # The signal 60 s before a 3-minute limit: SLURM sends it up to 60 s early, so 60-120 s in, after the start-up
    # (about 10 s) and before the run's end (46 steps of at least 3 s each).
    job = submit(slurm, script, signalled, "--time=3", "--signal=B:USR1@60")
    log = signalled / "job.out"
    wait_for(lambda: requeued_again(slurm, job, 1), "the time limit's signal and the requeue", log)
    first = json.loads((signalled / "run" / "run.json").read_text())
    assert first["status"] == "interrupted" and list_checkpoints(signalled / "run" / "checkpoints"), first["status"]
    stopped_at = len(first["losses"])
    # Started again (--resume auto): a new checkpoint, then scancel's USR1 to the batch shell.
    wait_for(
        lambda: int(list_checkpoints(signalled / "run" / "checkpoints")[-1].name.split("-")[1]) > stopped_at,
        "a checkpoint after the restart",
        log,
    )
    control(slurm, "scancel", "--signal=USR1", "--batch", job)
    wait_for(lambda: requeued_again(slurm, job, 2), "scancel's signal and the requeue", log)
    wait_for(lambda: ended(slurm, reference, whole / "run"), "the uninterrupted job", whole / "job.out")
    wait_for(lambda: ended(slurm, job, signalled / "run"), "the job", log)

    record = json.loads((whole / "run" / "run.json").read_text())
    assert record["status"] == "completed", (whole / "job.out").read_text()[-2000:]
    AutoModelForCausalLM.from_pretrained(whole / "run" / "final")
    resumed = json.loads((signalled / "run" / "run.json").read_text())
    assert resumed["status"] in ALL_STEPS and resumed["resumed"] == 2
    assert log.read_text().count("back in the queue") == 2
    assert [entry["step"] for entry in resumed["losses"]] == [entry["step"] for entry in record["losses"]]
    assert [entry["learning_rate"] for entry in resumed["losses"]] == pytest.approx(
        [entry["learning_rate"] for entry in record["losses"]]
    )
    assert [entry["loss"] for entry in resumed["losses"]] == pytest.approx(
        [entry["loss"] for entry in record["losses"]], rel=1e-4
    )
    AutoModelForCausalLM.from_pretrained(signalled / "run" / "final")


def test_a_shared_calibrations_strings_stay_in_the_sbatch_scripts_comments(
    home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A shared calibration's device name with line breaks and a command substitution: in the sbatch script it stays
    on its comment line (bash runs no line that holds it), and the #SBATCH lines are untouched."""
    bundled = Path(__file__).parents[1] / "benchtrain" / "calibration" / "bundled" / "h100-llama-3.2-1b.json"
    data = json.loads(bundled.read_text())
    data["hardware"]["name"] = f"{data['hardware']['name']}\nname: $(touch PWNED)\u2028#SBATCH --nodes=9\r#"
    shared = tmp_path / "shared.json"
    shared.write_text(json.dumps(data))
    script = tmp_path / "job.sh"
    chats = chat_texts(tmp_path / "data.jsonl", 50)
    argv = ["--dry-run", "--use-calibration", str(shared), "--force", "--model", "llama-3.2-1b", "--data", str(chats)]
    code, _, err = run_main("train", [*argv, "--deadline", "12h", "--emit", f"slurm:{script}"], capsys)
    assert code == 0, err
    text = script.read_text()
    assert "touch PWNED" in text
    for line in text.splitlines():
        assert "PWNED" not in line or line.lstrip().startswith("#"), line
    assert re.findall(r"^#SBATCH --nodes=(\d+)", text, re.MULTILINE) == ["1"]
    assert "#SBATCH --gpus-per-node=1" in text
