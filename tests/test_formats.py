"""Data as users already have it: ShareGPT, Alpaca, OpenAI messages with a system turn, odd column
names, hub datasets; and bench's lengths from the data's profile (issue 23)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import assert_one_line_error, load_tokenized, run_main, tokenized_from_samples, trained_text

from benchtrain.common.errors import BenchtrainError
from benchtrain.train.planning.planner import lengths_to_measure
from benchtrain.train.workload.data import load_records
from benchtrain.train.workload.formats import DataSchema
from benchtrain.train.workload.tokenizer import byte_tokenizer
from benchtrain.train.workload.tokens import TokenizedData

SHAREGPT = {
    "conversations": [
        {"from": "system", "value": "be brief"},
        {"from": "human", "value": "hi"},
        {"from": "gpt", "value": "hello"},
        {"from": "user", "value": "2+2?"},
        {"from": "chatgpt", "value": "4"},
    ]
}
ALPACA = [
    {"instruction": "add", "input": "2+2", "output": "4"},
    {"instruction": "greet", "input": "", "output": "hello"},
]
MESSAGES = {
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
}
# Each format: a file, the format detected, what run.json says the loss is on, and the text trained in its first record.
CASES = {
    "sharegpt": ("sharegpt.jsonl", [SHAREGPT], "sharegpt", "assistant turns", "hello<|eos|>4<|eos|>"),
    "alpaca": ("alpaca.json", ALPACA, "alpaca", "outputs", "4<|eos|>"),
    "messages": ("chat.jsonl", [MESSAGES], "messages", "assistant turns", "hello<|eos|>4<|eos|>"),
}


def write(path: Path, records: list[dict[str, Any]], count: int = 1) -> Path:
    records = records * count
    if path.suffix == ".json":
        path.write_text(json.dumps(records))  # Alpaca's own layout: one JSON array
    else:
        path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


@pytest.mark.parametrize("case", CASES)
def test_each_format_is_detected_and_only_the_answers_carry_loss(tmp_path: Path, case: str) -> None:
    name, records, fmt, loss_on, answers = CASES[case]
    tokenizer = byte_tokenizer()
    data = load_tokenized(str(write(tmp_path / name, records)), tokenizer)
    assert (data.format, data.loss_on, data.packing) == (fmt, loss_on, False)
    assert trained_text(tokenizer, data) == answers
    # The masked tokens are exactly the answers' (one byte token each, one for each end-of-turn marker).
    assert int(data.mask(0).sum()) == len(answers.replace("<|eos|>", "#")) < len(data.sample(0))


def test_alpaca_puts_the_input_under_the_instruction_in_the_model_s_template(tmp_path: Path) -> None:
    tokenizer = byte_tokenizer()
    data = load_tokenized(str(write(tmp_path / "alpaca.json", ALPACA)), tokenizer)
    assert tokenizer.decode(data.sample(0).tolist()) == "<|user|>add\n\n2+2<|eos|><|assistant|>4<|eos|>"
    assert tokenizer.decode(data.sample(1).tolist()) == "<|user|>greet<|eos|><|assistant|>hello<|eos|>"


def test_sharegpt_aliases_and_a_system_column(tmp_path: Path) -> None:
    record = {
        "system": "be kind",
        "conversations": [
            {"from": "user", "value": "hi"},
            {"from": "bot", "value": "hey"},
            {"from": "human", "value": "ok"},
        ],
    }
    record["conversations"].append({"from": "assistant", "value": "bye"})
    tokenizer = byte_tokenizer()
    data = load_tokenized(str(write(tmp_path / "sharegpt.jsonl", [record])), tokenizer)
    assert data.format == "sharegpt"
    assert tokenizer.decode(data.sample(0).tolist()).startswith(
        "<|system|>be kind<|eos|><|user|>hi<|eos|><|assistant|>hey"
    )
    assert trained_text(tokenizer, data) == "hey<|eos|>bye<|eos|>"


@pytest.mark.parametrize("case", CASES)
def test_each_format_trains_on_cpu_without_flags(
    calibrated_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    name, records, fmt, loss_on, _ = CASES[case]
    path = write(tmp_path / name, records, count=40 // len(records))
    code, _, err = run_main(
        "train",
        ["--data", str(path), "--deadline", "30m", "--effective-batch", "4", "--max-steps", "1", "--no-report"],
        capsys,
    )
    assert code == 0, err
    record = json.loads(next((calibrated_home / "runs").glob("*/run.json")).read_text())
    assert record["status"] == "step_limit" and record["actual"]["steps"] == 1
    assert (record["data"]["format"], record["data"]["loss_on"]) == (fmt, loss_on)


def test_odd_columns_are_named_with_options(tmp_path: Path) -> None:
    tokenizer = byte_tokenizer()
    dialog = write(tmp_path / "dialog.jsonl", [{"id": 1, "dialog": MESSAGES["messages"]}])
    with pytest.raises(
        BenchtrainError,
        match=r"no usable text field in columns \['id', 'dialog'\]; formats accepted: text .* sharegpt .* alpaca",
    ):
        load_tokenized(str(dialog), tokenizer)
    data = load_tokenized(str(dialog), tokenizer, schema=DataSchema(messages_field="dialog"))
    assert data.format == "messages" and trained_text(tokenizer, data) == "hello<|eos|>4<|eos|>"

    pairs = write(tmp_path / "qa.jsonl", [{"q": "2+2?", "a": "4"}])
    data = load_tokenized(
        str(pairs), tokenizer, schema=DataSchema(format="prompt_completion", prompt_field="q", completion_field="a")
    )
    assert (
        data.format == "prompt_completion"
        and data.loss_on == "completions"
        and trained_text(tokenizer, data) == "4<|eos|>"
    )
    with pytest.raises(BenchtrainError, match=r"--completion-field 'answer' is not a column; columns: \['q', 'a'\]"):
        load_tokenized(str(pairs), tokenizer, schema=DataSchema(prompt_field="q", completion_field="answer"))

    text = write(tmp_path / "notes.jsonl", [{"note": "free text", "title": "x"}])
    data = load_tokenized(str(text), tokenizer, schema=DataSchema(text_field="note"))
    assert data.format == "text" and data.packing and tokenizer.decode(data.sample(0).tolist()) == "free text<|eos|>"


@pytest.mark.parametrize(
    ("records", "argv", "fragment"),
    [
        (
            [{"conversations": [{"from": "narrator", "value": "once"}]}],
            [],
            "unknown speaker 'narrator' in a turn; accepted: system, human",
        ),
        ([{"dialog": [], "id": 1}], [], "formats accepted"),
        (
            [{"q": "a"}],
            ["--data-format", "alpaca"],
            "alpaca data needs a column for --prompt-field (instruction); columns: ['q']",
        ),
        ([{"text": "x"}], ["--text-field", "body"], "--text-field 'body' is not a column"),
    ],
)
def test_unusable_data_is_one_line(
    calibrated_home: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    records: list[dict[str, Any]],
    argv: list[str],
    fragment: str,
) -> None:
    path = write(tmp_path / "data.jsonl", records)
    code, _, err = run_main("train", ["--data", str(path), "--deadline", "30m", *argv], capsys)
    assert_one_line_error(code, err, fragment)


def test_chat_data_without_a_chat_template_gets_chatml(tmp_path: Path) -> None:
    """A base model's tokenizer has no template: ChatML, as TRL gives it (tests/test_chat_template.py)."""
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = None
    data = load_tokenized(str(write(tmp_path / "sharegpt.jsonl", [SHAREGPT])), tokenizer)
    assert tokenizer.decode(data.sample(0).tolist()).startswith("<|im_start|>")


def cache_dataset(hub: Path, repo: str, files: dict[str, list[dict[str, Any]]]) -> Path:
    root = hub / f"datasets--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / ("d" * 40)
    snapshot.mkdir(parents=True)
    for name, records in files.items():
        write(snapshot / name, records)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text("d" * 40)
    return snapshot


def test_a_hub_dataset_is_read_from_the_cache_offline(offline_hub: Path) -> None:
    cache_dataset(offline_hub, "org/chats", {"train.jsonl": [SHAREGPT] * 3, "test.jsonl": [SHAREGPT]})
    tokenizer = byte_tokenizer()
    data = load_tokenized("org/chats", tokenizer)
    assert data.format == "sharegpt" and len(data) == 3
    assert len(load_records("org/chats", split="test")) == 1
    with pytest.raises(
        BenchtrainError, match=r"hub dataset org/chats has splits \[.*\] but no 'validation': pass --data-split"
    ):
        load_records("org/chats", split="validation")
    with pytest.raises(
        BenchtrainError,
        match=r"dataset org/absent is not in the hub cache .* `hf download org/absent --repo-type dataset`",
    ):
        load_records("org/absent")


def padded(lengths: list[int], fmt: str = "messages") -> TokenizedData:
    return tokenized_from_samples(
        [np.zeros(length, dtype=np.int32) for length in lengths], [0] * len(lengths), fmt, "test"
    )


def test_bench_measures_the_lengths_train_will_plan_for_the_data() -> None:
    # Seed 004's data: at most 1481 tokens, so 1536 covers all of it (and 99.5% of it here).
    lengths = [200 + (i * 7919) % 1000 for i in range(400)] + [1470, 1475, 1478, 1480, 1481]
    assert lengths_to_measure(padded(lengths), (512, 1024, 2048), 131072) == (512, 1024, 1536)
    assert lengths_to_measure(padded(lengths), (64, 128, 256), 131072) == (128, 256, 1536)
    # A long tail: 99.5% and all of it are two lengths, both measured.
    tail = [300] * 995 + [3000] * 5
    assert lengths_to_measure(padded(tail), (512, 1024, 2048), 131072) == (160, 320, 3008)
    # Short data: halves below; the model's position table caps the longest.
    assert lengths_to_measure(padded([40] * 10), (64, 128, 256), 131072) == (16, 32, 64)
    assert lengths_to_measure(padded(lengths), (512, 1024, 2048), 1024) == (256, 512, 1024)
    # Packed text fills any length: the defaults stay.
    assert lengths_to_measure(padded(lengths, "text"), (512, 1024, 2048), 131072) == (512, 1024, 2048)
