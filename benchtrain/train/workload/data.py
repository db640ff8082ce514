"""The user's data: its records loaded (JSONL, JSON, CSV, Parquet, a `datasets.save_to_disk` folder, or a hub
dataset `ORG/NAME[@REVISION]` fetched into the hub cache as models are) and its lengths profiled."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from datasets import Dataset

from benchtrain.common.errors import BenchtrainError
from benchtrain.common.hub_access import first_line, snapshot
from benchtrain.common.json_types import JsonDict
from benchtrain.train.workload.hub import parse_hub_id
from benchtrain.train.workload.tokens import Lengths

LOADERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
# The bundled sample data: `--data sample` (text) and `--data sample-chat` (messages).
SAMPLES = {"sample": "sample.jsonl", "sample-chat": "sample_chat.jsonl"}
SAMPLE_FOLDER = Path(__file__).resolve().parents[1] / "sample_data"


def resolve_data_path(value: str) -> str:
    return str(SAMPLE_FOLDER / SAMPLES[value]) if value in SAMPLES else value


def load_records(path: str, split: str = "train") -> Dataset:
    """A `datasets.Dataset` of the file's (or hub dataset's `split`) records, or a one-line error naming the problem."""
    # datasets itself never goes online: a hub dataset is fetched by train.workload.hub, honouring HF_HUB_OFFLINE.
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    source = Path(path).expanduser()
    if not source.exists():
        hub_id = parse_hub_id(path)
        if hub_id is None:
            raise BenchtrainError(f"data file {path} does not exist")
        return _non_empty(load_hub_dataset(*hub_id, split, path), path)
    if source.is_dir():
        try:
            loaded = datasets.load_from_disk(str(source))
        except Exception as error:
            raise BenchtrainError(f"{path} is not a saved datasets folder ({error})") from None
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise BenchtrainError(f"{path} has splits {list(loaded)} but no {split!r} split: pass --data-split")
            loaded = loaded[split]
        return _non_empty(loaded, path)
    loader = LOADERS.get(source.suffix.lower())
    if loader is None:
        raise BenchtrainError(
            f"{path}: unsupported file type {source.suffix or '(none)'}; use .jsonl, .json, .csv or .parquet"
        )
    if source.suffix.lower() == ".jsonl":
        _check_jsonl(source, lines=1)  # datasets reads a file of one JSON list as rows of text
    datasets.disable_progress_bars() if not sys.stderr.isatty() else None
    try:
        with _datasets_quiet():
            loaded = datasets.load_dataset(loader, data_files=str(source), split="train")
    except Exception as error:
        if source.suffix.lower() == ".jsonl":
            _check_jsonl(source)  # names the first malformed line, which datasets' error does not
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        cause = error.__cause__ or error.__context__
        detail = f": {str(cause).splitlines()[0]}" if cause and str(cause) else ""
        raise BenchtrainError(f"cannot read {path} ({message}{detail})") from None
    return _non_empty(loaded, path)


@contextlib.contextmanager
def _datasets_quiet() -> Iterator[None]:
    """datasets logs its own error (with a traceback where its handler's stream is gone) before it
    raises; the failure is ours to say, in one line: its logger is silenced while it reads."""
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def load_hub_dataset(repo_id: str, revision: str | None, split: str, path: str) -> Dataset:
    """A hub dataset's split: its files from the hub cache (fetched when online), read by datasets."""
    import datasets

    folder = str(snapshot(repo_id, revision, None, "dataset"))
    try:
        splits = datasets.get_dataset_split_names(folder)
        if split not in splits:
            raise BenchtrainError(f"hub dataset {path} has splits {splits} but no {split!r}: pass --data-split")
        datasets.disable_progress_bars() if not sys.stderr.isatty() else None
        return datasets.load_dataset(folder, split=split)
    except BenchtrainError:
        raise
    except Exception as error:
        raise BenchtrainError(f"cannot read hub dataset {path} ({first_line(error)})") from None


def _check_jsonl(source: Path, lines: int | None = None) -> None:
    """Name the first malformed line (of the first `lines` non-empty ones): datasets' own error does not."""
    seen = 0
    with source.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            if lines is not None and seen >= lines:
                return
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise BenchtrainError(
                    f"{source}, line {number}: not valid JSON ({error.msg if hasattr(error, 'msg') else error})"
                ) from None
            if not isinstance(record, dict):
                raise BenchtrainError(f"{source}, line {number}: expected a JSON object, got {type(record).__name__}")
            seen += 1
    if seen == 0:
        raise BenchtrainError(f"data file {source} is empty")


def _non_empty(dataset: Dataset, path: str) -> Dataset:
    if len(dataset) == 0:
        raise BenchtrainError(f"data file {path} is empty")
    return dataset


PROFILE_PERCENTILES = (50, 90, 95, 99, 99.5)


def length_profile(lengths: Lengths) -> JsonDict:
    values = np.asarray(lengths, dtype=np.int64)
    profile = {
        "count": len(values),
        "total_tokens": int(values.sum()),
        "mean": float(values.mean()),
        "min": int(values.min()),
        "max": int(values.max()),
    }
    return profile | {f"p{q:g}": float(np.percentile(values, q)) for q in PROFILE_PERCENTILES}


def covering_length(lengths: Lengths, coverage: float) -> int:
    """The length that keeps `coverage` of the samples whole (the longest of that share)."""
    values = np.asarray(lengths)
    rank = min(len(values) - 1, math.ceil(coverage * len(values)) - 1)
    return int(np.partition(values, rank)[rank])


def truncation(lengths: Lengths, max_length: int) -> JsonDict:
    values = np.asarray(lengths, dtype=np.int64)
    cut = values > max_length
    dropped = int((values[cut] - max_length).sum())
    return {
        "max_length": max_length,
        "samples_truncated": int(cut.sum()),
        "share_truncated": float(cut.mean()),
        "tokens_dropped": dropped,
    }
