"""On a CUDA device: bf16 probe with CUDA events, allocator peak memory and MFU from the table."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def test_probe_on_cuda_reports_mfu_and_allocator_peak() -> None:
    from benchtrain.bench.probe import ProbeSettings, Workload, run_probe
    from benchtrain.calibration.step_config import StepConfig
    from benchtrain.train.step.hardware import detect_hardware
    from benchtrain.train.workload.model import resolve_model

    hardware = detect_hardware()
    workload = Workload(resolve_model("gpt2"))
    assert workload.accelerator.mixed_precision == "bf16"
    config = StepConfig(micro_batch_size=4, num_workers=2, grad_accum=1, seq_len=512)
    row = run_probe(workload, config, ProbeSettings.for_device("cuda"), hardware["peak_bf16_flops"])
    assert row["status"] == "ok" and row["tokens_per_second"] > 0
    assert row["peak_memory_bytes"] > 124e6 * 4  # at least the fp32 weights
    if hardware["peak_bf16_flops"]:
        assert 0 < row["mfu"] < 1


def _wide_vocab_llama() -> object:
    from benchtrain.train.workload.model import ModelSpec

    config = {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 512,
        "intermediate_size": 1024,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    }
    return ModelSpec("wide-vocab", config)


@pytest.mark.parametrize("kind", ["liger", "chunked"])
def test_fused_losses_match_the_plain_loss_with_less_memory_on_cuda(kind: str) -> None:
    """Llama-3's 128k vocabulary at 4 × 1024 tokens, bf16 autocast: same loss and gradients as
    transformers' own loss, and a lower allocator peak."""
    import copy

    import torch

    from benchtrain.train.step.loss import install_loss, liger_problem
    from benchtrain.train.workload.model import build_model

    if kind == "liger" and liger_problem() is not None:
        pytest.skip("liger-kernel is not installed (pip install 'benchtrain[gpu]')")
    plain = build_model(_wide_vocab_llama(), "cuda")
    fused = copy.deepcopy(plain)
    install_loss(fused, kind)
    ids = torch.randint(0, 128256, (4, 1024), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    results = {}
    for name, model in (("plain", plain), (kind, fused)):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results[name] = (float(loss), model.lm_head.weight.grad.float().clone(), torch.cuda.max_memory_allocated())
        model.zero_grad(set_to_none=True)
    plain_loss, plain_grad, plain_peak = results["plain"]
    fused_loss, fused_grad, fused_peak = results[kind]
    assert fused_loss == pytest.approx(plain_loss, rel=2e-3)
    assert torch.nn.functional.cosine_similarity(fused_grad.flatten(), plain_grad.flatten(), dim=0) > 0.999
    assert fused_peak < plain_peak - 4 * 1024 * 128256 * 2  # at least one bf16 copy of the logits less


def test_compiled_step_on_cuda_matches_eager() -> None:
    import torch

    from benchtrain.train.step.engine import StepOptions, engine_from_options
    from benchtrain.train.step.runtime import make_accelerator
    from benchtrain.train.workload.batching import SyntheticBatches
    from benchtrain.train.workload.method import MethodConfig
    from benchtrain.train.workload.model import resolve_model

    losses = {}
    for mode in ("off", "on"):
        torch.manual_seed(0)
        engine = engine_from_options(
            resolve_model("tiny"), MethodConfig(), make_accelerator(), StepOptions(compile=mode)
        )
        batch = SyntheticBatches(1, 4, 256, 320)[0]
        losses[mode] = [engine.step.run(iter([batch]), 1).loss for _ in range(3)]
    assert losses["on"] == pytest.approx(losses["off"], rel=2e-2)
