"""Adding a data format is one entry in train.workload.formats.FORMATS (issue 42): a `qa` format
(question/answer columns, the loss on the answer) registered in the table alone is detected,
offered by --data-format, encoded with the loss on the answer only, batched, and planned by
`train --dry-run`; no other module names it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import load_tokenized, run_main, trained_text

from benchtrain.common.errors import BenchtrainError
from benchtrain.train.workload import formats
from benchtrain.train.workload.batching import PaddedBatches, epoch_batches
from benchtrain.train.workload.formats import (
    BY_COLUMNS,
    Columns,
    DataFormat,
    DataSchema,
    Encoded,
    Layout,
    Record,
    Tokenizing,
    detect_layout,
)
from benchtrain.train.workload.tokenizer import byte_tokenizer

QA = [{"question": f"what is {n}+{n}?", "answer": str(2 * n)} for n in range(1, 41)]
ANSWER_TOKENS = sum(len(record["answer"]) + 1 for record in QA)  # a byte tokenizer: each answer's bytes and its EOS


# The new format's functions, module-level as the table asks (encoding runs in worker processes).
def qa_claim(present: set[str], schema: DataSchema) -> int | None:
    return BY_COLUMNS + 25 if {"question", "answer"} <= present else None


def qa_layout(columns: Columns) -> Layout:
    # A new format reuses Layout's fields (they are the cache key's): the question as the prompt, the answer as the completion.
    return Layout(
        "qa", prompt=columns.pick(None, "question", ("question",)), completion=columns.pick(None, "answer", ("answer",))
    )


def encode_qa(tools: Tokenizing, records: list[Record]) -> Encoded:
    prompts = tools.ids([f"Q: {text}\nA: " for text in tools.texts(records, tools.layout.prompt)])
    answers = tools.ids(tools.texts(records, tools.layout.completion))
    return [p + a + tools.eos for p, a in zip(prompts, answers, strict=True)], None, [len(p) for p in prompts]


QA_FORMAT = DataFormat(
    "qa", "qa (question, answer)", "qa (question, answer)", qa_claim, qa_layout, encode_qa, "answers", prompts=True
)


@pytest.fixture()
def with_qa(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(formats.FORMATS, "qa", QA_FORMAT)


def qa_file(tmp_path: Path) -> Path:
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in QA))
    return path


def test_without_the_entry_question_answer_data_is_not_recognised(tmp_path: Path) -> None:
    with pytest.raises(BenchtrainError, match="no usable text field"):
        detect_layout(["question", "answer"], DataSchema(), "qa.jsonl")


def test_a_format_added_to_the_table_is_detected_encoded_and_batched(with_qa: None, tmp_path: Path) -> None:
    assert detect_layout(["question", "answer"], DataSchema(), "qa.jsonl") == Layout(
        "qa", prompt="question", completion="answer"
    )
    assert DataSchema(format="qa").format == "qa"  # --data-format's check reads the table
    tokenizer = byte_tokenizer()
    data = load_tokenized(str(qa_file(tmp_path)), tokenizer)
    assert (data.format, data.loss_on, data.packing, len(data)) == ("qa", "answers", False, len(QA))
    assert tokenizer.decode(data.sample(0).tolist()) == "Q: what is 1+1?\nA: 2<|eos|>"
    # The loss is on the answer (and its end) only: the prompt's length is kept per document.
    assert trained_text(tokenizer, data) == "2<|eos|>"
    assert data.prompt_length(0) == len("Q: what is 1+1?\nA: ")
    batches = epoch_batches(data, 4, 64, seed=0, epoch=0)
    loader = PaddedBatches(data, batches, 64, 0)
    targets = sum(int(loader[i]["target_tokens"]) for i in range(len(loader)))
    assert len(loader) == len(QA) // 4 and targets == ANSWER_TOKENS


def test_data_format_offers_the_new_format_and_train_plans_it(
    with_qa: None, calibrated_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchtrain.train.cli import build_parser

    assert "qa (question, answer)" in " ".join(build_parser().format_help().split())
    argv = ["--data", str(qa_file(tmp_path)), "--data-format", "qa", "--deadline", "5m", "--dry-run", "--json"]
    code, out, err = run_main("train", argv, capsys)
    assert code == 0, err
    chosen = json.loads(out)["plan"]["chosen"]
    # Planned as the table says: padded samples (not packed), the loss on the answers only (the tiny model's tokenizer is bytes).
    assert "truncation" in chosen and chosen["tokens"] == ANSWER_TOKENS
