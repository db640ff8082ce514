"""Writes that never leave a half-written file: temporary file (or folder) in the same
directory, flushed, then renamed over the target. A lock file serialises read-modify-write.
Reading a JSON file back: one-line errors."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from benchtrain.common.errors import BenchtrainError
from benchtrain.common.json_types import JsonDict


def write_text_atomic(path: Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(text.encode("utf-8"))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """`data` as the whole of `path`, or `path` untouched."""
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def write_json_atomic(path: Path, payload: object) -> None:
    write_text_atomic(path, json_text(payload) + "\n")


def json_text(payload: object) -> str:
    """JSON as benchtrain writes it (files, `--json`): numpy scalars as numbers, paths as strings."""
    return json.dumps(payload, indent=2, sort_keys=False, default=_json_default)


def read_json_file(path: Path, missing: str | None = None) -> JsonDict:
    """A JSON file's object (every file benchtrain reads is one); a missing file says `missing`
    (when given), an unreadable one or one holding something else says why."""
    try:
        content = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as error:
        if missing is not None and isinstance(error, FileNotFoundError):
            raise BenchtrainError(missing) from None
        raise BenchtrainError(f"cannot read {path}: {error}") from None
    if not isinstance(content, dict):
        raise BenchtrainError(f"cannot read {path}: it holds a JSON {type(content).__name__}, not an object")
    return content


def _json_default(value: object) -> object:
    # numpy scalars and paths show up in measurement rows; everything else is a bug.
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


@contextlib.contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield a temporary folder beside `final`; on success it replaces `final` in one rename."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.", suffix=".tmp"))
    try:
        yield temporary
        if final.exists():
            # rename cannot replace a non-empty folder: move the old one aside first.
            old = final.with_name(f".{final.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(temporary, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(temporary, final)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


@contextlib.contextmanager
def file_lock(path: Path, wait: bool = True) -> Iterator[TextIO]:
    """An exclusive advisory lock held on `path` (created if missing) for the block; the file's handle
    is the block's. Without `wait`, BlockingIOError at once when another process holds it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        try:
            yield handle
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
