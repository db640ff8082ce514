"""`bench run` under one process or several: rank 0 decides every probe, every rank runs it (named tasks).
Why: docs/design.md#bench-probe-tasks
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from benchtrain.bench.disk_write import measure_checkpoint, real_save_fits
from benchtrain.bench.fresh_process import CHILD_TIMEOUT, measure_in_new_process
from benchtrain.bench.probe import run_eval_probe, run_probe
from benchtrain.bench.step_split import profile_task
from benchtrain.bench.timing import ProbeSettings
from benchtrain.calibration.step_config import StepConfig
from benchtrain.common.console import is_main_process
from benchtrain.common.json_types import JsonDict
from benchtrain.train.planning.comm import measure_collectives, world
from benchtrain.train.step.runtime import wait_for_all

DONE = "done"
STATUS_RANK = {"ok": 0, "skipped": 1, "error": 2, "oom": 3}


def combine_rows(rows: list[JsonDict]) -> JsonDict:
    """One probe as seen by all ranks: the worst status; the slowest step; the largest peak."""
    worst = max(rows, key=lambda row: STATUS_RANK.get(row.get("status", "ok"), 2))
    if worst.get("status") != "ok":
        return dict(worst)
    slowest = max(rows, key=_step_seconds)
    combined = dict(slowest)
    peaks = [row.get("peak_memory_bytes") or 0 for row in rows]
    combined["peak_memory_bytes"] = max(peaks)
    combined["ranks"] = len(rows)
    return combined


def _step_seconds(row: JsonDict) -> float:
    """A probe row's step (or evaluation batch) seconds: what the slowest rank is chosen by."""
    return row.get("step_seconds", row.get("batch_seconds", 0.0))  # type: ignore[return-value]


class Coordinator:
    """Runs named tasks on every rank at once, as rank 0 decides."""

    def __init__(self, handlers: dict[str, Callable[[JsonDict], JsonDict]]) -> None:
        import torch.distributed as dist

        self.handlers = handlers
        self.distributed = world().processes > 1
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.failed = False  # a task failed on rank 0: the ranks may no longer be in step

    @property
    def leads(self) -> bool:
        return self.rank == 0

    def run(self, task: str, payload: JsonDict) -> JsonDict:
        """Rank 0: run `task` on every rank and return the combined row."""
        if not self.distributed:
            return self.handlers[task](payload)
        try:
            self._broadcast((task, payload))
            return self._execute(task, payload)
        except BaseException:
            self.failed = True
            raise

    def follow(self) -> None:
        """Ranks > 0: run what rank 0 broadcasts until it says done."""
        while True:
            task, payload = self._broadcast(None)
            if task == DONE:
                return
            self._execute(task, payload)

    def finish(self) -> None:
        # After a failed task no collective is sent (the process group may be what failed): its
        # error is the one to tell, and the launcher ends the others once rank 0 leaves.
        if self.distributed and self.leads and not self.failed:
            self._broadcast((DONE, {}))

    def _execute(self, task: str, payload: JsonDict) -> JsonDict:
        import torch.distributed as dist

        row = self.handlers[task](payload)
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, row)
        return combine_rows(gathered) if "status" in row else row

    @staticmethod
    def _broadcast(message: Any) -> Any:
        import torch.distributed as dist

        box = [message]
        dist.broadcast_object_list(box, src=0)
        return box[0]


# A probe's collectives wait for the slowest rank this many times the probe's price (all its steps
# priced high, a compilation for a new shape included: bench.cost), and never less than the floor
# (DataLoader workers starting, an allocator's retry, a busy host: what no price holds).
COLLECTIVE_TIMEOUT_FACTOR = 4.0
COLLECTIVE_TIMEOUT_FLOOR = 120.0
# What rank 0 does around the child (freeing the device, starting the interpreter) on top of it.
COMPILE_WAIT_SLACK = 60.0
COMPILE_CACHE_KEY = "benchtrain/compile-cache"


def probe_timeout_seconds(price_seconds: float) -> float:
    """How long a probe's collectives wait for another rank before the job gives up on it."""
    return max(COLLECTIVE_TIMEOUT_FLOOR, COLLECTIVE_TIMEOUT_FACTOR * price_seconds)


@contextmanager
def collectives_give_up_after(seconds: float | None) -> Iterator[None]:
    """Under several processes: collectives started inside give up after `seconds` (NCCL's watchdog
    then ends the process; gloo raises). torch sets the timeout when the process group is created,
    before any probe is priced: `_set_pg_timeout` changes it, and it is put back after."""
    from torch.distributed import distributed_c10d

    set_timeout = getattr(distributed_c10d, "_set_pg_timeout", None)
    if seconds is None or set_timeout is None or world().processes == 1:
        yield
        return
    before = process_group_timeout()
    set_timeout(timedelta(seconds=seconds))
    try:
        yield
    finally:
        set_timeout(before)


def process_group_timeout() -> timedelta:
    """The default process group's timeout (its backends' options); torch's default when unreadable."""
    from torch.distributed import distributed_c10d

    group = distributed_c10d._get_default_group()
    for device in group._device_types:
        timeout = getattr(getattr(group._get_backend(device), "options", None), "_timeout", None)
        if isinstance(timeout, timedelta):
            return timeout
    return distributed_c10d.default_pg_timeout


@dataclass(frozen=True)
class JobStore:
    """The launcher's rendezvous store of a multi-process job (torchrun's agent store, or rank 0's),
    to wait on without a collective: what train.step.runtime.finish_together waits on too."""

    store: Any
    world_size: int
    rank: int
    clock: Callable[[], float] = time.monotonic
    pause: Callable[[float], None] = time.sleep

    @classmethod
    def of_this_job(cls) -> JobStore | None:
        """This job's store; None for a single process."""
        import torch.distributed as dist

        if world().processes == 1:
            return None
        from torch.distributed.distributed_c10d import _get_default_store

        return cls(_get_default_store(), dist.get_world_size(), dist.get_rank())


def probe_coordinator(workload: Any, peak_flops: float | None) -> Coordinator:
    """The coordinator of this process, with a handler for every task rank 0 may ask of it."""
    # the same sequence on every rank
    compile_cache_keys = (f"{COMPILE_CACHE_KEY}/{index}" for index in itertools.count())

    def probe(task: JsonDict) -> JsonDict:
        with collectives_give_up_after(task.get("timeout_seconds")):
            return run_probe(
                workload, StepConfig.from_row(task["config"]), ProbeSettings(**task["settings"]), peak_flops
            )

    return Coordinator(
        {
            "probe": probe,
            "eval": lambda task: run_eval_probe(workload, StepConfig.from_row(task)),
            # FSDP: every rank joins in gathering the state that rank 0 saves (train.running.checkpoint);
            # DDP: rank 0 alone saves. Rank 0's figures are kept.
            "checkpoint": lambda task: (
                measure_checkpoint(workload, Path(task["folder"]), task["real_save"], task["max_bytes"])
                if task["every_rank"] or is_main_process()
                else {}
            ),
            "comm": lambda task: measure_collectives(workload.device, ("all_reduce", "all_gather", "reduce_scatter")),
            "loss_probe": lambda task: (workload.set_loss(task["loss"]), probe(task))[1],
            "set_loss": lambda task: (workload.set_loss(task["loss"]), {})[1],
            "step_split": lambda task: profile_task(workload, task),  # bench.step_split: after the fit, at two probes
            # Rank 0 only, and last: the other ranks keep their models, which they no longer use.
            "compile_cache": lambda task: compile_cache_task(
                workload, task, next(compile_cache_keys), JobStore.of_this_job()
            ),
        }
    )


def checkpoint_task(workload: Any, folder: Path, max_bytes: int) -> JsonDict:
    """Rank 0's decision for the checkpoint measurement, the same on every rank."""
    return {
        "folder": str(folder),
        "real_save": real_save_fits(workload, folder, max_bytes),
        "max_bytes": max_bytes,
        "every_rank": workload.engine.setup.sharding == "fsdp",
    }


def compile_cache_task(workload: Any, task: JsonDict, key: str, job: JobStore | None) -> JsonDict:
    """Rank 0 times the compile-cache child (`measure_cached_compile`); every other rank waits for it
    on the job's store (`job`: None for one process), not in a collective that NCCL's 10-minute
    watchdog would end, then all exchange the result in a collective that is now quick."""
    timeout_seconds = float(task.get("timeout_seconds") or CHILD_TIMEOUT)
    if job is None:
        return measure_cached_compile(workload, task["row"], timeout_seconds)
    if job.rank == 0:
        try:
            return measure_cached_compile(workload, task["row"], timeout_seconds)
        finally:
            job.store.add(key, 1)  # rank 0's count: the others stop waiting
    give_up_at = job.clock() + timeout_seconds + COMPILE_WAIT_SLACK
    try:  # every rank counts itself in; the count is whole once rank 0 has
        wait_for_all(job.store, key, job.world_size, give_up_at, job.clock, job.pause)
    except RuntimeError as error:
        raise RuntimeError(
            f"rank 0's compile-cache measurement did not end within {timeout_seconds + COMPILE_WAIT_SLACK:.0f} s"
        ) from error
    return {}


def measure_cached_compile(workload: Any, row: JsonDict, timeout_seconds: float) -> JsonDict:
    """Free this process's model, then time a fresh process compiling `row`'s shape from the cache."""
    loss = workload.engine.setup.loss
    workload.release()
    return measure_in_new_process(workload.spec, workload.method, loss, row, timeout_seconds) or {}
