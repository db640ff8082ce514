"""Chat data: the tokenizer's own template, loss on the assistant's turns by default (issue 11)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import chat_file, load_tokenized, run_main, trained_text

from benchtrain.train.workload.tokenizer import byte_tokenizer, load_tokenizer


def test_the_loss_is_on_the_assistant_turns_only(tmp_path: Path) -> None:
    tokenizer = byte_tokenizer()
    data = load_tokenized(str(chat_file(tmp_path)), tokenizer)
    assert data.loss_on == "assistant turns"
    assert trained_text(tokenizer, data) == "hello<|eos|>4<|eos|>"
    assert int(data.mask(0).sum()) == len("hello") + 1 + len("4") + 1


def test_train_on_all_keeps_every_token(tmp_path: Path) -> None:
    tokenizer = byte_tokenizer()
    data = load_tokenized(str(chat_file(tmp_path)), tokenizer, train_on="all")
    assert data.loss_mask is None and data.loss_on == "all tokens"
    assert trained_text(tokenizer, data).startswith("<|system|>be brief")


def test_a_model_folder_s_own_chat_template_is_used(tmp_path: Path) -> None:
    folder = tmp_path / "tokenizer"
    own = byte_tokenizer()
    own.chat_template = "{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}### assistant: {% endif %}"
    own.save_pretrained(folder)
    tokenizer = load_tokenizer(None, str(folder))
    data = load_tokenized(str(chat_file(tmp_path)), tokenizer)
    text = tokenizer.decode(data.sample(0).tolist())
    assert text.startswith("### system: be brief\n")
    assert trained_text(tokenizer, data) == "hello\n4\n"


def test_a_chat_run_records_where_the_loss_is(
    calibrated_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = chat_file(tmp_path, count=40)
    code, _, err = run_main(
        "train",
        ["--data", str(path), "--deadline", "30m", "--effective-batch", "4", "--max-steps", "2", "--no-report"],
        capsys,
    )
    assert code == 0, err
    record = json.loads(next((calibrated_home / "runs").glob("*/run.json")).read_text())
    assert record["data"]["loss_on"] == "assistant turns"
    # Real tokens planned = the assistant tokens only (8 per conversation), for 2 of 10 steps.
    assert record["estimate"]["tokens"] == pytest.approx(8 * 40 * 2 / np.ceil(40 / 4), rel=0.01)
