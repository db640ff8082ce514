"""Multi-process faults that no single-process test reaches (issue #39): a child process that
joined the job as a second rank 0 (the compile-cache probe), an out-of-memory on one rank after the
first step, ranks that planned for themselves, and a fixed wait at the end that ended rank 0's
upload. The multi-process checks run under torchrun with gloo (tests/distributed_checks.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pytest

# What torchrun's elastic agent (torch/distributed/elastic/agent/server/local_elastic_agent.py)
# and `accelerate launch` (accelerate/utils/launch.py) set for each worker.
TORCHRUN_SETS = {
    "RANK": "0",
    "LOCAL_RANK": "0",
    "GROUP_RANK": "0",
    "ROLE_RANK": "0",
    "ROLE_NAME": "default",
    "WORLD_SIZE": "2",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_WORLD_SIZE": "1",
    "ROLE_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29511",
    "TORCHELASTIC_RESTART_COUNT": "0",
    "TORCHELASTIC_MAX_RESTARTS": "0",
    "TORCHELASTIC_RUN_ID": "none",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
    "TORCHELASTIC_ERROR_FILE": "/tmp/error.json",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "ACCELERATE_USE_CPU": "true",
    "ACCELERATE_MIXED_PRECISION": "no",
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_SHARDING_STRATEGY": "FULL_SHARD",
}


# -- fault 3: the compile-cache probe's child joined the job as a second rank 0 ---------------------


def test_the_childs_environment_has_none_of_the_launchers_variables() -> None:
    from benchtrain.bench.fresh_process import single_process_environment

    parent = {
        **TORCHRUN_SETS,
        "PATH": "/usr/bin",
        "CUDA_VISIBLE_DEVICES": "3",
        "HF_HOME": "/hf",
        "OMP_NUM_THREADS": "1",
    }
    child = single_process_environment(parent)
    # the same device, the rest kept
    assert child == {
        "PATH": "/usr/bin",
        "CUDA_VISIBLE_DEVICES": "3",
        "HF_HOME": "/hf",
        "OMP_NUM_THREADS": "1",
    }


def test_the_compile_probes_child_process_does_not_see_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench.fresh_process.measure_in_new_process starts a real process (a stand-in for
    `python -m benchtrain.bench.fresh_process`, which would compile a model) from a rank of a torchrun job:
    it sees none of the variables that would make it join the job."""
    import subprocess

    import benchtrain.bench.fresh_process as fresh_process
    from benchtrain.train.workload.method import MethodConfig
    from benchtrain.train.workload.model import resolve_model

    for name, value in TORCHRUN_SETS.items():
        monkeypatch.setenv(name, value)
    real_popen = subprocess.Popen
    started: list[list[str]] = []

    def child(command: list[str], **options: Any) -> subprocess.Popen:
        started.append(command)
        report = "import json, os; print(json.dumps({'step_seconds': 1.0, 'seen': sorted(set(os.environ) & set(json.loads(os.sys.argv[1])))}))"
        return real_popen([sys.executable, "-c", report, json.dumps(sorted(TORCHRUN_SETS))], **options)

    monkeypatch.setattr(fresh_process.subprocess, "Popen", child)
    row = {"micro_batch_size": 2, "seq_len": 16}
    measured = fresh_process.measure_in_new_process(
        resolve_model("tiny"), MethodConfig(), "plain", row, timeout_seconds=60
    )
    assert started and started[0][1:3] == ["-m", "benchtrain.bench.fresh_process"]
    assert measured is not None and measured["seen"] == []


# -- fault 8: a fixed 600 s wait at the end ended rank 0 in the middle of its push -------------------


def test_the_wait_at_the_end_lasts_as_long_as_rank_0s_planned_export_and_push(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 16 GB push at the stated 20 MB/s takes 800 s, after a 60 s export: rank 1, done training,
    waits at the end (train.step.runtime.finish_together) that long and more, not a fixed 600 s
    after which it failed and the launcher ended rank 0 mid-upload."""
    from types import SimpleNamespace

    from torch.distributed import HashStore

    import benchtrain.train.step.runtime as runtime
    from benchtrain.train.planning.types import Overheads
    from benchtrain.train.recipes import recipe as module
    from benchtrain.train.running.resume import Continuation

    push_seconds = 16e9 / 20e6
    overheads = Overheads(
        model_build_seconds=5.0,
        warmup_seconds=1.0,
        checkpoint_seconds=40.0,
        checkpoint_count=1,
        export_seconds=60.0,
        eval_pass_seconds=0.0,
        eval_count=0,
        report_seconds=2.0,
        upload_seconds=push_seconds,
    )
    waits: list[float] = []

    def finish_together(timeout_seconds: float = runtime.FINISH_TIMEOUT_SECONDS) -> None:
        waits.append(timeout_seconds)

    def plan(recipe: Any) -> None:
        recipe.run = SimpleNamespace(plan=SimpleNamespace(chosen=SimpleNamespace(overheads=overheads)))

    monkeypatch.setattr(module, "finish_together", finish_together)  # where the recipe calls it
    monkeypatch.setattr(module.TrainConfig, "from_args", staticmethod(lambda args, started_at, continuation: None))
    for name, stand_in in {
        "setup": lambda recipe: None,
        "plan": plan,
        "show_plan": lambda recipe: True,
        "train": lambda recipe: None,
        "finish": lambda recipe: 0,
    }.items():
        monkeypatch.setattr(module.TrainRecipe, name, stand_in)
    assert module.run_training(argparse.Namespace(), 0.0, Continuation(), lambda folder: folder) == 0
    (wait,) = waits
    assert wait >= overheads.after_training_seconds + runtime.FINISH_TIMEOUT_SECONDS

    # Rank 1 at the end: rank 0 arrives once its export and push are done (862 s after the last step).
    store, clock = HashStore(), {"now": 0.0}
    rank0_arrives = overheads.export_seconds + push_seconds + overheads.report_seconds

    def tick() -> float:
        clock["now"] += 10.0
        if clock["now"] >= rank0_arrives and store.add("done", 0) < 2:
            store.add("done", 1)  # rank 0 reaches the end
        return clock["now"]

    runtime.wait_for_all(store, "done", 2, wait, clock=tick, pause=lambda seconds: None)
    assert clock["now"] >= rank0_arrives  # it waited for rank 0, and rank 0 finished its push
    with pytest.raises(RuntimeError, match="in time"):  # a rank that never comes still ends the wait
        runtime.wait_for_all(HashStore(), "done", 2, 100.0, clock=tick, pause=lambda seconds: None)
    assert runtime.finish_wait_seconds(0.0) == runtime.FINISH_TIMEOUT_SECONDS


# -- fault 6: an out-of-memory on one rank after the first step --------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_an_out_of_memory_on_one_rank_in_a_later_step_ends_the_probe_on_every_rank(sharding: str, fork_server) -> None:
    """Rank 1 alone runs out of memory in its second step's optimizer step (AdamW's temporaries),
    after that step's collectives: rank 0, already past them, went on into the next step's while
    rank 1 gathered its row, and the bench hung until the watchdog killed it with every row
    measured so far. Every step's outcome is now agreed: the probe is an OOM on every rank, and the
    next probe runs (DDP and FSDP, two gloo processes)."""
    from helpers import DISTRIBUTED_CHECKS as CHECKS

    found = fork_server.group_report(CHECKS, ["late-oom", sharding], timeout=90)
    assert found["sharding"] == sharding
    assert found["statuses"] == ["oom", "ok"]
    assert "rank 1, step 2" in found["errors"][0]  # the failing rank's row is the probe's


# -- fault 7: each rank planned for itself --------------------------------------------------------------


@pytest.mark.slow
def test_every_rank_trains_rank_0s_plan(home: Path, heavy_tailed_jsonl: Path, fork_server) -> None:
    """Rank 1 has spent 272 s more than rank 0 of a 5-minute deadline (its own clock; a slower
    tokenizing, a later start): planning for itself, --fit-deadline cut it to 32 of rank 0's 200
    steps, and the two ranks would have trained different runs (or hung in the first collective
    that differed). Rank 0's plan is every rank's; and a rank that still differs is refused, in one
    line, on every rank, before any step."""
    from helpers import DISTRIBUTED_CHECKS as CHECKS
    from helpers import synthetic_calibration

    from benchtrain.calibration.store import save_calibration
    from benchtrain.train.step.hardware import detect_hardware
    from benchtrain.train.workload.model import resolve_model

    tiny = {"name": "tiny", "parameter_count": 1, "fingerprint": resolve_model("tiny").fingerprint}
    save_calibration(synthetic_calibration(hardware=detect_hardware(), model=tiny))
    arguments = ["--epochs", "50", "--deadline", "5m", "--fit-deadline", "--effective-batch", "16"]
    found = fork_server.group_report(
        CHECKS, ["plans-agree", str(heavy_tailed_jsonl), "272", *arguments], env={"BENCHTRAIN_HOME": str(home)}
    )
    rank0, rank1 = found["plans"]
    assert "configuration" in rank0 and rank0["step_limit"] is None  # rank 0 trains every step it planned
    assert rank1 == rank0
    assert all(
        message.startswith("the processes disagree on what to train: rank 1's optimizer_steps is 11, rank 0's 10")
        for message in found["guard"]
    )
