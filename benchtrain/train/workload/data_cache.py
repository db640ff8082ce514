"""Tokenize once per dataset, in parallel, into a store folder under $BENCHTRAIN_HOME/data/<key>,
built atomically under a lock by one process per machine. The design: docs/design.md#the-data-cache"""

from __future__ import annotations

import errno
import gc
import json
import multiprocessing
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from datasets import Dataset

    from benchtrain.train.workload.encode import Encoder

from benchtrain.common.atomic import atomic_directory, file_lock, read_json_file
from benchtrain.common.errors import BenchtrainError, DiskSpaceError
from benchtrain.common.home import benchtrain_home
from benchtrain.common.json_types import JsonDict
from benchtrain.common.progress import progress_bar
from benchtrain.train.workload.tokens import DamagedStore, TokenizedData, TokenWriter, check_store, open_store

# Records a worker encodes per call of the tokenizer.
ENCODE_BATCH = 1000
# Fewer records than this per worker are not worth a process.
MIN_RECORDS_PER_WORKER = 2000
# How long a process other than the builder waits without seeing the builder hold the lock.
WAIT_WITHOUT_BUILDER_SECONDS = 600.0
COPY_CHUNK = 16 << 20


@dataclass(frozen=True)
class BuildJob:
    """What to tokenize into a store: `records` (a datasets.Dataset), the encoder, the store's dtype
    and what its meta.json says besides the counts. A Builder: called, it tokenizes into a folder."""

    records: Dataset
    encode: Encoder
    dtype: np.dtype
    masked: bool
    prompts: bool
    meta: JsonDict

    def __call__(self, folder: Path, what: str) -> None:
        count = len(self.records)
        workers = worker_count(count)
        started = time.perf_counter()
        bar = progress_bar(count, f"tokenizing {what}", "records")
        try:
            if workers == 1:
                encode_range(self, 0, count, folder / "part-0", bar.update)
            else:
                run_workers(self, count, workers, folder, bar.update)
        finally:
            bar.close()
        join_parts(
            self, [folder / f"part-{k}" for k in range(workers)], folder, {"workers": workers, "started": started}
        )


# What writes a store into a folder (a BuildJob, or the index of raw token files), told what it holds for its progress.
Builder = Callable[[Path, str], None]


def data_root() -> Path:
    """Where tokenized data is cached: $BENCHTRAIN_HOME/data."""
    return benchtrain_home() / "data"


def worker_count(records: int) -> int:
    """One worker per core, while each has enough records to be worth a process."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, records // MIN_RECORDS_PER_WORKER))


def store_state(folder: Path, key: str, verify_contents: bool = False) -> str:
    """`ready`, `missing`, or why the store folder cannot be used (train.workload.tokens.check_store)."""
    if not folder.exists():
        return "missing"
    try:
        check_store(folder, key, verify_contents)
    except DamagedStore as why:
        return str(why)
    return "ready"


def ensure_store(
    folder: Path,
    key: str,
    builder_for: Callable[[], Builder],
    say: Callable[[str], None],
    what: str,
    verify_contents: bool = False,
) -> tuple[TokenizedData, float | None]:
    """The store in `folder`, built if missing or damaged (by the main process of this machine; the others wait for
    it); `verify_contents`: every file against its checksum (before training). Returns it mapped, and the seconds its
    build took (None: it was there)."""
    state = store_state(folder, key, verify_contents)
    if state == "ready":
        return open_store(folder), None
    if int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))) != 0:  # not this machine's main process
        return wait_for_store(folder, key, say, what, verify_contents), None
    with file_lock(folder.with_name(f"{folder.name}.lock")):
        state = store_state(folder, key, verify_contents)  # another command may have built it meanwhile
        if state == "ready":
            return open_store(folder), None
        if state != "missing":
            say(f"tokenized data in {folder} cannot be used ({state}): building it again")
        started = time.perf_counter()
        build_store(folder, builder_for(), what)
        return open_store(folder), time.perf_counter() - started


def wait_for_store(
    folder: Path, key: str, say: Callable[[str], None], what: str, verify_contents: bool = False
) -> TokenizedData:
    """A process other than the builder: wait for the store the main process writes."""
    lock = folder.with_name(f"{folder.name}.lock")
    said, quiet_since = False, time.monotonic()
    while True:
        if store_state(folder, key, verify_contents) == "ready":
            return open_store(folder)
        if not said:
            say(f"waiting for the main process to tokenize {what}")
            said = True
        held = False
        if lock.exists():
            try:
                with file_lock(lock, wait=False):
                    pass
            except BlockingIOError:
                held = True
        if held:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since > WAIT_WITHOUT_BUILDER_SECONDS:
            raise BenchtrainError(f"the main process did not tokenize {what} into {folder}: is LOCAL_RANK 0 running?")
        time.sleep(0.5)


def build_store(folder: Path, build: Builder, what: str) -> None:
    """The store `build` writes, in `folder` atomically (a full disk: one line, no half store)."""
    try:
        with atomic_directory(folder) as temporary:
            build(temporary, what)
    except OSError as error:
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskSpaceError(
                f"no room left in {folder.parent} for the tokenized data ({error.strerror}): free space or set BENCHTRAIN_HOME"
            ) from None
        raise BenchtrainError(f"cannot write the tokenized data into {folder}: {error.strerror or error}") from None


def encode_range(job: BuildJob, start: int, stop: int, part: Path, advance: Callable[[int], object]) -> None:
    trace = os.environ.get("BENCHTRAIN_TOKENIZE_LOG")
    if trace:  # which process tokenized what (tests: under a launcher only the main process does)
        with open(trace, "a") as handle:
            handle.write(
                f"{os.environ.get('RANK', '0')} {os.environ.get('LOCAL_RANK', '0')} {os.getpid()} {start} {stop}\n"
            )
    writer = TokenWriter(part, job.dtype, job.masked, job.prompts)
    for first in range(start, stop, ENCODE_BATCH):
        last = min(stop, first + ENCODE_BATCH)
        ids, masks, prompts = job.encode(job.records[first:last])
        # A sample of one token (or none) has nothing to predict: dropped, as before any training.
        keep = [i for i, row in enumerate(ids) if len(row) > 1]
        if len(keep) < len(ids):
            ids, prompts = [ids[i] for i in keep], [prompts[i] for i in keep]
            masks = [masks[i] for i in keep] if masks is not None else None
        writer.append([np.asarray(row) for row in ids], masks, prompts)
        advance(last - first)
    writer.finish({})


_JOB: BuildJob | None = None  # the job a forked worker inherits


def _worker(index: int, start: int, stop: int, part: str, queue: Any) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the workers fill the cores
    try:
        assert _JOB is not None
        encode_range(_JOB, start, stop, Path(part), lambda done: queue.put(("done", done)))
        queue.put(("finished", index))
    except OSError as error:
        queue.put(("oserror", (error.errno, error.strerror or str(error))))
    except BenchtrainError as error:
        queue.put(("error", str(error)))
    except Exception as error:  # reported by the main process, which exits with one line
        queue.put(("error", f"{type(error).__name__}: {error}"))


def run_workers(job: BuildJob, count: int, workers: int, folder: Path, advance: Callable[[int], object]) -> None:
    global _JOB
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    bounds = np.linspace(0, count, workers + 1).astype(int)
    _JOB = job
    # The workers are forks: without this, the collector's first pass in each would touch (and so
    # copy) every object the parent holds (torch, transformers, the planner's arrays).
    gc.freeze()
    parts = [(k, int(bounds[k]), int(bounds[k + 1]), str(folder / f"part-{k}"), queue) for k in range(workers)]
    processes = [context.Process(target=_worker, args=part, daemon=True) for part in parts]
    try:
        for process in processes:
            process.start()
        finished = 0
        while finished < workers:
            try:
                kind, value = queue.get(timeout=1.0)
            except Exception:
                if any(process.exitcode not in (None, 0) for process in processes):
                    raise BenchtrainError("a tokenizing worker died (out of memory?)") from None
                continue
            if kind == "done":
                advance(value)
            elif kind == "finished":
                finished += 1
            elif kind == "oserror":
                raise OSError(value[0], value[1])
            else:
                raise BenchtrainError(f"{job.meta.get('source', 'data')}: cannot tokenize ({value})")
    finally:
        _JOB = None
        gc.unfreeze()
        for process in processes:
            if process.is_alive():
                process.terminate()
            process.join()


def join_parts(job: BuildJob, parts: list[Path], folder: Path, build: JsonDict) -> None:
    """The parts, in order, as one store in `folder` (each part removed once copied); meta.json records the workers and the seconds the build took."""
    writer = TokenWriter(folder, job.dtype, job.masked, job.prompts)
    for part in parts:
        meta = read_json_file(part / "meta.json")
        for name in writer.files:
            with (part / name).open("rb") as source:
                while chunk := source.read(COPY_CHUNK):
                    writer.write(name, chunk)
        lengths = np.diff(np.load(part / "offsets.npy"))
        prompts = np.load(part / "prompts.npy") if job.prompts else None
        writer.add_documents(lengths, np.load(part / "targets.npy"), prompts)
        assert meta["documents"] == len(lengths)
        shutil.rmtree(part)
    seconds = time.perf_counter() - build["started"]
    writer.finish({**job.meta, "workers": build["workers"], "seconds": seconds, "built": time.time()})


def list_stores() -> list[JsonDict]:
    """Every store in the cache: its key, what it holds, its size on disk and when last used."""
    root = data_root()
    rows = []
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        if not folder.is_dir() or folder.name.startswith("."):
            continue
        try:
            meta = json.loads((folder / "meta.json").read_text())
        except (OSError, ValueError):
            meta = {}
        size = sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())
        kind = "sample" if ".sample" in folder.name else "full"
        row = {
            "key": folder.name,
            "source": meta.get("source", "?"),
            "kind": kind,
            "documents": meta.get("documents"),
            "tokens": meta.get("tokens"),
        }
        rows.append({**row, "bytes": size, "used": folder.stat().st_atime, "path": str(folder), "complete": bool(meta)})
    return rows


def clear_stores(keys: list[str] | None) -> list[str]:
    """Remove these stores (all with None) and their locks; returns the keys removed."""
    root = data_root()
    removed = []
    for row in list_stores():
        if keys is None or row["key"] in keys or row["key"].split(".")[0] in keys:
            shutil.rmtree(row["path"], ignore_errors=True)
            Path(f"{row['path']}.lock").unlink(missing_ok=True)
            removed.append(row["key"])
    if keys is None and root.is_dir():
        for leftover in root.glob(".*.tmp"):
            shutil.rmtree(leftover, ignore_errors=True)
    return removed
