"""A finished run leaves a model people can use: final/ that transformers and peft load, from any
directory, wherever the run folder was moved."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import PROMPT_IDS, logits, run_main, trained

from benchtrain.common.errors import BenchtrainError
from benchtrain.train.export import export_final, load_final, name_base, resolve_base
from benchtrain.train.workload.method import MethodConfig
from benchtrain.train.workload.model import resolve_model

PROMPT = torch.tensor(PROMPT_IDS)


def with_a_visible_adapter(model: torch.nn.Module) -> torch.nn.Module:
    """A few steps barely move LoRA's B matrices from zero: give them weights whose effect on the
    logits no tolerance hides, so a loader that drops the adapter (or applies it twice) shows."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    return model


def base_logits(model: torch.nn.Module) -> torch.Tensor:
    """The logits of a peft model's base, its adapter off."""
    with model.disable_adapter():
        return logits(model)


def test_full_fine_tuning_final_loads_with_transformers(tmp_path: Path, heavy_tailed_jsonl: Path, tokenizer) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, run_dir = trained(tmp_path, heavy_tailed_jsonl, tokenizer, MethodConfig())
    record = export_final(run_dir, model, tokenizer, resolve_model("tiny"), MethodConfig())
    final = Path(record["path"])
    assert (
        (final / "model.safetensors").is_file()
        and (final / "config.json").is_file()
        and (final / "generation_config.json").is_file()
    )
    loaded = AutoModelForCausalLM.from_pretrained(final)
    assert torch.allclose(logits(loaded), logits(model), atol=1e-5)
    assert loaded.generate(PROMPT, max_new_tokens=4, do_sample=False).shape == (1, 12)
    assert AutoTokenizer.from_pretrained(final).decode(tokenizer("héllo")["input_ids"]) == "héllo"
    assert torch.allclose(logits(load_final(final)), logits(model), atol=1e-5)  # load_final: a full fine-tune as is
    assert not [p for p in run_dir.iterdir() if p.name.endswith(".tmp")]


def test_lora_final_holds_the_adapter_and_the_base_it_was_trained_on(
    tmp_path: Path, heavy_tailed_jsonl: Path, tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A preset has no weights anywhere but in the run: final/ holds them beside the adapter (the
    adapter names its base as "."), the layout transformers loads as a model with an embedded adapter."""
    from peft import AutoPeftModelForCausalLM, PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    method = MethodConfig(method="lora", lora_rank=4)
    model, run_dir = trained(tmp_path, heavy_tailed_jsonl, tokenizer, method)
    expected, without_adapter = logits(with_a_visible_adapter(model)), base_logits(model)
    assert not torch.allclose(without_adapter, expected, atol=1e-3)
    # merges `model` in place
    record = export_final(run_dir, model, tokenizer, resolve_model("tiny"), method, merge_lora=True)
    final = Path(record["path"])
    assert {
        "adapter_config.json",
        "adapter_model.safetensors",
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    } <= {p.name for p in final.iterdir()}
    with safe_open(final / "adapter_model.safetensors", "pt") as handle:
        assert list(handle.keys()) and all("lora_" in key for key in handle.keys())
    with safe_open(final / "model.safetensors", "pt") as handle:
        # the plain base
        assert list(handle.keys()) and not any("lora_" in key or "base_layer" in key for key in handle.keys())
    assert (
        record["base_model_name_or_path"] == "." and "base_path" not in record and not (run_dir / "final-base").exists()
    )
    assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == "."
    loaded = AutoModelForCausalLM.from_pretrained(final)  # transformers: the base in final/, then its adapter
    assert torch.allclose(logits(loaded), expected, atol=1e-5)
    assert loaded.generate(PROMPT, max_new_tokens=4, do_sample=False).shape == (1, 12)
    adapted = load_final(final)
    assert isinstance(adapted, PeftModel) and torch.allclose(logits(adapted), expected, atol=1e-5)
    assert torch.allclose(base_logits(adapted), without_adapter, atol=1e-5)  # the base, without the adapter in it twice
    monkeypatch.chdir(final)  # peft's loader opens the base by its name, from the current directory
    assert torch.allclose(logits(AutoPeftModelForCausalLM.from_pretrained(".")), expected, atol=1e-5)
    merged = AutoModelForCausalLM.from_pretrained(record["merged_path"])
    assert torch.allclose(logits(merged), expected, atol=1e-5)  # merged = base + adapter


def test_a_lora_run_on_a_model_folder_points_the_adapter_at_it(
    tmp_path: Path, heavy_tailed_jsonl: Path, tokenizer
) -> None:
    from benchtrain.train.workload.model import build_model

    folder = tmp_path / "base-model"
    build_model(resolve_model("tiny"), "cpu").save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    method = MethodConfig(method="lora", lora_rank=4)
    model, run_dir = trained(tmp_path, heavy_tailed_jsonl, tokenizer, method)
    record = export_final(run_dir, model, tokenizer, resolve_model(str(folder)), method)
    assert record["base_model_name_or_path"] == str(folder.resolve()) and "base_path" not in record
    assert not (run_dir / "final-base").exists()
    # Outside the run folder: not part of the run, so named by its absolute path.
    assert json.loads((run_dir / "final" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        folder.resolve()
    )


def move(run_dir: Path, destination: Path) -> Path:
    """The run folder copied elsewhere and the original deleted, as when a run goes to another machine."""
    shutil.copytree(run_dir, destination)
    shutil.rmtree(run_dir)
    return destination


def test_a_moved_lora_run_loads_from_any_directory(
    tmp_path: Path, heavy_tailed_jsonl: Path, tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run folder copied to another place and the original deleted; from an unrelated current
    directory, transformers and load_final give the trained model's outputs, and no path of the
    place it was written in is left in final/."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    method = MethodConfig(method="lora", lora_rank=4)
    model, run_dir = trained(tmp_path, heavy_tailed_jsonl, tokenizer, method)
    expected = logits(with_a_visible_adapter(model))
    export_final(run_dir, model, tokenizer, resolve_model("tiny"), method)
    for file in (run_dir / "final").glob("*.json"):
        assert str(tmp_path) not in file.read_text() and str(tmp_path.resolve()) not in file.read_text(), file.name

    moved = move(run_dir, tmp_path / "elsewhere" / "shared-run")
    unrelated = tmp_path / "unrelated"
    unrelated.mkdir()
    monkeypatch.chdir(unrelated)
    assert torch.allclose(logits(AutoModelForCausalLM.from_pretrained(moved / "final")), expected, atol=1e-5)
    assert torch.allclose(logits(load_final(moved / "final")), expected, atol=1e-5)
    assert AutoTokenizer.from_pretrained(moved / "final").decode(tokenizer("héllo")["input_ids"]) == "héllo"
    monkeypatch.chdir(moved / "final")  # peft's own loader, from inside final/
    from peft import AutoPeftModelForCausalLM

    assert torch.allclose(logits(AutoPeftModelForCausalLM.from_pretrained(".")), expected, atol=1e-5)


def test_a_model_folder_inside_the_run_folder_goes_into_final(
    tmp_path: Path, tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM

    from benchtrain.train.workload.model import build_model

    run_dir = tmp_path / "run"
    folder = run_dir / "models" / "base"
    build_model(resolve_model("tiny"), "cpu").save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    spec, method = resolve_model(str(folder)), MethodConfig(method="lora", lora_rank=4)
    model = with_a_visible_adapter(build_model(spec, "cpu", method))
    expected = logits(model)
    record = export_final(run_dir, model, tokenizer, spec, method)
    assert record["base_model_name_or_path"] == "." and (run_dir / "final" / "model.safetensors").is_file()
    moved = move(run_dir, tmp_path / "moved")
    monkeypatch.chdir(tmp_path)
    assert torch.allclose(logits(load_final(moved / "final")), expected, atol=1e-5)
    assert torch.allclose(logits(AutoModelForCausalLM.from_pretrained(moved / "final")), expected, atol=1e-5)


def older_layout(run_dir: Path) -> None:
    """final/ as runs wrote it before the base moved into it: the base in final-base/ beside it, the
    adapter naming it `../final-base`."""
    final, base = run_dir / "final", run_dir / "final-base"
    base.mkdir()
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        if (final / name).exists():
            shutil.move(final / name, base / name)
    shutil.copy(base / "config.json", final / "config.json")
    name_base(final / "adapter_config.json", "../final-base")


def test_an_older_run_names_its_base_beside_final_and_still_loads(
    tmp_path: Path, tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from benchtrain.train.workload.model import build_model

    spec, method = resolve_model("tiny"), MethodConfig(method="lora", lora_rank=4)
    run_dir = tmp_path / "run"
    model = with_a_visible_adapter(build_model(spec, "cpu", method))
    expected = logits(model)
    export_final(run_dir, model, tokenizer, spec, method)
    older_layout(run_dir)
    moved = move(run_dir, tmp_path / "moved")
    monkeypatch.chdir(tmp_path)
    assert torch.allclose(logits(load_final(moved / "final")), expected, atol=1e-5)
    shutil.rmtree(moved / "final-base")  # only final/ was copied
    with pytest.raises(BenchtrainError, match="final-base does not exist") as raised:
        load_final(moved / "final")
    assert str((moved / "final-base").resolve()) in str(raised.value) and "\n" not in str(raised.value)
    # A hub id or an absolute folder is left for from_pretrained as it is.
    assert (
        resolve_base(moved / "final", "org/model") == "org/model"
        and resolve_base(moved / "final", "/models/base") == "/models/base"
    )


def test_every_run_writes_final_and_a_stopped_one_says_partial(
    calibrated_home: Path, heavy_tailed_jsonl: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForCausalLM

    argv = [
        "--data",
        str(heavy_tailed_jsonl),
        "--deadline",
        "30m",
        "--effective-batch",
        "4",
        "--max-steps",
        "2",
        "--no-report",
    ]
    code, out, err = run_main("train", argv, capsys)
    assert code == 0, err
    run_dir = next((calibrated_home / "runs").iterdir())
    record = json.loads((run_dir / "run.json").read_text())
    # relative to the run folder (issue 34)
    assert record["final"]["path"] == "final" and record["final"]["partial"] is False
    assert f"model: {run_dir / 'final'}" in out
    AutoModelForCausalLM.from_pretrained(run_dir / "final")


def test_an_interrupted_run_still_writes_final_marked_partial(
    calibrated_home: Path, heavy_tailed_jsonl: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import os
    import signal

    from benchtrain.train.step.step import TrainingStep

    real_run = TrainingStep.run
    calls = {"steps": 0}

    def sigterm_on_the_second_step(self, batches, grad_accum):
        calls["steps"] += 1
        if calls["steps"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_run(self, batches, grad_accum)

    monkeypatch.setattr(TrainingStep, "run", sigterm_on_the_second_step)
    code, out, _ = run_main(
        "train",
        ["--data", str(heavy_tailed_jsonl), "--deadline", "30m", "--effective-batch", "4", "--no-report"],
        capsys,
    )
    assert code == 130
    run_json = next((calibrated_home / "runs").glob("*/run.json"))
    record = json.loads(run_json.read_text())
    assert record["status"] == "interrupted" and record["final"]["partial"] is True
    assert "partial:" in out  # the console says final/ is partial, as run.json does
    assert (run_json.parent / record["final"]["path"] / "model.safetensors").is_file()
