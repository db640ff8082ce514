"""A base model's tokenizer without a chat template trains on chat data with ChatML (issue 39).

Llama-3.1-8B base and Mistral-7B base ship no chat template; chat data was refused ("this tokenizer
has none"), where TRL gives such a model ChatML. Now the tokenizer gets ChatML as plain text (no
tokens added: the embeddings keep their size), the cache key covers it, the plan says so, run.json
records it, and final/'s tokenizer carries it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import CONVERSATION, chat_file, load_tokenized, run_main, trained_text

from benchtrain.train.workload.prepare import tokenizer_fingerprint
from benchtrain.train.workload.tokenizer import CHATML_TEMPLATE, byte_tokenizer, ensure_chat_template, load_tokenizer


def base_tokenizer_folder(tmp_path: Path) -> Path:
    """A tokenizer folder as a base model ships it: no chat template."""
    folder = tmp_path / "base-tokenizer"
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = None
    tokenizer.save_pretrained(folder)
    assert load_tokenizer(None, str(folder)).chat_template is None
    return folder


def test_chat_data_on_a_tokenizer_without_a_template_is_rendered_as_chatml(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(None, str(base_tokenizer_folder(tmp_path)))
    size = len(tokenizer)
    data = load_tokenized(str(chat_file(tmp_path)), tokenizer)
    assert tokenizer.chat_template == CHATML_TEMPLATE and len(tokenizer) == size  # no tokens added
    text = tokenizer.decode(data.sample(0).tolist())
    assert text.startswith(
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello"
    )
    # The loss stays on the assistant's turns: their content and ChatML's end of turn.
    assert trained_text(tokenizer, data) == "hello<|im_end|>\n4<|im_end|>\n"


def test_the_cache_key_tells_chatml_from_the_tokenizer_s_own_template(tmp_path: Path) -> None:
    """The data cache's key digests the template: tokens rendered with ChatML are never read back
    for a tokenizer with a template of its own, nor the other way round."""
    bare, own = byte_tokenizer(), byte_tokenizer()
    bare.chat_template = None
    assert ensure_chat_template(bare) == "chatml" and ensure_chat_template(own) == "tokenizer"
    assert ensure_chat_template(bare) == "chatml"  # once added, still said to be added
    assert tokenizer_fingerprint(bare) != tokenizer_fingerprint(own)
    again = byte_tokenizer()
    again.chat_template = None
    ensure_chat_template(again)
    assert tokenizer_fingerprint(again) == tokenizer_fingerprint(bare)  # the same base reuses its cache


def test_text_data_leaves_the_tokenizer_alone(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(None, str(base_tokenizer_folder(tmp_path)))
    path = tmp_path / "text.jsonl"
    path.write_text(json.dumps({"text": "plain text"}) + "\n")
    load_tokenized(str(path), tokenizer)
    assert tokenizer.chat_template is None


@pytest.mark.slow
def test_a_base_tokenizer_trains_on_chat_data_and_run_json_says_chatml(
    calibrated_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = base_tokenizer_folder(tmp_path)
    path = chat_file(tmp_path, count=40)
    common = [
        "--data",
        str(path),
        "--tokenizer",
        str(folder),
        "--deadline",
        "30m",
        "--effective-batch",
        "4",
        "--max-steps",
        "2",
        "--no-report",
    ]
    code, out, err = run_main("train", [*common, "--dry-run"], capsys)
    assert code == 0, err
    assert "chat template: ChatML" in out
    code, _, err = run_main("train", common, capsys)
    assert code == 0, err
    run = next((calibrated_home / "runs").glob("*/run.json")).parent
    record = json.loads((run / "run.json").read_text())
    assert record["data"]["preparation"]["chat_template"] == "chatml" and record["data"]["loss_on"] == "assistant turns"
    # final/'s tokenizer renders chats as training saw them.
    saved = load_tokenizer(None, str(run / "final"))
    assert saved.chat_template == CHATML_TEMPLATE
    assert saved.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True).endswith(
        "<|im_start|>assistant\n"
    )
