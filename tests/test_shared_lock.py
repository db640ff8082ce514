"""One train per run folder across machines: the holder file (common.shared_lock) that a run folder on shared storage
keeps, where flock holds on one machine only."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from benchtrain.common.errors import BenchtrainError
from benchtrain.train.planning.disk import HOLDER_FILE, run_lock


def holder(path: Path, host: str, pid: int, age: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"host": host, "pid": pid, "since": time.time() - age}))
    os.utime(path, (time.time() - age, time.time() - age))


def test_a_train_on_another_machine_holding_the_folder_is_refused_in_one_line(tmp_path: Path) -> None:
    out = tmp_path / "run"
    holder(out / HOLDER_FILE, "node-elsewhere", 4242, age=5.0)  # refreshed 5 s ago by a train on another machine
    with pytest.raises(BenchtrainError) as refused:
        with run_lock(out):
            pass
    message = str(refused.value)
    assert (
        "\n" not in message and "in use by train on node-elsewhere (pid 4242" in message and "another --out" in message
    )
    assert json.loads((out / HOLDER_FILE).read_text())["host"] == "node-elsewhere"  # still theirs


def test_a_stale_holder_is_taken_over_and_the_lock_is_released(tmp_path: Path) -> None:
    out = tmp_path / "run"
    holder(out / HOLDER_FILE, "preempted-node", 4242, age=3600.0)  # a machine gone an hour ago: not refreshed since
    with run_lock(out):
        mine = json.loads((out / HOLDER_FILE).read_text())
        assert (mine["host"], mine["pid"]) == (socket.gethostname(), os.getpid())
        with pytest.raises(BenchtrainError, match="is in use by"):  # a second train here: flock says so first
            with run_lock(out):
                pass
    assert not (out / HOLDER_FILE).exists()
    holder(out / HOLDER_FILE, socket.gethostname(), 999_999_999, age=0.0)  # this host, a pid that is not running
    with run_lock(out):
        assert json.loads((out / HOLDER_FILE).read_text())["pid"] == os.getpid()
