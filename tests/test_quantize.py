"""A quantized base's bytes (issue 32): the arithmetic of train.workload.quantize, computed on the
`meta` device, against the real bitsandbytes modules built on CPU; and the refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import (
    PROMPT_IDS,
    assert_one_line_error,
    configs,
    hide_bitsandbytes,
    loaded_bytes,
    logits,
    run_main,
    trained,
)

pytest.importorskip("bitsandbytes")

import torch

from benchtrain.common.errors import BenchtrainError
from benchtrain.train.workload.quantize import bitsandbytes_config, check_quantize, quantized_bytes

PROMPT = torch.tensor(PROMPT_IDS)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import torch
    from transformers import AutoModelForCausalLM

    folders = {}
    for name, config in configs().items():
        torch.manual_seed(0)
        folder = tmp_path_factory.mktemp(name)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        folders[name] = folder
    return folders


@pytest.mark.parametrize("architecture", ["gpt2", "llama"])
@pytest.mark.parametrize("kind", ["4bit", "8bit", "none"])
def test_the_bytes_of_a_quantized_base_are_known_before_it_is_built(
    saved: dict[str, Path], architecture: str, kind: str
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(configs()[architecture])
    predicted = quantized_bytes(meta, kind, dtype_bytes=4)
    options = {} if kind == "none" else {"quantization_config": bitsandbytes_config(kind, torch.bfloat16)}
    real = AutoModelForCausalLM.from_pretrained(saved[architecture], device_map="cpu", dtype=torch.float32, **options)
    # To the byte (the issue asks for 1%): packed weights, absmax, codes, offsets, row scales, the rest.
    assert predicted.total == loaded_bytes(real), predicted
    if kind == "none":
        assert predicted.layers == 0
    else:
        # Every block's projections are converted; the head is not (gpt2's is the tied embedding).
        assert predicted.layers == {"gpt2": 4, "llama": 7}[architecture] * 2
        assert type(real.get_output_embeddings()) is torch.nn.Linear
    if kind == "4bit":
        assert predicted.quantized * 8 == pytest.approx(
            sum(4 * i * o for i, o in _shapes(meta)), abs=8 * len(_shapes(meta))
        )


def _shapes(model: object) -> list[tuple[int, int]]:
    from benchtrain.train.workload.quantize import converted_layers

    return [(inputs, outputs) for _, inputs, outputs, _ in converted_layers(model)]


def test_quantize_is_for_a_frozen_base_and_needs_bitsandbytes(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(BenchtrainError, match="--quantize 4bit quantizes a frozen base: it needs --lora"):
        check_quantize("4bit", is_lora=False)
    with pytest.raises(BenchtrainError, match="--quantize must be one of none, 8bit, 4bit"):
        check_quantize("3bit", is_lora=True)
    check_quantize("none", is_lora=False)
    check_quantize("8bit", is_lora=True)

    hide_bitsandbytes(monkeypatch)
    with pytest.raises(
        BenchtrainError, match=r"needs bitsandbytes, which is not installed: pip install 'bitsandbytes>=0.48'"
    ):
        check_quantize("4bit", is_lora=True)


# The finished model and the command line (tiny on CPU) ------------------------------------------


@pytest.mark.parametrize("kind", ["4bit", "8bit"])
def test_a_lora_final_on_a_quantized_base_loads_as_it_was_trained_wherever_it_goes(
    tmp_path: Path, heavy_tailed_jsonl: Path, tokenizer: object, kind: str
) -> None:
    import shutil

    from benchtrain.train.export import export_final, load_final
    from benchtrain.train.workload.method import MethodConfig
    from benchtrain.train.workload.model import resolve_model

    method = MethodConfig(method="lora", quantize=kind)
    model, run_dir = trained(tmp_path, heavy_tailed_jsonl, tokenizer, method)
    expected = logits(model)
    record = export_final(run_dir, model, tokenizer, resolve_model("tiny"), method)
    # its unquantized base in final/
    assert record["base_quantization"] == kind and record["base_model_name_or_path"] == "."
    moved = tmp_path / "elsewhere"
    shutil.copytree(run_dir, moved)
    shutil.rmtree(run_dir)
    loaded = load_final(moved / "final")
    assert (
        type(loaded.get_base_model().model.layers[0].self_attn.q_proj.base_layer).__name__
        == {"4bit": "Linear4bit", "8bit": "Linear8bitLt"}[kind]
    )
    assert torch.allclose(logits(loaded), expected, atol=1e-4)  # the base quantizes again to the trained one
    plain = load_final(moved / "final", quantized=False)  # and the adapter loads on the unquantized base
    assert type(plain.get_base_model().model.layers[0].self_attn.q_proj.base_layer) is torch.nn.Linear
    assert plain.generate(input_ids=PROMPT, max_new_tokens=3, do_sample=False).shape == (1, PROMPT.shape[1] + 3)


@pytest.mark.slow
@pytest.mark.timeout(900)  # bitsandbytes on a CPU: ≈1 min alone, several beside two CPU hogs
def test_bench_then_train_on_a_4bit_base(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    grid = [
        "--gpu",
        "cpu",
        "--batch-sizes",
        "1,2,4",
        "--seq-lens",
        "32,64",
        "--workers",
        "0",
        "--accum",
        "1",
        "--budget",
        "5m",
        "--quiet",
        "--no-report",
    ]
    code, _, err = run_main("bench", ["run", "--lora", "--quantize", "4bit", *grid], capsys)
    assert code == 0, err
    calibration = json.loads(next((home / "calibrations").glob("*.json")).read_text())
    assert calibration["training"]["quantization"] == "4bit"
    code, printed, err = run_main("bench", ["list"], capsys)
    assert "LoRA r16 on a 4-bit base" in printed
    out = home / "run"
    # No deadline in reach: on a busy machine the calibration measures slow, wide steps, and a plan against a real
    # deadline is refused or stopped (the guard's own tests do that on a fake clock).
    arguments = [
        "--data",
        "sample",
        "--lora",
        "--deadline",
        "1000h",
        "--max-steps",
        "24",
        "--out",
        str(out),
        "--no-report",
    ]
    code, _, err = run_main("train", [*arguments[:3], "--quantize", "none", "--deadline", "5m", "--dry-run"], capsys)
    assert_one_line_error(code, err, "measured a 4bit base, this run asks for --quantize none")
    code, printed, err = run_main("train", arguments, capsys)  # --quantize auto: what the calibration measured
    assert code == 0, err
    assert "a 4-bit base" in printed
    record = json.loads((out / "run.json").read_text())
    losses = [entry["loss"] for entry in record["losses"]]
    assert sum(losses[-4:]) < sum(losses[:4])  # it learns
    assert record["final"]["base_quantization"] == "4bit" and record["training"]["quantization"] == "4bit"


@pytest.mark.parametrize("kind", ["4bit", "8bit"])
def test_the_plan_s_memory_need_is_what_the_quantized_lora_model_holds(kind: str) -> None:
    """train.planning.memory_check on `meta` against the model train builds (tiny, CPU)."""
    from benchtrain.train.planning.memory_check import memory_need
    from benchtrain.train.workload.method import MethodConfig
    from benchtrain.train.workload.model import build_model, resolve_model

    spec, method = resolve_model("tiny"), MethodConfig(method="lora", quantize=kind)
    need = memory_need(spec, method, "cpu")
    assert need.weights_bytes == loaded_bytes(build_model(spec, "cpu", method))
    assert need.weights_bytes < memory_need(spec, MethodConfig(method="lora"), "cpu").weights_bytes


def test_the_12b_dry_run_names_the_4bit_base_s_bytes(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """mistral-nemo-12b LoRA, planned for the bundled H100 calibration's device: the 4-bit base by
    hand from the config (weights packed two a byte; one 8-bit absmax per 64, its own absmax per
    256 of those; embeddings, head and norms in fp32 after peft's preparation), within 1%."""
    from benchtrain.train.workload.model import resolve_model

    c = resolve_model("mistral-nemo-12b").config_dict
    hidden, inner, heads, kv, head_dim = (
        c["hidden_size"],
        c["intermediate_size"],
        c["num_attention_heads"],
        c["num_key_value_heads"],
        c["head_dim"],
    )
    per_layer = hidden * heads * head_dim * 2 + hidden * kv * head_dim * 2 + 3 * hidden * inner
    weights = per_layer * c["num_hidden_layers"]
    unquantized = (2 * c["vocab_size"] * hidden + (2 * c["num_hidden_layers"] + 1) * hidden) * 4
    by_hand = weights / 2 + weights / 64 + weights / 64 / 256 * 4 + unquantized
    arguments = ["--data", "sample", "--model", "mistral-nemo-12b", "--lora", "--use-calibration", "h100-llama-3.2-1b"]
    arguments += ["--deadline", "5h", "--dry-run", "--force"]
    code, printed, err = run_main("train", arguments, capsys)
    assert code in (0, 3), err
    line = next(line for line in printed.splitlines() if "memory before activations" in line)
    four_bit = line.split("on a 4-bit base ≈")[1]
    base_gib = sum(float(part.split()[0]) for part in four_bit.split("(")[1].split(")")[0].split(" + "))
    assert abs(base_gib * 2**30 - by_hand) / by_hand < 0.01, (base_gib, by_hand / 2**30)
    assert "on an 8-bit base ≈" in line


def test_a_4bit_model_counts_the_weights_it_stands_for() -> None:
    """FLOPs, MFU and the calibration's parameter count come from the model's shape: a 4-bit base
    stores two weights a byte, but computes with all of them."""
    from benchtrain.train.workload.method import MethodConfig
    from benchtrain.train.workload.model import build_model, model_shape, resolve_model

    spec = resolve_model("tiny")
    plain, four_bit = (
        model_shape(build_model(spec, "cpu", MethodConfig(method="lora", quantize=kind))) for kind in ("none", "4bit")
    )
    assert four_bit == plain
