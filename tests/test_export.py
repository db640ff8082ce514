"""A finished run leaves a model people can use: final/ that transformers and peft load (issue 11)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from test_cli import calibrated_home, run_main
from test_train import make_run, tokenizer

from common.errors import BenchtrainError
from train.export import export_final, load_final, resolve_base
from train.workload.method import MethodConfig
from train.workload.model import resolve_model

__all__ = ["calibrated_home", "tokenizer"]  # fixtures shared with other test modules
PROMPT = torch.tensor([[5, 17, 99, 42, 7, 250, 3, 64]])


def trained(tmp_path: Path, data: Path, tokenizer, method: MethodConfig) -> tuple[torch.nn.Module, Path]:
    run = make_run(tmp_path, data, tokenizer, deadline=1e6, steps=3, method=method)
    run.run()
    return run.accelerator.unwrap_model(run.model), tmp_path / "run"


def logits(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=PROMPT).logits


def test_full_fine_tuning_final_loads_with_transformers(tmp_path: Path, heavy_tailed_jsonl: Path, tokenizer) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, run_dir = trained(tmp_path, heavy_tailed_jsonl, tokenizer, MethodConfig())
    record = export_final(run_dir, model, tokenizer, resolve_model("tiny"), MethodConfig())
    final = Path(record["path"])
    assert (final / "model.safetensors").is_file() and (final / "config.json").is_file() and (final / "generation_config.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(final)
    assert torch.allclose(logits(loaded), logits(model), atol=1e-5)
    assert loaded.generate(PROMPT, max_new_tokens=4, do_sample=False).shape == (1, 12)
    assert AutoTokenizer.from_pretrained(final).decode(tokenizer("héllo")["input_ids"]) == "héllo"
    assert torch.allclose(logits(load_final(final)), logits(model), atol=1e-5)  # load_final: a full fine-tune as is
    assert not [p for p in run_dir.iterdir() if p.name.endswith(".tmp")]


def test_lora_final_is_an_adapter_that_peft_loads_onto_the_written_base(
    tmp_path: Path, heavy_tailed_jsonl: Path, tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    method = MethodConfig(method="lora", lora_rank=4)
    model, run_dir = trained(tmp_path, heavy_tailed_jsonl, tokenizer, method)
    expected = logits(model)
    record = export_final(run_dir, model, tokenizer, resolve_model("tiny"), method, merge_lora=True)
    final, base_dir = Path(record["path"]), Path(record["base_path"])
    assert {"adapter_config.json", "adapter_model.safetensors", "config.json", "tokenizer.json"} <= {p.name for p in final.iterdir()}
    with safe_open(final / "adapter_model.safetensors", "pt") as handle:
        assert list(handle.keys()) and all("lora_" in key for key in handle.keys())
    assert base_dir == (run_dir / "final-base").resolve() and record["base_model_name_or_path"] == "../final-base"
    assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == "../final-base"
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    adapted = PeftModel.from_pretrained(base, final)
    assert torch.allclose(logits(adapted), expected, atol=1e-5)
    assert adapted.generate(input_ids=PROMPT, max_new_tokens=4, do_sample=False).shape == (1, 12)
    from peft import AutoPeftModelForCausalLM

    monkeypatch.chdir(final)  # peft resolves the relative base against the current directory
    assert torch.allclose(logits(AutoPeftModelForCausalLM.from_pretrained(final)), expected, atol=1e-5)
    merged = AutoModelForCausalLM.from_pretrained(record["merged_path"])
    assert torch.allclose(logits(merged), expected, atol=1e-5)  # merged = base + adapter


def test_a_lora_run_on_a_model_folder_points_the_adapter_at_it(tmp_path: Path, heavy_tailed_jsonl: Path, tokenizer) -> None:
    from train.workload.model import build_model

    folder = tmp_path / "base-model"
    build_model(resolve_model("tiny"), "cpu").save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    method = MethodConfig(method="lora", lora_rank=4)
    model, run_dir = trained(tmp_path, heavy_tailed_jsonl, tokenizer, method)
    record = export_final(run_dir, model, tokenizer, resolve_model(str(folder)), method)
    assert record["base_model_name_or_path"] == str(folder.resolve()) and "base_path" not in record
    assert not (run_dir / "final-base").exists()
    # Outside the run folder: not part of the run, so named by its absolute path.
    assert json.loads((run_dir / "final" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(folder.resolve())


def move(run_dir: Path, destination: Path) -> Path:
    """The run folder copied elsewhere and the original deleted, as when a run goes to another machine."""
    shutil.copytree(run_dir, destination)
    shutil.rmtree(run_dir)
    return destination


def test_a_moved_lora_run_still_loads_with_load_final_and_peft(tmp_path: Path, heavy_tailed_jsonl: Path, tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    from peft import AutoPeftModelForCausalLM

    method = MethodConfig(method="lora", lora_rank=4)
    model, run_dir = trained(tmp_path, heavy_tailed_jsonl, tokenizer, method)
    expected = logits(model)
    export_final(run_dir, model, tokenizer, resolve_model("tiny"), method)
    adapter_config = (run_dir / "final" / "adapter_config.json").read_text()
    assert json.loads(adapter_config)["base_model_name_or_path"] == "../final-base"
    assert str(tmp_path) not in adapter_config and str(tmp_path.resolve()) not in adapter_config

    moved = move(run_dir, tmp_path / "elsewhere" / "shared-run")
    unrelated = tmp_path / "unrelated"
    unrelated.mkdir()
    monkeypatch.chdir(unrelated)  # load_final resolves the base against final/, not the current directory
    assert torch.allclose(logits(load_final(moved / "final")), expected, atol=1e-5)
    monkeypatch.chdir(moved / "final")  # peft's own loader, from inside final/
    assert torch.allclose(logits(AutoPeftModelForCausalLM.from_pretrained(".")), expected, atol=1e-5)


def test_a_model_folder_inside_the_run_folder_is_named_relative_to_final(tmp_path: Path, tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    from train.workload.model import build_model

    run_dir = tmp_path / "run"
    folder = run_dir / "models" / "base"
    build_model(resolve_model("tiny"), "cpu").save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    spec, method = resolve_model(str(folder)), MethodConfig(method="lora", lora_rank=4)
    model = build_model(spec, "cpu", method)
    expected = logits(model)
    record = export_final(run_dir, model, tokenizer, spec, method)
    assert record["base_model_name_or_path"] == "../models/base" and record["base_path"] == str(folder.resolve())
    moved = move(run_dir, tmp_path / "moved")
    monkeypatch.chdir(tmp_path)
    assert torch.allclose(logits(load_final(moved / "final")), expected, atol=1e-5)


def test_load_final_names_a_missing_relative_base(tmp_path: Path, tokenizer) -> None:
    from train.workload.model import build_model

    spec, method = resolve_model("tiny"), MethodConfig(method="lora", lora_rank=4)
    run_dir = tmp_path / "run"
    export_final(run_dir, build_model(spec, "cpu", method), tokenizer, spec, method)
    shutil.rmtree(run_dir / "final-base")  # only final/ was copied
    with pytest.raises(BenchtrainError, match="final-base does not exist") as raised:
        load_final(run_dir / "final")
    assert str((run_dir / "final-base").resolve()) in str(raised.value) and "\n" not in str(raised.value)
    # A hub id or an absolute folder is left for from_pretrained as it is.
    assert resolve_base(run_dir / "final", "org/model") == "org/model" and resolve_base(run_dir / "final", "/models/base") == "/models/base"


def test_every_run_writes_final_and_a_stopped_one_says_partial(calibrated_home: Path, heavy_tailed_jsonl: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoModelForCausalLM

    argv = ["--data", str(heavy_tailed_jsonl), "--deadline", "30m", "--effective-batch", "4", "--max-steps", "2", "--no-report"]
    code, out, err = run_main("train", argv, capsys)
    assert code == 0, err
    run_dir = next((calibrated_home / "runs").iterdir())
    record = json.loads((run_dir / "run.json").read_text())
    assert record["final"]["path"] == "final" and record["final"]["partial"] is False  # relative to the run folder (issue 34)
    assert f"model: {run_dir / 'final'}" in out
    AutoModelForCausalLM.from_pretrained(run_dir / "final")


def test_an_interrupted_run_still_writes_final_marked_partial(
    calibrated_home: Path, heavy_tailed_jsonl: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import os
    import signal

    from train.step.step import TrainingStep

    real_run = TrainingStep.run
    calls = {"steps": 0}

    def sigterm_on_the_second_step(self, batches, grad_accum):
        calls["steps"] += 1
        if calls["steps"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_run(self, batches, grad_accum)

    monkeypatch.setattr(TrainingStep, "run", sigterm_on_the_second_step)
    code, out, _ = run_main("train", ["--data", str(heavy_tailed_jsonl), "--deadline", "30m", "--effective-batch", "4", "--no-report"], capsys)
    assert code == 130
    run_json = next((calibrated_home / "runs").glob("*/run.json"))
    record = json.loads(run_json.read_text())
    assert record["status"] == "interrupted" and record["final"]["partial"] is True
    assert "partial: the run stopped before its planned end" in out
    assert (run_json.parent / record["final"]["path"] / "model.safetensors").is_file()
