"""A lock that holds across machines: a file created with O_EXCL holding its holder's host, pid and start, its time
refreshed while held. flock holds on one machine only; a run folder on shared storage (a bucket or NFS mounted on every
node) is reached from several. Stale when its holder is gone: on this host, a pid that is no longer running; on another,
a file not refreshed for LEASE_SECONDS. Where it holds and where it does not: docs/launch.md#one-train-per-run-folder."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from benchtrain.common.errors import BenchtrainError

LEASE_SECONDS = 120.0  # a machine that was preempted stops refreshing its lock; a restart comes minutes later
REFRESH_SECONDS = LEASE_SECONDS / 4


def holder_text() -> str:
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()})


def read_holder(path: Path) -> dict[str, object]:
    try:
        holder = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_stale(path: Path, holder: dict[str, object], lease_seconds: float) -> bool:
    """Whether the holder is gone: this host's pid not running, or (another host, or unreadable) not refreshed for the lease."""
    pid = holder.get("pid")
    if holder.get("host") == socket.gethostname() and isinstance(pid, int):
        return not pid_running(pid)
    try:
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return True
    return age > lease_seconds


def claim(path: Path) -> bool:
    """Create `path` with this process as its holder, atomically (O_EXCL); False when it exists."""
    try:
        descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(descriptor, "w") as handle:
        handle.write(holder_text())
        handle.flush()
        os.fsync(handle.fileno())
    return True


def refused(path: Path, holder: dict[str, object], lease_seconds: float) -> BenchtrainError:
    since = holder.get("since")
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
    return BenchtrainError(
        f"{path.parent} is in use by train on {holder.get('host', '?')} (pid {holder.get('pid', '?')}, since {started}): "
        f"wait for it, or use another --out (its lock {path.name} is taken over once not refreshed for {lease_seconds:.0f} s)"
    )


@contextlib.contextmanager
def shared_lock(path: Path, lease_seconds: float = LEASE_SECONDS) -> Iterator[None]:
    """Hold `path` for the block, refreshing it every lease/4; a live holder elsewhere is one line, a stale one replaced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not claim(path):
        holder = read_holder(path)
        if not is_stale(path, holder, lease_seconds):
            raise refused(path, holder, lease_seconds)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        if not claim(path):  # another took it over first
            raise refused(path, read_holder(path), lease_seconds)
    stop = threading.Event()

    def refresh() -> None:
        while not stop.wait(min(REFRESH_SECONDS, lease_seconds / 4)):
            with contextlib.suppress(OSError):
                os.utime(path)

    keeper = threading.Thread(target=refresh, name="benchtrain-lock", daemon=True)
    keeper.start()
    try:
        yield
    finally:
        stop.set()
        keeper.join()
        if read_holder(path).get("pid") == os.getpid() and read_holder(path).get("host") == socket.gethostname():
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
