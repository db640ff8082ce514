"""Tokenized data that stays on disk: every document's ids back to back in one memory-mapped array,
the offsets where each starts, and per document what the loss is on; the store folder's writer and reader.
The store's files: docs/design.md#tokenized-data-on-disk"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from common.atomic import read_json_file, write_json_atomic
from common.errors import BenchtrainError
from common.json_types import JsonDict
from train.workload.formats import FORMATS
from train.workload.pretokenized import TokenShards, open_token_files

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
            result[chunk] = np.asarray(self.loss_mask[positions], dtype=np.int64).reshape(len(chunk), max_length).sum(axis=1)
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
    """Appends encoded documents to a store folder; `finish` writes the offsets and meta.json
    (the files' sizes and sha256, computed as they are written)."""

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

    def append(self, ids: list[np.ndarray], masks: list[np.ndarray] | None = None, prompt_lengths: list[int] | None = None) -> None:
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

    def finish(self, meta: dict[str, Any]) -> dict[str, Any]:
        for handle, _ in self.files.values():
            handle.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)
        arrays = {"offsets.npy": np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)}
        arrays["targets.npy"] = (np.concatenate(self._targets) if self._targets else np.zeros(0)).astype(np.int32)
        if self.prompts:
            arrays["prompts.npy"] = (np.concatenate(self._prompts) if self._prompts else np.zeros(0)).astype(np.int32)
        for name, array in arrays.items():
            np.save(self.folder / name, array, allow_pickle=False)
        digests = {**{name: file_digest(self.folder / name) for name in arrays}, **{name: digest.hexdigest() for name, (_, digest) in self.files.items()}}
        files = {name: {"bytes": (self.folder / name).stat().st_size, "sha256": digest} for name, digest in digests.items()}
        full = {**meta, "store_version": STORE_VERSION, "dtype": self.dtype.name, "documents": len(lengths), "tokens": int(lengths.sum()), "files": files}
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


def check_store(folder: Path, key: str | None = None, verify_contents: bool = False) -> dict[str, Any]:
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


def open_store(folder: Path, source: str | None = None, meta: dict[str, Any] | None = None) -> TokenizedData:
    """A store folder written by TokenWriter, memory-mapped (check_store first); `source`: the
    data's name as the user gave it (default: the one it was built from)."""
    folder = Path(folder)
    meta = meta or read_json_file(folder / "meta.json")
    source = source or meta.get("source", str(folder))
    files = meta["files"]
    if "external" in meta:  # raw token files, mapped where they are (train.workload.pretokenized)
        tokens = open_token_files(meta)
    else:
        tokens = _map(folder / "tokens.bin", np.dtype(meta["dtype"]))
    offsets = np.load(folder / "offsets.npy", allow_pickle=False)
    mask = _map(folder / "mask.bin", np.dtype(np.uint8)) if "mask.bin" in files else None
    prompts = np.load(folder / "prompts.npy", allow_pickle=False) if "prompts.npy" in files else None
    targets = np.load(folder / "targets.npy", allow_pickle=False)
    return TokenizedData(tokens, offsets, meta["format"], source, meta.get("loss_on", "all tokens"), mask, prompts, targets, None, folder, {"meta": meta})


def _map(path: Path, dtype: np.dtype) -> np.ndarray:
    # An empty file cannot be mapped.
    return np.memmap(path, dtype=dtype, mode="r") if path.stat().st_size else np.zeros(0, dtype)
