"""The workload both sides share: presets, local model folders (weights, tokenizer), data formats."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import load_tokenized

from benchtrain.common.errors import BenchtrainError
from benchtrain.train.workload.data import length_profile
from benchtrain.train.workload.model import PRESETS, build_model, model_shape, resolve_model
from benchtrain.train.workload.tokenizer import byte_tokenizer, load_tokenizer


def test_every_preset_builds_a_config_with_the_published_shape() -> None:
    from benchtrain.train.workload.model import make_config

    for name in PRESETS:
        config = make_config(resolve_model(name))
        assert config.vocab_size == PRESETS[name]["vocab_size"]
    one_b = make_config(resolve_model("llama-3.2-1b"))
    assert (one_b.hidden_size, one_b.num_hidden_layers, one_b.num_key_value_heads) == (2048, 16, 8)


def test_tiny_is_about_a_million_parameters_and_flops_follow_the_formula() -> None:
    shape = model_shape(build_model(resolve_model("tiny"), "cpu"))
    assert 0.5e6 < shape.parameter_count < 1.5e6
    assert shape.flops_per_token(128) == 6 * shape.matmul_parameter_count + 12 * 4 * 4 * 32 * 128


def test_a_local_folder_loads_its_weights_and_tokenizer(tmp_path: Path) -> None:
    model = build_model(resolve_model("tiny"), "cpu")
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # weights that a fresh init would not produce
    model.save_pretrained(tmp_path / "my-model")
    byte_tokenizer().save_pretrained(tmp_path / "my-model")
    spec = resolve_model(str(tmp_path / "my-model"))
    assert spec.has_weights and spec.name == "my-model"
    assert spec.fingerprint == resolve_model("tiny").fingerprint  # same architecture, same calibration
    loaded = build_model(spec, "cpu")
    assert torch.equal(next(loaded.parameters()), next(model.parameters()))
    tokenizer = load_tokenizer(spec.directory, None)
    assert tokenizer.decode(tokenizer("héllo")["input_ids"]) == "héllo"


def test_a_folder_without_tokenizer_asks_for_one(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 300}))
    with pytest.raises(BenchtrainError, match="pass --tokenizer"):
        load_tokenizer(resolve_model(str(tmp_path / "m")).directory, None)


@pytest.mark.parametrize(
    ("records", "fmt", "suffix"),
    [
        ([{"text": "hello world"}, {"text": "a longer sample of text"}], "text", ".jsonl"),
        (
            [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}],
            "messages",
            ".jsonl",
        ),
        (
            [{"prompt": "2+2=", "completion": "4"}, {"prompt": "capital?", "completion": "Paris"}],
            "prompt_completion",
            ".json",
        ),
    ],
)
def test_formats(tmp_path: Path, records: list[dict], fmt: str, suffix: str) -> None:
    path = tmp_path / f"data{suffix}"
    text = "\n".join(json.dumps(r) for r in records) if suffix == ".jsonl" else json.dumps(records)
    path.write_text(text)
    data = load_tokenized(str(path), byte_tokenizer())
    assert data.format == fmt
    assert len(data) == len(records)
    if fmt == "prompt_completion":
        assert data.prompt_lengths.tolist() == [4, 8]  # bytes of the prompts: loss only on completions
    if fmt == "messages":
        assert "<|assistant|>" in byte_tokenizer().decode(data.sample(0).tolist())


def test_csv_parquet_and_saved_datasets(tmp_path: Path) -> None:
    import datasets
    import pandas as pd

    frame = pd.DataFrame({"text": ["one", "two two", "three three three"]})
    frame.to_csv(tmp_path / "d.csv", index=False)
    frame.to_parquet(tmp_path / "d.parquet")
    datasets.Dataset.from_pandas(frame).save_to_disk(str(tmp_path / "saved"))
    for source in ("d.csv", "d.parquet", "saved"):
        data = load_tokenized(str(tmp_path / source), byte_tokenizer())
        assert length_profile(data.lengths)["count"] == 3
        assert data.lengths.tolist() == [4, 8, 18]  # bytes + EOS


def test_bench_with_real_data(home: Path, heavy_tailed_jsonl: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from benchtrain.bench.cli import main
    from benchtrain.common.errors import guard_cli

    code = guard_cli(
        main,
        [
            "run",
            "--data",
            str(heavy_tailed_jsonl),
            "--batch-sizes",
            "1,2",
            "--workers",
            "0",
            "--accum",
            "1",
            "--seq-lens",
            "32,64",
            "--max-probe-seconds",
            "0.3",
            "--quiet",
            "--no-report",
        ],
    )
    assert code == 0, capsys.readouterr().err
    calibration_file = next((home / "calibrations").glob("*.json"))
    data = json.loads(calibration_file.read_text())
    assert data["data"]["format"] == "text" and data["data"]["profile"]["count"] == 300
    assert all(row["status"] == "ok" for row in data["measurements"])
