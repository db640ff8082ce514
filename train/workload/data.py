"""The user's data: load (datasets), recognise the format, tokenize (cached), profile lengths.

Formats (train.workload.formats): `text`; chat as OpenAI `messages`, ShareGPT `conversations` or Alpaca
`instruction`/`input`/`output`, rendered with the tokenizer's chat template (loss on the assistant's
turns); `prompt` + `completion` (loss on the completion). Sources: JSONL, JSON, CSV, Parquet, a
folder saved with `datasets.save_to_disk`, or a hub dataset `ORG/NAME[@REVISION]` (fetched into the
hub cache as models are, train.workload.hub, then read with `datasets.load_dataset`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from common.errors import BenchtrainError
from train.workload.formats import LOSS_ON, DataSchema, Layout, detect_layout

LOADERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


@dataclass
class TokenizedData:
    samples: list[np.ndarray]
    prompt_lengths: list[int]
    format: str
    source: str
    # Per-token True where the loss applies (chat: assistant turns); None: every token after the prompt.
    loss_masks: list[np.ndarray] | None = None
    loss_on: str = "all"

    def subset(self, indices: list[int]) -> TokenizedData:
        masks = [self.loss_masks[i] for i in indices] if self.loss_masks is not None else None
        return TokenizedData([self.samples[i] for i in indices], [self.prompt_lengths[i] for i in indices], self.format, self.source, masks, self.loss_on)

    @cached_property
    def lengths(self) -> list[int]:
        return [len(sample) for sample in self.samples]

    @property
    def packing(self) -> bool:
        # Only free text can be packed: chat turns and prompt/completion pairs keep their borders.
        return self.format == "text"

    def stream(self) -> np.ndarray:
        return np.concatenate(self.samples) if self.samples else np.zeros(0, dtype=np.int32)


def load_records(path: str, split: str = "train") -> Any:
    """A `datasets.Dataset` of the file's (or hub dataset's `split`) records, or a one-line error
    naming the problem."""
    # datasets itself never goes online: a hub dataset is fetched by train.workload.hub, honouring HF_HUB_OFFLINE.
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    source = Path(path).expanduser()
    if not source.exists():
        from train.workload.hub import parse_hub_id

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
        raise BenchtrainError(f"{path}: unsupported file type {source.suffix or '(none)'}; use .jsonl, .json, .csv or .parquet")
    if source.suffix.lower() == ".jsonl":
        _check_jsonl(source)
    datasets.disable_progress_bars() if not _interactive() else None
    try:
        loaded = datasets.load_dataset(loader, data_files=str(source), split="train")
    except Exception as error:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        cause = error.__cause__ or error.__context__
        detail = f": {str(cause).splitlines()[0]}" if cause and str(cause) else ""
        raise BenchtrainError(f"cannot read {path} ({message}{detail})") from None
    return _non_empty(loaded, path)


def load_hub_dataset(repo_id: str, revision: str | None, split: str, path: str) -> Any:
    """A hub dataset's split: its files from the hub cache (fetched when online), read by datasets."""
    import datasets

    from train.workload.hub import first_line, snapshot

    folder = str(snapshot(repo_id, revision, None, "dataset"))
    try:
        splits = datasets.get_dataset_split_names(folder)
        if split not in splits:
            raise BenchtrainError(f"hub dataset {path} has splits {splits} but no {split!r}: pass --data-split")
        datasets.disable_progress_bars() if not _interactive() else None
        return datasets.load_dataset(folder, split=split)
    except BenchtrainError:
        raise
    except Exception as error:
        raise BenchtrainError(f"cannot read hub dataset {path} ({first_line(error)})") from None


def _interactive() -> bool:
    import sys

    return sys.stderr.isatty()


def _check_jsonl(source: Path) -> None:
    """Name the first malformed line: datasets' own error does not."""
    seen = 0
    with source.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise BenchtrainError(f"{source}, line {number}: not valid JSON ({error.msg if hasattr(error, 'msg') else error})") from None
            if not isinstance(record, dict):
                raise BenchtrainError(f"{source}, line {number}: expected a JSON object, got {type(record).__name__}")
            seen += 1
    if seen == 0:
        raise BenchtrainError(f"data file {source} is empty")


def _non_empty(dataset: Any, path: str) -> Any:
    if len(dataset) == 0:
        raise BenchtrainError(f"data file {path} is empty")
    return dataset


TRAIN_ON = ("assistant", "all")


def assistant_character_spans(tokenizer: Any, messages: list[dict[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
    """The conversation rendered with the tokenizer's own chat template, and the character spans
    that each assistant turn adds to it (the turn's text and its end-of-turn marker).

    A turn's span runs from the end of everything before it (rendered with the generation prompt,
    so the assistant header is not trained) to the end of the conversation through that turn."""
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for index, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:index], tokenize=False, add_generation_prompt=True) if index else ""
        through = tokenizer.apply_chat_template(messages[: index + 1], tokenize=False)
        if not (rendered.startswith(through) and through.startswith(before)):
            raise BenchtrainError("the chat template does not render conversations turn by turn; pass --train-on all")
        spans.append((len(before), len(through)))
    return rendered, spans


def tokenize_records(dataset: Any, tokenizer: Any, path: str, train_on: str = "assistant", schema: DataSchema | None = None) -> TokenizedData:
    """Token ids per sample (EOS-terminated); for prompt/completion the prompt's length; for chat
    (messages, ShareGPT, Alpaca) with `train_on="assistant"` a per-token mask of the assistant turns."""
    if train_on not in TRAIN_ON:
        raise BenchtrainError(f"--train-on must be assistant or all, got {train_on!r}")
    layout = detect_layout(list(dataset.column_names), schema or DataSchema(), path, dataset[0] if len(dataset) else None)
    if layout.is_chat and not getattr(tokenizer, "chat_template", None):
        raise BenchtrainError(f"{path}: {layout.format} data is rendered with a chat template and this tokenizer has none: pass --tokenizer DIR with one")
    masked = layout.is_chat and train_on == "assistant"
    encode = _encoder(layout, tokenizer, path, masked)
    try:
        # datasets caches the result next to the loaded files, keyed by the function's fingerprint.
        tokenized = dataset.map(encode, batched=True, remove_columns=dataset.column_names, desc="tokenizing")
    except BenchtrainError:
        raise
    except Exception as error:
        inner = error.__cause__ or error.__context__ or error
        if isinstance(inner, BenchtrainError):
            raise inner from None
        raise BenchtrainError(f"{path}: cannot tokenize ({str(error).splitlines()[0] if str(error) else type(error).__name__})") from None
    column = tokenized.with_format("numpy")
    samples = [np.asarray(ids, dtype=np.int32) for ids in column["input_ids"]]
    keep = [index for index, sample in enumerate(samples) if len(sample) > 1]
    if not keep:
        raise BenchtrainError(f"{path}: every sample is empty after tokenization")
    prompt_lengths = [int(value) for value in tokenized["prompt_length"]]
    loss_masks = None
    if masked:
        all_masks = [np.asarray(mask, dtype=bool) for mask in column["loss_mask"]]
        loss_masks = [all_masks[i] for i in keep]
        if not any(mask.any() for mask in loss_masks):
            raise BenchtrainError(f"{path}: no assistant turn to train on; add assistant messages or pass --train-on all")
    loss_on = LOSS_ON[layout.format] if masked or not layout.is_chat else "all tokens"
    return TokenizedData([samples[i] for i in keep], [prompt_lengths[i] for i in keep], layout.format, path, loss_masks, loss_on)


def _encoder(layout: Layout, tokenizer: Any, path: str, masked: bool) -> Any:
    """The batched `datasets.map` function that tokenizes records of `layout`."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def encode(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        ids, prompt_lengths, masks = [], [], []
        records = [dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)]
        for record in records:
            if layout.format == "text":
                ids.append(tokenizer(str(record[layout.text] or ""), add_special_tokens=False)["input_ids"] + eos)
                prompt_lengths.append(0)
            elif layout.is_chat:
                messages = layout.messages_of(record, path)
                prompt_lengths.append(0)
                if not masked:
                    ids.append(tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"])
                    continue
                rendered, spans = assistant_character_spans(tokenizer, messages)
                encoded = tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True)
                ids.append(encoded["input_ids"])
                # A token is trained when it starts inside an assistant turn's span.
                masks.append([int(any(start <= first < end for start, end in spans)) for first, _ in encoded["offset_mapping"]])
            else:
                prompt_ids = tokenizer(str(record[layout.prompt] or ""), add_special_tokens=False)["input_ids"]
                completion_ids = tokenizer(str(record[layout.completion] or ""), add_special_tokens=False)["input_ids"] + eos
                ids.append(prompt_ids + completion_ids)
                prompt_lengths.append(len(prompt_ids))
        columns = {"input_ids": ids, "prompt_length": prompt_lengths}
        if masked:
            columns["loss_mask"] = masks
        return columns

    return encode


def load_tokenized(path: str, tokenizer: Any, train_on: str = "assistant", schema: DataSchema | None = None, split: str = "train") -> TokenizedData:
    return tokenize_records(load_records(path, split), tokenizer, path, train_on, schema)


PROFILE_PERCENTILES = (50, 90, 95, 99, 99.5)


def length_profile(lengths: list[int]) -> dict[str, Any]:
    values = np.asarray(lengths, dtype=np.int64)
    profile = {
        "count": len(values),
        "total_tokens": int(values.sum()),
        "mean": float(values.mean()),
        "min": int(values.min()),
        "max": int(values.max()),
    }
    for q in PROFILE_PERCENTILES:
        profile[f"p{q:g}"] = float(np.percentile(values, q))
    return profile


def covering_length(lengths: list[int], coverage: float) -> int:
    """The length that keeps `coverage` of the samples whole (the longest of that share)."""
    ordered = sorted(lengths)
    return int(ordered[min(len(ordered) - 1, math.ceil(coverage * len(ordered)) - 1)])


def truncation(lengths: list[int], max_length: int) -> dict[str, Any]:
    values = np.asarray(lengths, dtype=np.int64)
    cut = values > max_length
    return {
        "max_length": max_length,
        "samples_truncated": int(cut.sum()),
        "share_truncated": float(cut.mean()),
        "tokens_dropped": int((values[cut] - max_length).sum()),
    }
