"""The calibration store: `BENCHTRAIN_HOME/calibrations/<id>.json` with `<id>.csv` beside it, and the
calibrations bundled with the package (read-only). Docs: docs/design.md#the-store"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from pathlib import Path

from benchtrain.calibration.hub import cached_file, is_hub_reference, shared_calibrations
from benchtrain.calibration.schema import ListedCalibration, read_calibration_file
from benchtrain.calibration.setup import Setup, measured_setup
from benchtrain.common.atomic import file_lock, read_json_file, write_json_atomic, write_text_atomic
from benchtrain.common.errors import BenchtrainError, CalibrationFileError
from benchtrain.common.home import benchtrain_home, writable_subdir
from benchtrain.common.json_types import JsonDict

CSV_COLUMNS = (
    "micro_batch_size", "num_workers", "grad_accum", "seq_len", "status", "tokens_per_second", "step_seconds", "step_seconds_spread",
    "data_wait_share", "peak_memory_bytes", "mfu", "timed_steps", "probe_seconds", "error",
)  # fmt: skip


# Files that hold data, not a calibration: `--use-calibration data.jsonl` is a mix-up, said so.
DATA_SUFFIXES = (".jsonl", ".csv", ".parquet", ".txt", ".arrow")
BUNDLED_DIR = Path(__file__).resolve().parent / "bundled"
# Where scripts/demo.sh keeps what it measured (BENCHTRAIN_HOME=./.benchtrain).
DEMO_HOME = Path(".benchtrain")
Preferences = Sequence[
    Callable[[Setup], bool]
]  # which calibrations `latest` prefers (by what each measured), first first


def calibrations_dir() -> Path:
    return benchtrain_home() / "calibrations"


def bundled_calibrations() -> dict[str, Path]:
    """The calibrations that ship with benchtrain, by name."""
    return {path.stem: path for path in sorted(BUNDLED_DIR.glob("*.json"))}


def is_bundled(path: Path | str | None) -> bool:
    return path is not None and Path(path).resolve().parent == BUNDLED_DIR


def home_hint() -> str:
    """Where else calibrations are, when BENCHTRAIN_HOME has none: the demo's folder here."""
    demo = DEMO_HOME.resolve()
    if demo != benchtrain_home().resolve() and any((demo / "calibrations").glob("*.json")):
        return f"; {DEMO_HOME}/ here holds the demo's (export BENCHTRAIN_HOME=$PWD/{DEMO_HOME} to use them)"
    return ""


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "x"


def new_id(device: str, model_name: str, when: datetime) -> str:
    return f"{slug(device)}-{slug(model_name)}-{when.strftime('%Y%m%d-%H%M%S')}"


def free_name(folder: Path, base: str) -> str:
    """`base`, or `base-2`, `base-3`, … when a JSON file of that name is in `folder`."""
    candidate, suffix = base, 2
    while (folder / f"{candidate}.json").exists():
        candidate, suffix = f"{base}-{suffix}", suffix + 1
    return candidate


def save_calibration(data: JsonDict) -> Path:
    """Write a new calibration (JSON + CSV; a taken id gets a numeric suffix), then remove what its bench kept aside."""
    kept = unfinished_paths(data)
    folder = writable_subdir("calibrations")
    with file_lock(folder / ".lock"):
        data["id"] = candidate = free_name(folder, data["id"])
        write_text_atomic(folder / f"{candidate}.csv", measurements_csv(data["measurements"]))
        path = folder / f"{candidate}.json"
        write_json_atomic(path, data)
    discard_unfinished(kept)
    return path


def save_failed(data: JsonDict) -> Path:
    """Keep a benchmark that fitted nothing out of the store (`latest` never sees it), replacing what its bench kept aside."""
    kept = unfinished_paths(data)
    folder = writable_subdir("calibrations") / "failed"
    path = folder / f"{data['id']}.json"
    write_json_atomic(path, data)
    discard_unfinished(kept)
    return path


# A bench under way keeps its measurements so far beside the calibrations, never among them, so a bench that dies
# (an out-of-memory between one rank's collectives, a lost machine) leaves them readable; its record names the file here.
UNFINISHED_KEY = "unfinished_measurements"


def keep_unfinished(data: JsonDict, path: Path | None = None) -> Path:
    """Write a bench's measurements so far (atomically) to `path`, or to a new file named after `data`'s id; returns where."""
    if path is None:
        folder = writable_subdir("calibrations") / "unfinished"
        path = folder / f"{free_name(folder, data['id'])}.json"
    write_json_atomic(path, data)
    return path


def unfinished_paths(data: JsonDict) -> list[Path]:
    """The kept measurements a record (and its variants) names, the names taken out of it."""
    entries = [data, *data.get("variants", [])]
    return [Path(entry.pop(UNFINISHED_KEY)) for entry in entries if entry.get(UNFINISHED_KEY)]


def discard_unfinished(paths: Sequence[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


def list_unfinished() -> list[ListedCalibration]:
    """(path, content, error) for every bench that kept measurements and never stored them, newest first."""
    paths = sorted(
        (calibrations_dir() / "unfinished").glob("*.json"), key=lambda found: found.stat().st_mtime, reverse=True
    )
    return read_each(paths, read_json_file, BenchtrainError)


def read_each(
    paths: Iterable[Path], read: Callable[[Path], JsonDict], unreadable: type[BenchtrainError]
) -> list[ListedCalibration]:
    """Each file read, or the `unreadable` error that says why not."""
    entries: list[ListedCalibration] = []
    for path in paths:
        try:
            entries.append(ListedCalibration(path, read(path)))
        except unreadable as error:
            entries.append(ListedCalibration(path, None, str(error)))
    return entries


def measurements_csv(rows: list[JsonDict]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_COLUMNS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def list_calibrations() -> list[ListedCalibration]:
    """(path, data, error) for every calibration file, newest first; unreadable ones keep their error."""
    entries = read_each(calibrations_dir().glob("*.json"), read_calibration_file, CalibrationFileError)
    entries.sort(key=lambda entry: (entry.data or {}).get("created_at", ""), reverse=True)
    return entries


def resolve_calibration(
    reference: str,
    on_skip: Callable[[str], None] | None = None,
    preferences: Preferences = (),
    on_passed_over: Callable[[Path], None] | None = None,
) -> Path:
    """`latest`, an id, a bundled name, a path to a calibration JSON, or `hub:ORG/NAME[/ID]` (its file in huggingface_hub's
    cache). Every newer file that could not be read is reported through `on_skip`; `choose` picks among several."""
    if is_hub_reference(reference):
        shared = [(path, data) for path, data, _ in shared_calibrations(reference, on_skip) if data is not None]
        chosen = choose(shared, preferences, on_passed_over)
        if chosen is None:  # shared_calibrations returns one at least, or says why not
            raise BenchtrainError(f"{reference}: no calibration to use")
        return chosen
    if reference == "latest":
        entries = list_calibrations()
        readable = [(path, data) for path, data, _ in entries if data is not None]
        chosen = choose(readable, preferences, on_passed_over)
        chosen_time = chosen.stat().st_mtime if chosen is not None else 0.0
        for path, data, error in entries:
            if data is None and on_skip is not None and path.stat().st_mtime >= chosen_time:
                using = f"using {chosen.stem}" if chosen is not None else "no readable calibration is left"
                on_skip(f"skipped {path} (newer, but unreadable: {error}); {using}")
        if chosen is not None:
            return chosen
        raise BenchtrainError(f"no calibration in {calibrations_dir()} can be used: run `bench run` first{home_hint()}")
    as_path = Path(reference).expanduser()
    bundled_names = ", ".join(bundled_calibrations()) or "none"
    accepted = f"a calibration is latest, an id (`bench list`), a bundled one ({bundled_names}) or a .json file written by `bench run`"
    if as_path.is_dir():
        what = "a run folder" if (as_path / "run.json").is_file() else "a folder"
        raise BenchtrainError(f"{reference} is {what}, not a calibration: {accepted}")
    if as_path.suffix.lower() in DATA_SUFFIXES:
        raise BenchtrainError(f"{reference} is a data file, not a calibration (pass it as --data): {accepted}")
    if as_path.suffix == ".json" or "/" in reference:
        if not as_path.is_file():
            raise BenchtrainError(f"calibration file {reference} does not exist")
        if as_path.name == "run.json":
            raise BenchtrainError(
                f"{reference} is a run record, not a calibration (`report {as_path.parent}` reports on the run): {accepted}"
            )
        return as_path
    by_id = calibrations_dir() / f"{reference}.json"
    if by_id.is_file():
        return by_id
    bundled = bundled_calibrations().get(reference)
    if bundled is not None:
        return bundled
    raise BenchtrainError(f"unknown calibration {reference!r}: {accepted}{home_hint()}")


def choose(
    readable: Sequence[tuple[Path, JsonDict]],
    preferences: Preferences = (),
    on_passed_over: Callable[[Path], None] | None = None,
) -> Path | None:
    """Of calibrations newest first: the newest the first preference accepts, then the next's, else
    the newest; `on_passed_over` hears of the newest when it is not the one chosen."""
    newest = readable[0][0] if readable else None
    measured = [(path, measured_setup(data)) for path, data in readable] if preferences else []
    preferred = (next((path for path, setup in measured if accepts(setup)), None) for accepts in preferences)
    chosen = next((path for path in preferred if path is not None), newest)
    if on_passed_over is not None and newest is not None and chosen != newest:
        on_passed_over(newest)
    return chosen


def is_read_only(path: Path | str | None) -> bool:
    """Bundled with benchtrain, or downloaded from the hub: the measurement as it was shared, which runs never write to."""
    return is_bundled(path) or (path is not None and cached_file(path) is not None)


def update_calibration(path: Path, change: Callable[[JsonDict], None]) -> JsonDict:
    """Read, change and rewrite a calibration under the store lock (never a bundled one)."""
    if is_bundled(path):
        raise BenchtrainError(
            f"{path} ships with benchtrain and is not changed; run `bench run` for a calibration of your own"
        )
    if cached_file(path) is not None:
        raise BenchtrainError(
            f"{path} was downloaded from the hub and is not changed; run `bench run` for a calibration of your own"
        )
    with file_lock(Path(path).parent / ".lock"):
        data = read_calibration_file(path)
        change(data)
        write_json_atomic(path, data)
    return data
