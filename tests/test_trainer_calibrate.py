"""`benchtrain.calibrate(trainer)` on CPU with the real libraries: a user's plain Trainer, a TRL SFTTrainer and a peft
LoRA model (two-layer llamas from a config, the byte tokenizer, their own collators) measured within a small budget,
stored as their Trainer's step, readable by `bench show`, `train` and DeadlineCallback; the Trainer left exactly as
found; bad input in one line; two processes under accelerate launch store one calibration."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import free_port
from trainer_checks import texts, tiny_model, trainer

from benchtrain import BenchtrainError, DeadlineCallback, calibrate
from benchtrain.bench.cli import show_command
from benchtrain.calibration.model import Calibration
from benchtrain.reports.calibration_report import write_calibration_report
from benchtrain.reports.html import escape

ROOT = Path(__file__).resolve().parents[1]
BUDGET = "20s"


def snapshot(run: Any) -> dict[str, Any]:
    """What calibrate must leave as it was."""
    out = Path(run.args.output_dir)
    return {
        "weights": {name: tensor.clone() for name, tensor in run.model.state_dict().items()},
        "args": run.args.to_dict(),
        "files": sorted(path.name for path in out.rglob("*")) if out.exists() else None,
        "rng": (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state().clone()),
        "training": [module.training for module in run.model.modules()],
        "checkpointing": run.model.is_activation_checkpointing
        if hasattr(run.model, "is_activation_checkpointing")
        else None,
    }


def assert_as_found(run: Any, before: dict[str, Any]) -> None:
    weights = run.model.state_dict()
    assert weights.keys() == before["weights"].keys()
    assert all(torch.equal(weights[name], before["weights"][name]) for name in weights)
    assert all(parameter.grad is None for parameter in run.model.parameters())
    assert run.state.global_step == 0 and run.state.log_history == []
    assert run.optimizer is None and run.lr_scheduler is None
    assert run.args.to_dict() == before["args"]
    out = Path(run.args.output_dir)
    assert (sorted(path.name for path in out.rglob("*")) if out.exists() else None) == before["files"]
    python, numpy_state, torch_state = before["rng"]
    assert random.getstate() == python
    assert np.array_equal(np.random.get_state()[1], numpy_state)
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert [module.training for module in run.model.modules()] == before["training"]
    if before["checkpointing"] is not None:
        assert run.model.is_activation_checkpointing == before["checkpointing"]


def assert_stored(calibration: Calibration, home: Path, class_name: str, capsys: pytest.CaptureFixture[str]) -> None:
    rows = calibration.data["measurements"]
    ok = [row for row in rows if row["status"] == "ok"]
    assert len(ok) >= 3 and calibration.data["fit"] is not None
    # both checkpointing modes measured: the planner's minimum
    assert {row["gradient_checkpointing"] for row in ok} == {0, 1}
    assert calibration.training.trainer is not None and calibration.training.trainer.class_name == class_name
    stored = list((home / "calibrations").glob("*.json"))
    assert [path.stem for path in stored] == [calibration.id]
    capsys.readouterr()
    assert show_command(calibration.id, False) == 0
    shown = capsys.readouterr().out
    assert f"a {class_name}'s own step" in shown and "fit:" in shown
    # The calibration report says whose step it measured, as `bench show` does.
    page = write_calibration_report(stored[0], home / "report").read_text()
    assert f"a {escape(class_name)}&#x27;s own step" in page or f"a {class_name}'s own step" in page


def test_a_plain_trainer_is_calibrated_and_left_as_found(
    tmp_path: Path, home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = trainer(tmp_path / "out", [])
    before = snapshot(run)
    calibration = calibrate(run, budget=BUDGET, quiet=True)
    assert_as_found(run, before)
    assert_stored(calibration, home, "Trainer", capsys)
    assert calibration.training.trainer is not None
    assert calibration.training.trainer.loss == "the model's own"
    assert calibration.training.trainer.collator == "DataCollatorForLanguageModeling"
    assert calibration.training.method == "full" and calibration.training.precision == "fp32"
    # DeadlineCallback plans from it: same model, method, precision and device (refused in one line otherwise).
    guarded = trainer(tmp_path / "again", [DeadlineCallback(deadline="1h", calibration=calibration.id, report=False)])
    assert guarded.state.global_step == 0
    # The Trainer trains afterwards exactly as before: two steps from the same seed give the same loss as a fresh one.
    run.args.max_steps = 2
    fresh = trainer(tmp_path / "fresh", [], max_steps=2)
    assert run.train().training_loss == fresh.train().training_loss


def test_an_sft_trainer_is_calibrated_at_its_max_length(
    tmp_path: Path, home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from benchtrain.train.workload.tokenizer import byte_tokenizer

    config = trl.SFTConfig(
        output_dir=str(tmp_path / "sft"),
        max_length=48,
        per_device_train_batch_size=2,
        max_steps=5,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
    )
    sft = trl.SFTTrainer(
        model=tiny_model(),
        args=config,
        train_dataset=Dataset.from_dict({"text": texts(64)}),
        processing_class=byte_tokenizer(),
    )
    before = snapshot(sft)
    metrics = json.dumps({mode: dict(values) for mode, values in sft._metrics.items()})
    calibration = calibrate(sft, budget=BUDGET, quiet=True)
    assert_as_found(sft, before)
    # SFTTrainer's compute_loss gathers metrics for its next log line: none of the probes' reaches it
    assert json.dumps({mode: dict(values) for mode, values in sft._metrics.items()}) == metrics
    assert_stored(calibration, home, "SFTTrainer", capsys)
    assert calibration.training.trainer is not None
    assert calibration.training.trainer.loss == "SFTTrainer.compute_loss"
    # the lengths probed stop where SFTConfig.max_length truncates
    assert max(calibration.data["search"]["space"]["seq_lens"]) == 48


def test_a_lora_model_is_calibrated_and_its_adapters_left_as_found(
    tmp_path: Path, home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from peft import LoraConfig, get_peft_model

    plain = trainer(tmp_path / "out", [])
    model = get_peft_model(tiny_model(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    run = type(plain)(
        model=model, args=plain.args, train_dataset=plain.train_dataset, data_collator=plain.data_collator
    )
    before = snapshot(run)
    adapters = {name: tensor.clone() for name, tensor in model.named_parameters() if "lora_" in name}
    calibration = calibrate(run, budget=BUDGET, quiet=True)
    assert_as_found(run, before)
    assert adapters and all(torch.equal(dict(model.named_parameters())[name], adapters[name]) for name in adapters)
    assert_stored(calibration, home, "Trainer", capsys)
    assert calibration.training.method == "lora" and calibration.training.lora_rank == 4


def test_a_trainer_without_a_train_dataset_is_one_line(tmp_path: Path, home: Path) -> None:
    from transformers import Trainer

    run = Trainer(model=tiny_model(), args=trainer(tmp_path / "out", []).args)
    with pytest.raises(BenchtrainError, match="no train_dataset") as raised:
        calibrate(run, budget=BUDGET, quiet=True)
    assert "\n" not in str(raised.value)
    assert not (home / "calibrations").exists() or not list((home / "calibrations").glob("*.json"))


def test_an_iterable_dataset_of_unknown_length_is_one_line(tmp_path: Path, home: Path) -> None:
    run = trainer(tmp_path / "out", [])
    run.train_dataset = run.train_dataset.to_iterable_dataset()
    with pytest.raises(BenchtrainError, match="has no length") as raised:
        calibrate(run, budget=BUDGET, quiet=True)
    assert "\n" not in str(raised.value)


def test_a_budget_too_small_for_three_configurations_is_refused_before_any_probe(tmp_path: Path, home: Path) -> None:
    run = trainer(tmp_path / "out", [])
    before = snapshot(run)
    with pytest.raises(BenchtrainError, match=r"cannot pay for 3 configurations.*budget=") as raised:
        calibrate(run, budget="0.2s", quiet=True)
    assert "\n" not in str(raised.value)
    assert not list((home / "calibrations").glob("**/*.json")) if (home / "calibrations").exists() else True
    assert_as_found(run, before)
    with pytest.raises(BenchtrainError, match="not a duration"):
        calibrate(run, budget="soon", quiet=True)


def test_train_refuses_to_plan_its_own_step_with_a_trainer_calibration(
    tmp_path: Path, home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchtrain.calibration.store import save_calibration
    from benchtrain.train.cli import main

    data = json.loads((ROOT / "tests" / "fixtures" / "cpu-tiny-fullgrid.json").read_text())
    data["training"] = {
        **(data.get("training") or {}),
        "trainer": {
            "class": "SFTTrainer",
            "loss": "SFTTrainer.compute_loss",
            "collator": "DataCollatorForLanguageModeling",
        },
    }
    save_calibration(data)
    texts_file = tmp_path / "data.jsonl"
    texts_file.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts(16)))
    arguments = [
        "--dry-run",
        "--use-calibration",
        data["id"],
        "--model",
        "tiny",
        "--data",
        str(texts_file),
        "--deadline",
        "1h",
    ]
    with pytest.raises(BenchtrainError, match=r"SFTTrainer's own step.*benchtrain\.fit_to_deadline") as raised:
        main(arguments)
    assert "\n" not in str(raised.value)
    capsys.readouterr()
    # its plan as that Trainer's arguments is what it is for
    assert main([*arguments, "--for-trainer"]) == 0
    assert "per_device_train_batch_size=" in capsys.readouterr().out


TWO_RANKS = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from trainer_checks import trainer
import torch.distributed as dist
from benchtrain import calibrate
run = trainer(Path(sys.argv[1]) / "out", [])
before = {name: tensor.clone() for name, tensor in run.model.state_dict().items()}
calibration = calibrate(run, budget="25s", quiet=True)
same = all((before[name] == tensor).all().item() for name, tensor in run.model.state_dict().items())
rank = dist.get_rank()
Path(sys.argv[1], f"rank-{rank}.json").write_text(json.dumps({"id": calibration.id, "same": same, "step": run.state.global_step}))
"""


def test_two_processes_measure_together_and_store_one_calibration(tmp_path: Path, home: Path) -> None:
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        # A port of its own: accelerate's default (29500) is another multi-process test's under xdist.
        "--main_process_port",
        str(free_port()),
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(script),
        str(tmp_path),
        str(ROOT / "tests"),
    ]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    outcomes = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(2)]
    stored = list((home / "calibrations").glob("*.json"))
    assert len(stored) == 1
    assert [outcome["id"] for outcome in outcomes] == [stored[0].stem] * 2
    assert all(outcome["same"] and outcome["step"] == 0 for outcome in outcomes)
    data = json.loads(stored[0].read_text())
    assert data["distributed"]["world_size"] == 2 and data["training"]["trainer"]["class"] == "Trainer"
