"""Corpora that are already token ids (raw .bin/.npy shards): mapped in place, their documents found
by a scan for the separator. The design: docs/design.md#pre-tokenized-corpora"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from common.errors import BenchtrainError

TOKEN_SUFFIXES = (".bin", ".npy")
METADATA_FILE = "benchtrain.json"
TOKEN_DTYPES = ("uint16", "uint32", "int32", "int64")
SCAN_CHUNK = 64 << 20  # ids read at once while scanning for separators
DATASETS_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


def token_files(path: str) -> list[Path] | None:
    """The token files `path` names (a .bin/.npy file, or a folder of them), or None."""
    given = Path(path).expanduser()
    if given.is_file() and given.suffix.lower() in TOKEN_SUFFIXES:
        return [given]
    if given.is_dir() and not any((given / marker).exists() for marker in DATASETS_MARKERS):
        files = sorted(file for file in given.iterdir() if file.is_file() and file.suffix.lower() in TOKEN_SUFFIXES)
        return files or None
    return None


@dataclass(frozen=True)
class TokenFileSettings:
    """How to read raw token files: the ids' dtype (a .npy says its own) and the document separator."""

    dtype: str | None = None
    separator: int | None = None

    @classmethod
    def resolve(cls, files: list[Path], dtype: str | None, separator: int | None) -> TokenFileSettings:
        """The options given, else the benchtrain.json beside the files."""
        metadata_path = files[0].parent / METADATA_FILE
        metadata: dict[str, Any] = {}
        if metadata_path.is_file():
            try:
                metadata = json.loads(metadata_path.read_text())
            except (OSError, ValueError) as error:
                raise BenchtrainError(f"{metadata_path} is not valid JSON ({error})") from None
            if not isinstance(metadata, dict):
                raise BenchtrainError(f'{metadata_path} must be an object like {{"dtype": "uint16", "separator": 50256}}')
        chosen = cls(dtype or metadata.get("dtype"), separator if separator is not None else metadata.get("separator"))
        if chosen.dtype is not None and chosen.dtype not in TOKEN_DTYPES:
            raise BenchtrainError(f"token dtype must be one of {', '.join(TOKEN_DTYPES)}, got {chosen.dtype!r}")
        if any(file.suffix.lower() == ".bin" for file in files) and chosen.dtype is None:
            raise BenchtrainError(
                f"{files[0]}: a .bin file of token ids needs its dtype: pass --token-dtype uint16 (nanoGPT's) or uint32, or write {METADATA_FILE} beside it"
            )
        return chosen


def map_token_file(path: Path, dtype: str | None) -> np.ndarray:
    """The file's ids, memory-mapped (a .npy through its header, never unpickled)."""
    if path.suffix.lower() == ".npy":
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as error:
            raise BenchtrainError(f"{path}: not an array of token ids ({error})") from None
        if array.ndim != 1 or array.dtype.kind not in "ui":
            raise BenchtrainError(f"{path}: token ids must be a 1-D integer array, this one is {array.dtype} of shape {array.shape}")
        return array
    size = path.stat().st_size
    itemsize = np.dtype(dtype).itemsize
    if size % itemsize:
        raise BenchtrainError(f"{path}: {size:,} bytes is not a whole number of {dtype} ids: is --token-dtype right?")
    return np.memmap(path, dtype=np.dtype(dtype), mode="r") if size else np.zeros(0, np.dtype(dtype))


class TokenShards:
    """Several 1-D arrays read as one: slices and position arrays across their borders."""

    def __init__(self, arrays: list[np.ndarray]) -> None:
        self.arrays = arrays
        self.ends = np.cumsum([len(array) for array in arrays]).astype(np.int64)
        self.dtype = np.result_type(*[array.dtype for array in arrays]) if arrays else np.dtype(np.int64)

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def __getitem__(self, key: Any) -> np.ndarray:
        if isinstance(key, slice):
            start, stop, _ = key.indices(len(self))
            return self.take(np.arange(start, stop, dtype=np.int64))
        return self.take(np.asarray(key, dtype=np.int64))

    def take(self, positions: np.ndarray) -> np.ndarray:
        shard = np.searchsorted(self.ends, positions, side="right")
        result = np.empty(positions.shape, dtype=self.dtype)
        for index in np.unique(shard):
            picked = shard == index
            begin = self.ends[index - 1] if index else 0
            result[picked] = self.arrays[index][positions[picked] - begin]
        return result


def open_token_files(meta: dict[str, Any]) -> np.ndarray | TokenShards:
    """The ids of a store whose tokens stay in the user's files (meta's `external`)."""
    arrays = [map_token_file(Path(entry["path"]), entry.get("dtype")) for entry in meta["external"]]
    return arrays[0] if len(arrays) == 1 else TokenShards(arrays)


def scan_documents(array: np.ndarray, separator: int | None) -> tuple[np.ndarray, int]:
    """The lengths of the documents in one file (each ends after a separator; the rest is the
    last), and its largest id: read in chunks, so a file larger than memory is fine."""
    ends: list[np.ndarray] = []
    largest = -1
    for start in range(0, len(array), SCAN_CHUNK):
        chunk = _read(array, start, min(len(array), start + SCAN_CHUNK))
        largest = max(largest, int(chunk.max(initial=0)))
        if separator is not None:
            ends.append(np.flatnonzero(chunk == separator) + start + 1)
    boundaries = np.concatenate(ends) if ends else np.zeros(0, np.int64)
    if not len(boundaries) or boundaries[-1] != len(array):
        boundaries = np.append(boundaries, len(array))
    lengths = np.diff(np.concatenate(([0], boundaries))).astype(np.int64)
    return lengths[lengths > 0], largest


def _read(array: np.ndarray, start: int, stop: int) -> np.ndarray:
    """ids[start:stop], read from the file when it is mapped: the scan then leaves no mapped pages
    behind in the process's resident memory."""
    if isinstance(array, np.memmap) and array.filename:
        return np.fromfile(array.filename, dtype=array.dtype, count=stop - start, offset=array.offset + start * array.dtype.itemsize)
    return np.asarray(array[start:stop])
