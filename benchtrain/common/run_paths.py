"""Paths a run records about its own folder (`final`, `checkpoints/step-0000005`), stored relative to
it so the folder can be moved, copied or shared and still be resumed, reported and loaded; paths
outside it (the data, the calibration, a `--model DIR`) are inputs and stay as given."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from benchtrain.common.json_types import JsonDict

# The keys of run.json's `final` section that name folders (train.export.export_final).
FINAL_PATH_KEYS = ("path", "merged_path", "base_path")


def stored_path(path: str | Path | None, run_dir: Path) -> str | None:
    """`path` as run.json keeps it: relative to `run_dir` (POSIX separators) when it lies inside the run folder, else unchanged."""
    if path is None:
        return None
    try:
        return Path(path).resolve().relative_to(Path(run_dir).resolve()).as_posix()
    except ValueError:
        return str(path)


def run_path(recorded: str | Path, run_dir: Path) -> Path:
    """A path run.json recorded, where it is now: a relative one inside `run_dir`; an absolute one
    (older records kept them so) as written while it exists, else the same place in `run_dir`
    when the folder has moved (`…/final`, `…/checkpoints/step-0000005`)."""
    path = Path(recorded).expanduser()
    if not path.is_absolute():
        return Path(run_dir) / path
    if path.exists():
        return path
    for depth in (1, 2):
        candidate = Path(run_dir).joinpath(*path.parts[-depth:])
        if len(path.parts) > depth and candidate.exists():
            return candidate
    return path


def stored_paths(section: JsonDict | None, run_dir: Path, keys: Collection[str]) -> JsonDict | None:
    """`section` with the paths under `keys` stored relative to the run folder (a copy)."""
    if section is None:
        return None
    return {
        key: stored_path(value, run_dir) if key in keys and isinstance(value, str) else value
        for key, value in section.items()
    }
