"""From the user's data to what the planner and the trainer read: the exact profile when the cache
holds the data, else a sample's. The design: docs/design.md#from-the-data-to-the-plan"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from benchtrain.common.atomic import write_json_atomic
from benchtrain.common.durations import format_duration
from benchtrain.common.errors import BenchtrainError
from benchtrain.common.json_types import JsonDict
from benchtrain.train.workload.data import load_records
from benchtrain.train.workload.data_cache import Builder, BuildJob, data_root, ensure_store, store_state
from benchtrain.train.workload.encode import Encoder
from benchtrain.train.workload.formats import DataSchema, Layout, detect_layout
from benchtrain.train.workload.sampling import (
    SAMPLE_START,
    SampledData,
    TotalEstimate,
    estimate_total,
    sample_indices,
    sample_size_for,
)
from benchtrain.train.workload.tokenizer import chat_template_note, ensure_chat_template
from benchtrain.train.workload.tokens import (
    TokenFileSettings,
    TokenizedData,
    TokenWriter,
    file_digest,
    map_token_file,
    open_store,
    scan_documents,
    token_dtype,
    token_files,
)

if TYPE_CHECKING:
    from datasets import Dataset
    from transformers import PreTrainedTokenizerBase

# What builds the store of this key: the records at these indices (None: all), or the index of pre-tokenized files.
JobFor = Callable[[np.ndarray | None, str], Builder]

KEY_VERSION = 1
TRAIN_ON = ("assistant", "all")
# A sample that would need more than this share of the records is not worth it: tokenize them all.
SAMPLE_SHARE_LIMIT = 0.25


@dataclass(frozen=True)
class DataSpec:
    """Which data, and how it is read: its path (or hub id), split, format and columns, and what the loss is on."""

    path: str
    train_on: str = "assistant"
    schema: DataSchema = field(default_factory=DataSchema)
    split: str = "train"

    def __post_init__(self) -> None:
        if self.train_on not in TRAIN_ON:
            raise BenchtrainError(f"--train-on must be assistant or all, got {self.train_on!r}")


@dataclass
class PreparedData:
    """The data as the planner sees it (`view`: exact, or from a sample) and the way to the whole store."""

    view: TokenizedData | SampledData
    key: str
    folder: Path
    records: int
    what: str
    source: str
    job_for: JobFor
    predicted_seconds: float = 0.0  # tokenizing what is not cached yet, at the sample's rate
    built_seconds: float | None = None  # tokenizing done by this command, measured
    estimate: TotalEstimate | None = None
    exact_tokens: int | None = None  # every record's tokens, once tokenized
    chat_template: str | None = None  # chat data: "tokenizer" (its own) or "chatml" (added: it had none)

    @property
    def exact(self) -> bool:
        return isinstance(self.view, TokenizedData)

    def tokenized(self, say: Callable[[str], None]) -> TokenizedData:
        """Every record, tokenized (built now if the cache lacks it or any file fails its checksum)."""
        data, seconds = ensure_store(
            self.folder, self.key, partial(self.job_for, None, self.key), say, self.what, verify_contents=True
        )
        if seconds is not None:
            self.built_seconds = (self.built_seconds or 0.0) + seconds
        self.exact_tokens = int(data.lengths.sum())
        return replace(data, source=self.source)

    def describe(self) -> list[str]:
        """For the plan: where the tokens come from and what preparing them costs."""
        lines = [*filter(None, [chat_template_note(self.chat_template)])]
        if self.exact and self.built_seconds is None and not self.predicted_seconds:
            return [*lines, f"tokenized data: cached in {self.folder} (exact profile of {self.records:,} records)"]
        if self.exact:
            tokenized = format_duration(self.built_seconds or 0.0)
            return [
                *lines,
                f"tokenized data: {self.folder} (exact profile of {self.records:,} records, tokenized in {tokenized})",
            ]
        assert self.estimate is not None
        return [
            *lines,
            self.estimate.describe(),
            f"tokenizing all {self.records:,} records: ≈{format_duration(self.predicted_seconds)} (at the rate measured on the sample), "
            f"counted in the plan; cached in {self.folder} for later runs (`train --exact-profile` tokenizes them first for the exact profile)",
        ]

    def record(self) -> JsonDict:
        """What run.json keeps of the preparation."""
        return {
            "key": self.key,
            "cache": str(self.folder),
            "records": self.records,
            "profiled_from": "all records" if self.exact else "sample",
            "sampled_estimate": asdict(self.estimate) if self.estimate else None,
            "predicted_seconds": self.predicted_seconds,
            "actual_seconds": self.built_seconds,
            "exact_total_tokens": self.exact_tokens,
            "sampled_error": self.estimate.error_of(self.exact_tokens)
            if self.estimate and self.exact_tokens is not None
            else None,
            "chat_template": self.chat_template,
        }


def prepare_data(
    spec: DataSpec, tokenizer: PreTrainedTokenizerBase, say: Callable[[str], None], exact: bool = False
) -> PreparedData:
    """The data's view for planning: exact when cached (or asked for), else from a sample."""
    files = token_files(spec.path)
    if files is not None:
        return prepare_token_files(spec, files, len(tokenizer), say)
    records = load_records(spec.path, spec.split)
    layout = detect_layout(list(records.column_names), spec.schema, spec.path, records[0] if len(records) else None)
    # A base model's tokenizer without a template gets ChatML, before the key (which digests the template).
    fmt = layout.data_format
    template = ensure_chat_template(tokenizer) if fmt.chat else None
    masked = fmt.chat and spec.train_on == "assistant"
    key = cache_key(
        content_fingerprint(source_paths(spec.path, records)),
        tokenizer_fingerprint(tokenizer),
        layout,
        masked,
        {"split": spec.split},
    )
    count = len(records)
    what = f"{count:,} records of {spec.path}"

    def job_for(indices: np.ndarray | None, store_key: str) -> BuildJob:
        chosen = records if indices is None else records.select(indices)
        loss_on = fmt.loss_on if masked or not fmt.chat else "all tokens"
        meta = {"key": store_key, "source": spec.path, "format": layout.format, "loss_on": loss_on, "records": count}
        sample = {} if indices is None else {"documents_sampled": len(indices)}
        return BuildJob(
            chosen,
            Encoder(layout, tokenizer, spec.path, masked),
            token_dtype(len(tokenizer)),
            masked,
            fmt.prompts,
            meta | sample,
        )

    prepared = PreparedData(None, key, data_root() / key, count, what, spec.path, job_for, chat_template=template)  # type: ignore[arg-type]
    if exact or count <= SAMPLE_START or store_state(prepared.folder, key) == "ready":
        prepared.view = checked_view(
            prepared.tokenized(say) if exact or count <= SAMPLE_START else open_store(prepared.folder, spec.path), spec
        )
        return prepared
    return sampled(prepared, spec, say)


def prepare_token_files(spec: DataSpec, files: list[Path], vocab_size: int, say: Callable[[str], None]) -> PreparedData:
    """Raw token files (train.workload.tokens): their documents indexed once, the ids mapped in place."""
    settings = TokenFileSettings.resolve(files, spec.schema.token_dtype, spec.schema.document_separator)
    extra = {"dtype": settings.dtype, "separator": settings.separator, "vocab": vocab_size}
    key = cache_key(content_fingerprint(files), "raw token files", Layout("tokens"), False, extra)
    what = f"{len(files)} token file{'s' if len(files) != 1 else ''} of {spec.path}"

    def index(folder: Path, what: str) -> None:
        say(f"indexing the documents of {what}")
        lengths, external = [], []
        for file in files:
            array = map_token_file(file, settings.dtype)
            found, largest = scan_documents(array, settings.separator)
            if largest >= vocab_size:
                raise BenchtrainError(
                    f"{file}: token id {largest:,} is outside the tokenizer's {vocab_size:,} ids: written with another tokenizer?"
                )
            lengths.append(found)
            external.append({"path": str(file.resolve()), "dtype": array.dtype.name, "ids": len(array)})
        every = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        writer = TokenWriter(
            folder,
            np.dtype(str(external[0]["dtype"]) if external else "uint32"),
            masked=False,
            prompts=False,
            flat=False,
        )
        writer.add_documents(every, every, None)
        writer.finish(
            {
                "key": key,
                "source": spec.path,
                "format": "tokens",
                "loss_on": "all tokens",
                "records": len(every),
                "external": external,
            }
        )

    prepared = PreparedData(None, key, data_root() / key, 0, what, spec.path, lambda _indices, _key: index)  # type: ignore[arg-type]
    prepared.view = checked_view(prepared.tokenized(say), spec)
    prepared.records = len(prepared.view)
    return prepared


def sampled(prepared: PreparedData, spec: DataSpec, say: Callable[[str], None]) -> PreparedData:
    """The plan's view from a sample sized for a ±1% token total (grown from SAMPLE_START to the size the sample's
    spread asks for, and again if a heavy tail shows in the larger sample). Each size is its own store
    (`<key>.sample-<size>`): nothing is replaced while another process reads it."""
    size = SAMPLE_START
    for _round in range(3):
        indices = sample_indices(prepared.records, size)
        sample_key = f"{prepared.key}.sample-{size}"
        job = partial(prepared.job_for, indices, sample_key)
        sample, _seconds = ensure_store(
            prepared.folder.with_name(sample_key), sample_key, job, say, f"a sample of {size:,} records"
        )
        needed = sample_size_for(sample.lengths, prepared.records)
        if needed <= size or needed > SAMPLE_SHARE_LIMIT * prepared.records:
            break
        size = min(prepared.records, int(needed * 1.1))
    if needed > SAMPLE_SHARE_LIMIT * prepared.records:
        say(f"a ±1% token total needs {needed:,} of {prepared.records:,} records: tokenizing them all")
        prepared.view = checked_view(prepared.tokenized(say), spec)
        return prepared
    meta = sample.extra["meta"]
    sample = checked_view(sample, spec)
    prepared.estimate = estimate_total(sample.lengths, prepared.records)
    prepared.predicted_seconds = float(meta["seconds"]) * prepared.records / max(1, int(meta["documents_sampled"]))
    prepared.view = SampledData.expand(sample, prepared.records, prepared.estimate)
    return prepared


def checked_view(data: TokenizedData, spec: DataSpec) -> TokenizedData:
    """One-line errors for data with nothing to train on."""
    data = replace(data, source=spec.path)
    if not len(data) or not int(data.lengths.max(initial=0)) > 1:
        raise BenchtrainError(f"{spec.path}: every sample is empty after tokenization")
    if data.masked and not int(np.asarray(data.targets).sum()):
        raise BenchtrainError(
            f"{spec.path}: no assistant turn to train on; add assistant messages or pass --train-on all"
        )
    return data


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
        files = (
            sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
            if path.is_dir()
            else [path]
        )
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


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
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


def cache_key(content: str, tokenizer: str, layout: Layout, masked: bool, extra: JsonDict | None = None) -> str:
    """The key tokenized data is cached under (a hex string)."""
    parts = {
        "version": KEY_VERSION,
        "content": content,
        "tokenizer": tokenizer,
        "layout": asdict(layout),
        "masked": masked,
        **(extra or {}),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def source_paths(path: str, dataset: Dataset) -> list[Path]:
    """The files whose bytes are the data: the file or folder given, else (a hub dataset) the Arrow files datasets reads."""
    given = Path(path).expanduser()
    if given.exists():
        return [given]
    return [Path(entry["filename"]) for entry in getattr(dataset, "cache_files", [])]
