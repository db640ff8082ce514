"""A multi-process bench that dies keeps what it measured (issue #39, fault 6's remainder), and no
rank waits on another longer than the work it waits for (the compile-cache child).

- An out-of-memory on one rank between a step's collectives (FSDP's forward/backward at any step,
  DDP's backward) cannot be agreed: the others wait in a collective until the job is ended. Rank 0
  now writes the rows measured so far after every probe (bench.calibrate.KeptRows), `bench list` and the
  bench's last words name them, and the probe's collectives give up after a multiple of its price
  instead of NCCL's 10 minutes (bench.probe_tasks).
- Rank 0's compile-cache child runs up to 900 s while the others waited in a collective that NCCL's
  watchdog ends after 10 minutes; they now wait on the launcher's store.
The multi-process checks run under torchrun with gloo (tests/distributed_checks.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

CHECKS = Path(__file__).resolve().parent / "distributed_checks.py"


def unfinished_files(home: Path) -> list[Path]:
    return sorted((home / "calibrations" / "unfinished").glob("*.json"))


def bench_list(capsys: pytest.CaptureFixture[str]) -> str:
    from benchtrain.bench.cli import main

    capsys.readouterr()
    assert main(["list"]) == 0
    return capsys.readouterr().out


def simulated_bench_keeping_rows(
    monkeypatch: pytest.MonkeyPatch, fail_at_probe: int | None = None
) -> tuple[dict[str, Any], list[list[dict]], Any]:
    """A simulated H100 bench (tests/simulated.py) that keeps its rows as `bench run` does; the file's
    rows after every probe; `fail_at_probe`: that probe raises (a collective that gave up)."""
    from functools import partial

    from simulated import SimulatedDevice, simulate_bench

    import benchtrain.bench.calibrate as calibrate

    monkeypatch.setattr(calibrate, "BenchRun", partial(calibrate.BenchRun, keep_rows=True))
    on_disk: list[list[dict]] = []
    payloads: list[dict] = []
    add, probe = calibrate.KeptRows.add, SimulatedDevice._probe

    def add_and_read(kept: Any, row: dict[str, Any]) -> None:
        add(kept, row)
        on_disk.append(json.loads(Path(kept.path).read_text())["measurements"])

    def probe_or_fail(device: Any, payload: dict[str, Any]) -> dict[str, Any]:
        payloads.append(payload)
        if len(payloads) == fail_at_probe:
            raise RuntimeError("[gloo] Timed out waiting 5000ms for recv operation to complete")
        return probe(device, payload)

    monkeypatch.setattr(calibrate.KeptRows, "add", add_and_read)
    monkeypatch.setattr(SimulatedDevice, "_probe", probe_or_fail)
    record, _ = simulate_bench("llama-3.2-1b", lora=False, budget=120)
    return record, on_disk, payloads


def test_the_rows_are_on_disk_after_every_probe_and_storing_the_calibration_removes_them(
    home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchtrain.bench.probe_tasks import COLLECTIVE_TIMEOUT_FLOOR
    from benchtrain.calibration.store import UNFINISHED_KEY, resolve_calibration, save_calibration, save_failed
    from benchtrain.common.errors import BenchtrainError

    record, on_disk, payloads = simulated_bench_keeping_rows(monkeypatch)
    probes = [row for row in record["measurements"] if "predicted" in row]  # not those left out
    # after every probe
    assert len(on_disk) >= len(probes) >= 4 and [len(rows) for rows in on_disk] == list(range(1, len(on_disk) + 1))
    (kept,) = unfinished_files(home)
    assert record[UNFINISHED_KEY] == str(kept)
    with pytest.raises(BenchtrainError, match="no calibration"):
        resolve_calibration("latest")  # never planned from
    assert f"unfinished bench {kept}" in bench_list(capsys)
    # Every probe's collectives give up after a multiple of its price, never NCCL's 10 minutes.
    assert all(payload["timeout_seconds"] >= COLLECTIVE_TIMEOUT_FLOOR for payload in payloads)
    assert max(payload["timeout_seconds"] for payload in payloads) < 600

    saved = save_calibration(record)
    assert not kept.exists() and unfinished_files(home) == []
    assert UNFINISHED_KEY not in json.loads(saved.read_text())
    assert "unfinished bench" not in bench_list(capsys)
    # A bench that fitted nothing keeps its record as failed, which replaces its rows.
    from benchtrain.calibration.store import keep_unfinished

    rows = keep_unfinished({"id": "cpu-tiny-20260101-000000", "measurements": []})
    failed = save_failed({"id": "cpu-tiny-20260101-000000", "measurements": [], UNFINISHED_KEY: str(rows)})
    assert (
        unfinished_files(home) == []
        and failed.parent.name == "failed"
        and UNFINISHED_KEY not in json.loads(failed.read_text())
    )


def test_a_bench_that_fails_after_some_probes_says_where_their_rows_are(
    home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The third probe's collective gives up: the bench's one line names the file that holds the
    two probes before it (before, an internal error, and nothing on disk); so does the next bench."""
    from types import SimpleNamespace

    from benchtrain.bench.calibrate import BenchStopped, KeptRows

    with pytest.raises(BenchStopped) as stopped:
        simulated_bench_keeping_rows(monkeypatch, fail_at_probe=3)
    (kept,) = unfinished_files(home)
    rows = json.loads(kept.read_text())["measurements"]
    assert len(rows) == 2 and all(row["status"] == "ok" for row in rows)
    message = str(stopped.value)
    assert (
        message.startswith("the bench stopped after 2 probes (2 ok), on RuntimeError: [gloo] Timed out")
        and str(kept) in message
    )
    assert stopped.value.exit_code == 1

    monkeypatch.setattr(KeptRows, "written_here", set())  # the next bench is another process
    space = SimpleNamespace(as_dict=dict)
    task = SimpleNamespace(
        device_label="h100",
        model={"name": "tiny"},
        hardware={},
        software={},
        training={},
        requested_device=None,
        data=None,
    )
    capsys.readouterr()
    KeptRows(SimpleNamespace(**vars(task), world_size=2, sharding="fsdp", search="grid", space=space)).add(
        {"status": "ok"}
    )
    assert f"earlier benches that did not finish left theirs in {kept}" in capsys.readouterr().err


def test_the_probes_collectives_give_up_after_a_multiple_of_its_price() -> None:
    from benchtrain.bench.probe_tasks import (
        COLLECTIVE_TIMEOUT_FACTOR,
        COLLECTIVE_TIMEOUT_FLOOR,
        collectives_give_up_after,
        probe_timeout_seconds,
    )

    assert probe_timeout_seconds(1.0) == COLLECTIVE_TIMEOUT_FLOOR  # a cheap probe: the floor
    # a long compiled one: beyond NCCL's 10 minutes
    assert probe_timeout_seconds(300.0) == 300.0 * COLLECTIVE_TIMEOUT_FACTOR
    with collectives_give_up_after(5.0):  # one process: nothing to set
        pass


# -- the compile-cache child: the other ranks wait on the store -----------------------------------------


def test_the_other_ranks_wait_for_rank_0s_compile_child_on_the_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's compile-cache child takes 700 s: rank 1 waits on the launcher's store that long (a
    collective would have been ended by NCCL's watchdog after 600 s), then goes on to exchange the
    result; a rank 0 that never comes ends the wait once the child's own timeout has passed."""
    from torch.distributed import HashStore

    import benchtrain.bench.probe_tasks as probe_tasks

    store, clock = HashStore(), {"now": 0.0}
    child_seconds = 700.0

    def tick() -> float:
        clock["now"] += 5.0
        if clock["now"] >= child_seconds and store.add(probe_tasks.COMPILE_CACHE_KEY + "/0", 0) < 2:
            store.add(probe_tasks.COMPILE_CACHE_KEY + "/0", 1)  # rank 0's child is done
        return clock["now"]

    follower = probe_tasks.JobStore(store, world_size=2, rank=1, clock=tick, pause=lambda seconds: None)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(probe_tasks.JobStore, "of_this_job", classmethod(lambda cls: follower))
    coordinator = probe_tasks.probe_coordinator(workload=None, peak_flops=None)
    task = {"row": {"micro_batch_size": 2, "seq_len": 64}, "timeout_seconds": 900.0}
    assert coordinator.handlers["compile_cache"](task) == {}
    assert clock["now"] >= child_seconds  # it waited for rank 0's child, past NCCL's 600 s

    def later() -> float:
        clock["now"] += 5.0
        return clock["now"]

    alone = probe_tasks.JobStore(HashStore(), world_size=2, rank=1, clock=later, pause=lambda seconds: None)
    clock["now"] = 0.0
    with pytest.raises(RuntimeError, match="did not end within 960 s"):
        probe_tasks.compile_cache_task(None, task, "never", alone)
    assert clock["now"] > 900.0  # not before the child's own timeout

    # Rank 0 counts itself in once its child is done, even when timing it failed.
    leader = probe_tasks.JobStore(store, world_size=2, rank=0)
    monkeypatch.setattr(
        probe_tasks,
        "measure_cached_compile",
        lambda workload, row, timeout: {"first_step_seconds": 9.0, "timeout": timeout},
    )
    assert probe_tasks.compile_cache_task(None, task, "leader", leader) == {"first_step_seconds": 9.0, "timeout": 900.0}
    assert store.add("leader", 0) == 1


# -- under torchrun: one rank fails between a step's collectives ------------------------------------------


def run_until_killed(command: list[str], env: dict[str, str], timeout: float) -> tuple[int | None, str, str]:
    """(exit code or None when killed at `timeout`, stdout, stderr) of a launcher and its workers."""
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
        return process.returncode, stdout, stderr
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        return None, stdout, stderr


@pytest.mark.slow
@pytest.mark.parametrize(("sharding", "failure"), [("fsdp", "oom"), ("ddp", "stall")])
def test_the_rows_before_a_one_rank_failure_between_collectives_survive_the_bench(
    sharding: str, failure: str, home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`bench run` under two gloo processes; rank 1 fails in the middle of the third probe's second
    step's backward. "oom": it runs out of memory there (gloo aborts on the mismatched collective
    that follows; NCCL would wait for its watchdog). "stall": it stalls there 25 s first, and rank
    0's collective gives up after the probe's timeout (its floor made 5 s), well before rank 1
    wakes, and the bench says where the rows are. Either way the two probes before are on disk,
    and `bench list` names them; before, the job ended with every row lost."""
    from distributed_checks import STALL_SECONDS

    root = str(Path(__file__).resolve().parent.parent)
    pythonpath = os.pathsep.join(filter(None, [root, str(CHECKS.parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "BENCHTRAIN_HOME": str(home), "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(CHECKS),
        "rows-survive",
        sharding,
        failure,
    ]
    code, stdout, stderr = run_until_killed(command, env, timeout=120)
    (kept,) = unfinished_files(home)
    rows = json.loads(kept.read_text())["measurements"]
    assert len(rows) == 2 and all(row["status"] == "ok" and row["ranks"] == 2 for row in rows), stderr[-3000:]
    assert f"measurements so far are kept in {kept}" in stderr  # said before the first probe ended
    if failure == "stall":
        found = json.loads(stdout.strip().splitlines()[-1])
        # not waiting for rank 1
        assert found["code"] != 0 and found["failing_probe_seconds"] < STALL_SECONDS, stderr[-3000:]
        assert (
            "error: the bench stopped after 2 probes (2 ok), on RuntimeError:" in stderr and f"kept in {kept}" in stderr
        )
    else:
        assert code is None or code != 0
    monkeypatch.setenv("BENCHTRAIN_HOME", str(home))
    assert f"unfinished bench {kept}: started" in bench_list(capsys) and "2 probes measured (2 ok)" in bench_list(
        capsys
    )
