"""LoRA (peft) and gradient checkpointing: what is trained, what is measured, what is refused (issue 10)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from helpers import TINY_GRID, assert_one_line_error, lora_calibration, make_run, run_main

from benchtrain.calibration.hardware import Hardware
from benchtrain.calibration.model import Calibration
from benchtrain.calibration.schema import read_calibration_file
from benchtrain.calibration.step_config import StepConfig
from benchtrain.calibration.store import save_calibration
from benchtrain.common.errors import BenchtrainError
from benchtrain.train.planning.memory_check import check_fits, memory_need
from benchtrain.train.running.checkpoint import WEIGHTS_FILE, list_checkpoints
from benchtrain.train.workload.method import MethodConfig, set_gradient_checkpointing, trainable_parameter_count
from benchtrain.train.workload.model import build_model, model_shape, resolve_model

LORA = MethodConfig(method="lora", lora_rank=4)
FIXTURES = Path(__file__).parent / "fixtures"


def batch(seed: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def test_only_the_adapters_are_trained_and_the_base_stays_bit_identical(
    tmp_path: Path, heavy_tailed_jsonl: Path, tokenizer
) -> None:
    run = make_run(tmp_path, heavy_tailed_jsonl, tokenizer, deadline=1e6, steps=4, method=LORA)
    base = build_model(resolve_model("tiny"), "cpu")  # what the preset's frozen weights are
    outcome = run.run()
    assert outcome.position.step == 4
    model = run.engine.model
    trained = dict(model.named_parameters())
    adapters = {name: p for name, p in trained.items() if p.requires_grad}
    assert adapters and all("lora_" in name for name in adapters)
    assert trainable_parameter_count(model) == sum(p.numel() for p in adapters.values())
    assert trainable_parameter_count(model) < 0.1 * sum(p.numel() for p in trained.values())
    for name, original in base.named_parameters():
        peft_name = next(
            n for n in trained if n.endswith(name.replace(".weight", ".base_layer.weight")) or n.endswith(name)
        )
        assert torch.equal(trained[peft_name].detach(), original.detach()), name
    # lora_B starts at zero: training moved it.
    assert any(p.detach().abs().sum() > 0 for n, p in adapters.items() if "lora_B" in n)
    # The checkpoint keeps only the adapters.
    from safetensors import safe_open

    with safe_open(list_checkpoints(tmp_path / "run" / "checkpoints")[-1] / WEIGHTS_FILE, "pt") as handle:
        assert list(handle.keys()) and all("lora_" in key for key in handle.keys())


@pytest.mark.parametrize("method", [MethodConfig(), LORA], ids=["full", "lora"])
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(method: MethodConfig) -> None:
    model = build_model(resolve_model("tiny"), "cpu", method)
    model.train()
    results = []
    for enabled in (False, True):
        set_gradient_checkpointing(model, enabled)
        model.zero_grad(set_to_none=True)
        loss = model(**batch()).loss
        loss.backward()
        results.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
    (loss_off, grads_off), (loss_on, grads_on) = results
    assert loss_on == pytest.approx(loss_off, abs=1e-5)
    for name, grad in grads_off.items():
        assert torch.allclose(grads_on[name], grad, atol=1e-5), name


def test_checkpointing_on_then_off_leaves_no_input_gradient_hook() -> None:
    """Bench switches checkpointing on and off on one LoRA model: transformers' input-gradient hook
    (made for reentrant checkpointing) must not stay behind or pile up, so every later step
    computes what a fresh model computes; checkpointed LoRA still trains its adapters."""
    model = build_model(resolve_model("tiny"), "cpu", LORA)
    model.train()
    embeddings = model.get_input_embeddings()
    for enabled in (True, False, True, True, False):
        set_gradient_checkpointing(model, enabled)
        assert not embeddings._forward_hooks, enabled
        assert not embeddings(batch()["input_ids"]).requires_grad  # the frozen base's embeddings
        if enabled:
            model.zero_grad(set_to_none=True)
            model(**batch()).loss.backward()
            assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_a_lora_run_resumes_on_the_uninterrupted_loss_curve(
    tmp_path: Path, heavy_tailed_jsonl: Path, tokenizer
) -> None:
    full = make_run(tmp_path, heavy_tailed_jsonl, tokenizer, deadline=1e6, steps=8, out="whole", method=LORA).run()

    def sigterm_at_step_3(step: int) -> None:
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    stopped = make_run(
        tmp_path, heavy_tailed_jsonl, tokenizer, deadline=1e6, steps=8, out="split", method=LORA, hook=sigterm_at_step_3
    ).run()
    assert stopped.status == "interrupted" and stopped.position.step == 4
    resumed = make_run(
        tmp_path, heavy_tailed_jsonl, tokenizer, deadline=1e6, steps=8, out="split", method=LORA, resume=True
    ).run()
    assert resumed.position.step == 8
    assert [entry["loss"] for entry in resumed.position.losses] == [entry["loss"] for entry in full.position.losses]


def test_flops_count_a_frozen_base_and_recompute() -> None:
    shape = model_shape(build_model(resolve_model("tiny"), "cpu", LORA))
    n, a = shape.matmul_parameter_count, shape.adapter_parameter_count
    attention = 4 * shape.layers * shape.heads * shape.head_dim * 128
    assert a > 0 and n == model_shape(build_model(resolve_model("tiny"), "cpu")).matmul_parameter_count
    assert shape.flops_per_token(128) == 6 * n + 3 * attention
    assert shape.flops_per_token(128, lora=True) == 4 * n + 6 * a + 3 * attention
    assert shape.flops_per_token(128, lora=True, switches=("gradient_checkpointing",)) == 6 * n + 8 * a + 4 * attention


def test_presets_of_the_real_shapes() -> None:
    lora = memory_need(resolve_model("mistral-nemo-12b"), MethodConfig(method="lora"), "cpu")
    assert (
        12.2e9 < lora.total_parameters - lora.trainable_parameters < 12.3e9 and 50e6 < lora.trainable_parameters < 60e6
    )
    assert 8.0e9 < memory_need(resolve_model("llama-3.1-8b"), MethodConfig(), "cpu").total_parameters < 8.1e9


def test_a_model_too_big_for_the_device_is_one_line_in_seconds() -> None:
    h100 = Hardware.from_record({"device_type": "cuda", "name": "NVIDIA H100 80GB HBM3", "memory_bytes": 79 * 2**30})
    with pytest.raises(
        BenchtrainError,
        match=r"full fine-tuning of mistral-nemo-12b needs ≈18\d GiB .* has 79 GiB: use --lora \(≈2\d GiB",
    ):
        check_fits(resolve_model("mistral-nemo-12b"), MethodConfig(), h100)
    need = check_fits(resolve_model("mistral-nemo-12b"), MethodConfig(method="lora"), h100)
    assert need.total_bytes < 30 * 2**30  # bf16 base + fp32 adapters, gradients and moments


def test_bench_refuses_a_model_that_cannot_fit(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main("bench", ["run", "--model", "mistral-nemo-12b", "--quiet"], capsys)
    assert_one_line_error(code, err, "full fine-tuning of mistral-nemo-12b needs")
    assert not (home / "calibrations").exists() or not list((home / "calibrations").glob("*.json"))


@pytest.mark.slow
def test_bench_and_train_with_lora_and_checkpointing(
    home: Path, heavy_tailed_jsonl: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_main(
        "bench",
        ["run", "--gpu", "cpu", "--lora", "--lora-rank", "8", "--checkpointing", "off,on", *TINY_GRID, "--no-report"],
        capsys,
    )
    assert code == 0, err
    assert "trainable" in err and "LoRA rank 8" in err
    data = json.loads(next((home / "calibrations").glob("*.json")).read_text())
    assert data["training"]["method"] == "lora" and data["training"]["lora"]["rank"] == 8
    assert data["training"]["lora"]["targets"] == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]
    assert 0 < data["training"]["trainable_parameters"] < data["model"]["parameter_count"]
    assert {row["gradient_checkpointing"] for row in data["measurements"]} == {0, 1}
    assert data["search"]["space"]["checkpointing"] == [0, 1]
    assert "recompute_per_token" in data["fit"]["parameters"]

    code, out, err = run_main(
        "train",
        [
            "--data",
            str(heavy_tailed_jsonl),
            "--deadline",
            "30m",
            "--effective-batch",
            "4",
            "--lora",
            "--lora-rank",
            "8",
            "--max-steps",
            "3",
        ],
        capsys,
    )
    assert code == 0, err
    assert "training LoRA rank 8" in out and "memory before activations" in out
    record = json.loads(next((home / "runs").glob("*/run.json")).read_text())
    assert record["plan"]["method"] == "lora" and record["plan"]["lora"]["rank"] == 8
    assert record["plan"]["lora"]["trainable_parameters"] == data["training"]["trainable_parameters"]
    assert record["plan"]["configuration"]["gradient_checkpointing"] in (0, 1)

    dry_run = [
        "--data",
        "sample",
        "--deadline",
        "30m",
        "--lora",
        "--lora-rank",
        "8",
        "--gradient-checkpointing",
        "on",
        "--dry-run",
        "--max-steps",
        "3",
    ]
    code, out, err = run_main("train", [*dry_run, "--merge-lora"], capsys)
    assert code == 0, err
    assert "gradient checkpointing" in out.split("plan (")[1].splitlines()[0]
    # The export's bytes are planned: the adapters, the base beside them in final/ and final-merged/ (fp32 on CPU).
    need = memory_need(resolve_model("tiny"), MethodConfig(method="lora", lora_rank=8), "cpu")
    exported = 4 * need.trainable_parameters + 2 * 4 * (need.total_parameters - need.trainable_parameters)
    assert "final/ export" in out and f"({exported / 1e6:,.1f} MB)" in out


def test_a_calibration_of_another_method_is_refused(calibrated_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main("train", ["--data", "sample", "--deadline", "30m", "--lora", "--dry-run"], capsys)
    assert_one_line_error(
        code, err, "measured full fine-tuning, not LoRA: run `bench run --lora` here, or pass --force"
    )
    code, _, err = run_main(
        "train", ["--data", "sample", "--deadline", "30m", "--lora", "--dry-run", "--force"], capsys
    )
    assert code == 0 and "warning: calibration" in err

    lora = lora_calibration(rank=16, created_at="2027-01-01T00:00:00+00:00")
    save_calibration(lora)
    code, _, err = run_main("train", ["--data", "sample", "--deadline", "30m", "--dry-run"], capsys)
    # latest: the full one, and the difference that decided it said in words.
    assert code == 0 and "the newer test-lora measured LoRA r16" in err and "(this run: full fine-tuning)" in err, err
    code, _, err = run_main(
        "train", ["--data", "sample", "--deadline", "30m", "--dry-run", "--use-calibration", "test-lora"], capsys
    )
    assert_one_line_error(code, err, "measured LoRA, not full fine-tuning")
    code, _, err = run_main(
        "train",
        ["--data", "sample", "--deadline", "30m", "--gradient-checkpointing", "on", "--dry-run", "--lora"],
        capsys,
    )
    assert_one_line_error(code, err, "did not measure it")


def test_the_h100_calibration_plans_full_fine_tuning_without_checkpointing() -> None:
    calibration = Calibration(read_calibration_file(FIXTURES / "h100-llama-3.2-1b-fullgrid.json"))
    assert calibration.training.method == "full"
    assert calibration.measured_values("gradient_checkpointing") == [0]
    assert calibration.predict(StepConfig(8, 0, 1, 1024)).tokens_per_second > 10_000


def test_lora_on_a_model_folder_with_real_bf16_weights(tmp_path: Path) -> None:
    from benchtrain.train.workload.tokenizer import byte_tokenizer

    folder = tmp_path / "my-model"
    saved = build_model(resolve_model("tiny"), "cpu").to(torch.bfloat16)
    saved.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    spec = resolve_model(str(folder))
    assert spec.has_weights
    model = build_model(spec, "cpu", LORA)
    base = dict(model.get_base_model().named_parameters())
    original = dict(saved.named_parameters())
    embed = "model.embed_tokens.weight"
    assert torch.equal(base[embed].to(torch.bfloat16), original[embed])  # the folder's weights, not a fresh init
    loss = model(**batch()).loss
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert not any(p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
