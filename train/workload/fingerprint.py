"""The key tokenized data is cached under: the data's content (sha256, remembered by stat), the
tokenizer and its chat template, the format and columns, what the loss is on. docs/design.md#the-cache-key"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from common.atomic import write_json_atomic
from common.home import benchtrain_home
from train.workload.formats import Layout

KEY_VERSION = 1
STORE_VERSION = 1  # the layout of a store folder (train.workload.tokens)
HASH_CHUNK = 16 << 20


def data_root() -> Path:
    """Where tokenized data is cached: $BENCHTRAIN_HOME/data."""
    return benchtrain_home() / "data"


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


def content_fingerprint(paths: list[Path]) -> str:
    """sha256 over the files' contents (a folder: every file in it, by relative name)."""
    memo_path = data_root() / "fingerprints.json"
    try:
        memo = json.loads(memo_path.read_text())
        memo = memo if isinstance(memo, dict) else {}
    except (OSError, ValueError):
        memo = {}
    before = len(memo)
    digest = hashlib.sha256()
    for path in sorted(paths):
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")) if path.is_dir() else [path]
        for file in files:
            digest.update(str(file.relative_to(path) if path.is_dir() else file.name).encode())
            digest.update(file_digest(file, memo).encode())
    if len(memo) != before:
        try:
            # Only the entries of files that still exist: the memo does not grow without end.
            kept = {key: value for key, value in memo.items() if Path(key.split("|")[0]).exists()}
            write_json_atomic(memo_path, kept)
        except OSError:
            pass  # a read-only home: hash again next time
    return digest.hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """The tokenizer's vocabulary, merges, normalisation and special tokens, and its chat template."""
    digest = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digest.update(backend.to_str().encode())
    else:
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    specials = {name: getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "pad")}
    digest.update(json.dumps(specials, sort_keys=True).encode())
    digest.update(str(getattr(tokenizer, "chat_template", None) or "").encode())
    return digest.hexdigest()


def cache_key(content: str, tokenizer: str, layout: Layout, masked: bool, extra: dict[str, Any] | None = None) -> str:
    """The key tokenized data is cached under (a hex string)."""
    parts = {"version": KEY_VERSION, "content": content, "tokenizer": tokenizer, "layout": asdict(layout), "masked": masked, **(extra or {})}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def source_paths(path: str, dataset: Any) -> list[Path]:
    """The files whose bytes are the data: the file or folder given, else (a hub dataset) the
    Arrow files datasets reads."""
    given = Path(path).expanduser()
    if given.exists():
        return [given]
    return [Path(entry["filename"]) for entry in getattr(dataset, "cache_files", [])]
