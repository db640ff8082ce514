"""Token ids on disk, memory-mapped: the store (ids back to back, each document's offset and loss), its writer and
reader; and corpora already token ids (raw .bin/.npy shards). docs/design.md#tokenized-data-on-disk, #pre-tokenized-corpora"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from benchtrain.common.atomic import read_json_file, write_json_atomic
from benchtrain.common.errors import BenchtrainError
from benchtrain.common.json_types import JsonDict
from benchtrain.train.workload.formats import FORMATS

TOKEN_SUFFIXES = (".bin", ".npy")
METADATA_FILE = "benchtrain.json"
TOKEN_DTYPES = ("uint16", "uint32", "int32", "int64")
SCAN_CHUNK = 64 << 20  # ids read at once while scanning for separators
DATASETS_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
# Sample lengths: a list, or the memory-mapped int array a big corpus keeps.
Lengths = Sequence[int] | np.ndarray

STORE_VERSION = 1  # the layout of a store folder
HASH_CHUNK = 16 << 20
# Truncated documents whose masks are summed at once (bounded memory for real_tokens).
MASK_CHUNK_DOCUMENTS = 4096


def file_digest(path: Path, memo: dict[str, str] | None = None) -> str:
    """The file's sha256 (from `memo` when it holds the file's stat key)."""
    memo = {} if memo is None else memo
    status = path.stat()
    key = f"{path.resolve()}|{status.st_size}|{status.st_mtime_ns}|{status.st_ctime_ns}|{status.st_ino}"
    if key not in memo:
        digest = hashlib.sha256()
        with path.open("rb") as handle:
            while chunk := handle.read(HASH_CHUNK):
                digest.update(chunk)
        memo[key] = digest.hexdigest()
    return memo[key]


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


@dataclass(frozen=True, eq=False)
class TokenizedData:
    """Documents of token ids; `index` picks this view's documents (in order) from the arrays."""

    tokens: np.ndarray | TokenShards  # np.memmap (an ndarray) of the store, or the user's token files
    offsets: np.ndarray
    format: str
    source: str
    loss_on: str = "all tokens"
    loss_mask: np.ndarray | None = None  # flat, aligned with tokens
    prompt_lengths: np.ndarray | None = None  # per document (all documents)
    targets: np.ndarray | None = None  # per document (all documents)
    index: np.ndarray | None = None
    folder: Path | None = None  # where the arrays are mapped from (pickled as the path)
    extra: JsonDict = field(default_factory=dict)  # {"meta": the store's meta.json}

    # -- what the view holds ------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.index) if self.index is not None else len(self.offsets) - 1

    def document(self, i: int) -> int:
        return int(self.index[i]) if self.index is not None else int(i)

    @cached_property
    def lengths(self) -> np.ndarray:
        every = np.diff(self.offsets)
        return every[self.index] if self.index is not None else every

    @property
    def packing(self) -> bool:
        # The format's entry says (train.workload.formats): free text and pre-tokenized corpora pack; chat turns and
        # prompt/completion pairs keep their borders.
        entry = FORMATS.get(self.format)
        return entry is not None and entry.packs

    @property
    def masked(self) -> bool:
        return self.loss_mask is not None

    def sample(self, i: int) -> np.ndarray:
        d = self.document(i)
        return np.asarray(self.tokens[int(self.offsets[d]) : int(self.offsets[d + 1])])

    def mask(self, i: int) -> np.ndarray | None:
        if self.loss_mask is None:
            return None
        d = self.document(i)
        return np.asarray(self.loss_mask[int(self.offsets[d]) : int(self.offsets[d + 1])], dtype=bool)

    def prompt_length(self, i: int) -> int:
        return 0 if self.prompt_lengths is None else int(self.prompt_lengths[self.document(i)])

    def subset(self, indices: Sequence[int] | np.ndarray) -> TokenizedData:
        chosen = np.asarray(indices, dtype=np.int64)
        composed = self.index[chosen] if self.index is not None else chosen
        return replace(self, index=composed)

    # -- packing: the view's documents back to back ---------------------------------------------
    @cached_property
    def _ends(self) -> np.ndarray:
        return np.cumsum(self.lengths)

    @property
    def stream_length(self) -> int:
        return int(self._ends[-1]) if len(self) else 0

    def stream_take(self, positions: np.ndarray) -> np.ndarray:
        """The ids at these positions of the view's stream (its documents back to back)."""
        if self.index is None:
            return np.asarray(self.tokens[positions])
        document = np.searchsorted(self._ends, positions, side="right")
        within = positions - (self._ends[document] - self.lengths[document])
        return np.asarray(self.tokens[self.offsets[self.index[document]] + within])

    # -- what the loss is on --------------------------------------------------------------------
    def real_tokens_per_document(self, max_length: int) -> np.ndarray:
        """Tokens that carry loss in each of the view's documents when cut at `max_length`."""
        assert self.targets is not None  # every store has them (targets.npy)
        targets = self.targets.astype(np.int64)
        documents = self.index if self.index is not None else np.arange(len(self.offsets) - 1)
        lengths = self.lengths
        result = targets[documents].copy()
        cut = np.flatnonzero(lengths > max_length)
        if not len(cut):
            return result
        if self.loss_mask is None:
            prompts = self.prompt_lengths[documents[cut]] if self.prompt_lengths is not None else 0
            result[cut] = max_length - np.minimum(prompts, max_length)
            return result
        for start in range(0, len(cut), MASK_CHUNK_DOCUMENTS):
            chunk = cut[start : start + MASK_CHUNK_DOCUMENTS]
            firsts = self.offsets[documents[chunk]]
            positions = (firsts[:, None] + np.arange(max_length)[None, :]).ravel()
            result[chunk] = (
                np.asarray(self.loss_mask[positions], dtype=np.int64).reshape(len(chunk), max_length).sum(axis=1)
            )
        return result

    def real_tokens(self, max_length: int) -> int:
        """Tokens that carry loss in one epoch (packing drops nothing)."""
        if self.packing:
            return self.stream_length
        return int(self.real_tokens_per_document(max_length).sum())

    # -- pickling (DataLoader workers started by spawn): the path, not a copy -------------------
    def __reduce__(self) -> Any:
        if self.folder is None:
            return super().__reduce__()
        return (reopen, (self.folder, self.source, self.index, self.extra))


def reopen(folder: Path, source: str, index: np.ndarray | None, extra: JsonDict) -> TokenizedData:
    return replace(open_store(folder, source), index=index, extra=extra)


class TokenWriter:
    """Appends encoded documents to a store folder; `finish` writes the offsets and meta.json (the files' sizes and sha256, computed as they are written)."""

    def __init__(self, folder: Path, dtype: np.dtype, masked: bool, prompts: bool, flat: bool = True) -> None:
        self.folder, self.dtype, self.prompts = Path(folder), np.dtype(dtype), prompts
        self.folder.mkdir(parents=True, exist_ok=True)
        # The flat files (tokens.bin, and mask.bin for a masked store; none when the ids stay in the
        # user's token files): each one's handle and running hash.
        names = ("tokens.bin", "mask.bin")[: 2 if masked else 1] if flat else ()
        self.files = {name: ((self.folder / name).open("wb"), hashlib.sha256()) for name in names}
        self._lengths: list[np.ndarray] = []
        self._prompts: list[np.ndarray] = []
        self._targets: list[np.ndarray] = []

    def append(
        self, ids: list[np.ndarray], masks: list[np.ndarray] | None = None, prompt_lengths: list[int] | None = None
    ) -> None:
        """Encoded documents: ids, per-token loss masks (masked stores), prompt lengths (prompt stores)."""
        lengths = np.fromiter((len(row) for row in ids), dtype=np.int64, count=len(ids))
        self.write("tokens.bin", (np.concatenate(ids).astype(self.dtype) if ids else np.zeros(0, self.dtype)).tobytes())
        mask = None
        if "mask.bin" in self.files:
            assert masks is not None
            mask = np.concatenate(masks).astype(np.uint8) if masks else np.zeros(0, np.uint8)
            self.write("mask.bin", mask.tobytes())
        prompts = np.asarray(prompt_lengths, dtype=np.int64) if self.prompts else None
        self.add_documents(lengths, document_targets(lengths, mask, prompts), prompts)

    def add_documents(self, lengths: np.ndarray, targets: np.ndarray, prompts: np.ndarray | None) -> None:
        """Documents whose tokens (and mask) were written with `write`."""
        self._lengths.append(np.asarray(lengths, dtype=np.int64))
        self._targets.append(np.asarray(targets, dtype=np.int64))
        if self.prompts:
            assert prompts is not None
            self._prompts.append(np.asarray(prompts, dtype=np.int64))

    def write(self, name: str, payload: bytes) -> None:
        handle, digest = self.files[name]
        handle.write(payload)
        digest.update(payload)

    def finish(self, meta: JsonDict) -> JsonDict:
        for handle, _ in self.files.values():
            handle.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)
        arrays = {"offsets.npy": np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)}
        arrays["targets.npy"] = (np.concatenate(self._targets) if self._targets else np.zeros(0)).astype(np.int32)
        if self.prompts:
            arrays["prompts.npy"] = (np.concatenate(self._prompts) if self._prompts else np.zeros(0)).astype(np.int32)
        for name, array in arrays.items():
            np.save(self.folder / name, array, allow_pickle=False)
        digests = {
            **{name: file_digest(self.folder / name) for name in arrays},
            **{name: digest.hexdigest() for name, (_, digest) in self.files.items()},
        }
        files = {
            name: {"bytes": (self.folder / name).stat().st_size, "sha256": digest} for name, digest in digests.items()
        }
        full = {
            **meta,
            "store_version": STORE_VERSION,
            "dtype": self.dtype.name,
            "documents": len(lengths),
            "tokens": int(lengths.sum()),
            "files": files,
        }
        write_json_atomic(self.folder / "meta.json", full)
        return full


def document_targets(lengths: np.ndarray, mask: np.ndarray | None, prompts: np.ndarray | None) -> np.ndarray:
    """Tokens that carry loss in each document, untruncated: its tokens the mask marks (chat data),
    or those after its prompt (prompt + completion data), or all."""
    if mask is not None:
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1])) if len(lengths) else np.zeros(0, np.int64)
        sums = np.add.reduceat(mask.astype(np.int64), starts) if len(mask) else np.zeros(len(lengths), np.int64)
        return np.where(lengths > 0, sums, 0)
    return lengths - np.minimum(prompts, lengths) if prompts is not None else lengths


class DamagedStore(Exception):
    """A store folder that must not be used (missing, truncated, another version, changed)."""


def check_store(folder: Path, key: str | None = None, verify_contents: bool = False) -> JsonDict:
    """The store's meta.json once its files are whole: sizes always, sha256 of the small files
    always and of the token and mask files with `verify_contents` (before training on them)."""
    meta_path = Path(folder) / "meta.json"
    if not meta_path.is_file():
        raise DamagedStore("incomplete (no meta.json)")
    try:
        meta = read_json_file(meta_path)
    except BenchtrainError as error:
        raise DamagedStore(str(error)) from None
    if not isinstance(meta, dict) or meta.get("store_version") != STORE_VERSION:
        raise DamagedStore("written by another version")
    if key is not None and meta.get("key") != key:
        raise DamagedStore("made for other data, tokenizer or settings")
    for name, expected in (meta.get("files") or {}).items():
        path = Path(folder) / name
        if not path.is_file() or path.stat().st_size != expected["bytes"]:
            raise DamagedStore(f"{name} is missing or truncated")
        small = name.endswith(".npy")
        if (small or verify_contents) and file_digest(path) != expected["sha256"]:
            raise DamagedStore(f"{name} does not match its checksum")
    return meta


def open_store(folder: Path, source: str | None = None, meta: JsonDict | None = None) -> TokenizedData:
    """A store folder written by TokenWriter, memory-mapped (check_store first); `source`: the
    data's name as the user gave it (default: the one it was built from)."""
    folder = Path(folder)
    meta = meta or read_json_file(folder / "meta.json")
    source = source or meta.get("source", str(folder))
    files = meta["files"]
    if "external" in meta:  # raw token files, mapped where they are
        tokens = open_token_files(meta)
    else:
        tokens = _map(folder / "tokens.bin", np.dtype(meta["dtype"]))
    offsets = np.load(folder / "offsets.npy", allow_pickle=False)
    mask = _map(folder / "mask.bin", np.dtype(np.uint8)) if "mask.bin" in files else None
    prompts = np.load(folder / "prompts.npy", allow_pickle=False) if "prompts.npy" in files else None
    targets = np.load(folder / "targets.npy", allow_pickle=False)
    return TokenizedData(
        tokens,
        offsets,
        meta["format"],
        source,
        meta.get("loss_on", "all tokens"),
        mask,
        prompts,
        targets,
        None,
        folder,
        {"meta": meta},
    )


def _map(path: Path, dtype: np.dtype) -> np.ndarray:
    # An empty file cannot be mapped.
    return np.memmap(path, dtype=dtype, mode="r") if path.stat().st_size else np.zeros(0, dtype)


# -- corpora already token ids: raw arrays, as nanoGPT-style pipelines write them ------------------
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
        metadata: JsonDict = {}
        if metadata_path.is_file():
            try:
                metadata = json.loads(metadata_path.read_text())
            except (OSError, ValueError) as error:
                raise BenchtrainError(f"{metadata_path} is not valid JSON ({error})") from None
            if not isinstance(metadata, dict):
                raise BenchtrainError(
                    f'{metadata_path} must be an object like {{"dtype": "uint16", "separator": 50256}}'
                )
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
            raise BenchtrainError(
                f"{path}: token ids must be a 1-D integer array, this one is {array.dtype} of shape {array.shape}"
            )
        return array
    size = path.stat().st_size
    if size % np.dtype(dtype).itemsize:
        raise BenchtrainError(f"{path}: {size:,} bytes is not a whole number of {dtype} ids: is --token-dtype right?")
    return _map(path, np.dtype(dtype))


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


def open_token_files(meta: JsonDict) -> np.ndarray | TokenShards:
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
    """ids[start:stop], read from the file when it is mapped: the scan then leaves no mapped pages behind in the process's resident memory."""
    if isinstance(array, np.memmap) and array.filename:
        return np.fromfile(
            array.filename, dtype=array.dtype, count=stop - start, offset=array.offset + start * array.dtype.itemsize
        )
    return np.asarray(array[start:stop])
