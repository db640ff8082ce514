"""A quantized base's bytes (issue 32): the arithmetic of train.workload.quantize, computed on the
`meta` device, against the real bitsandbytes modules built on CPU; and the refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("bitsandbytes")

from common.errors import BenchtrainError
from train.workload.quantize import bitsandbytes_config, check_quantize, loaded_bytes, quantized_bytes


def configs() -> dict[str, object]:
    from transformers import GPT2Config, LlamaConfig

    return {
        # gpt2's layers (Conv1D, a tied head), two blocks of them.
        "gpt2": GPT2Config(n_layer=2, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024),
        # Llama's (nn.Linear, an untied head, no biases), odd sizes: blocks that do not divide.
        "llama": LlamaConfig(
            hidden_size=200,
            intermediate_size=530,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=1003,
            tie_word_embeddings=False,
        ),
    }


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
def test_the_bytes_of_a_quantized_base_are_known_before_it_is_built(saved: dict[str, Path], architecture: str, kind: str) -> None:
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
        assert predicted.quantized * 8 == pytest.approx(sum(4 * i * o for i, o in _shapes(meta)), abs=8 * len(_shapes(meta)))


def _shapes(model: object) -> list[tuple[int, int]]:
    from train.workload.quantize import converted_layers

    return [(inputs, outputs) for _, inputs, outputs, _ in converted_layers(model)]


def test_quantize_is_for_a_frozen_base_and_needs_bitsandbytes(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(BenchtrainError, match="--quantize 4bit quantizes a frozen base: it needs --lora"):
        check_quantize("4bit", is_lora=False)
    with pytest.raises(BenchtrainError, match="--quantize must be one of none, 8bit, 4bit"):
        check_quantize("3bit", is_lora=True)
    check_quantize("none", is_lora=False)
    check_quantize("8bit", is_lora=True)

    import importlib.metadata

    real_version = importlib.metadata.version

    def without_bitsandbytes(name: str) -> str:
        if name == "bitsandbytes":
            raise importlib.metadata.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(importlib.metadata, "version", without_bitsandbytes)
    with pytest.raises(BenchtrainError, match=r"needs bitsandbytes, which is not installed: pip install 'bitsandbytes>=0.48'"):
        check_quantize("4bit", is_lora=True)
