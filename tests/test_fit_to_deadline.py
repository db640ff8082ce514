"""benchtrain.fit_to_deadline on a user's own Trainer and TRL SFTTrainer, on CPU with the real libraries: the
built-in `tiny` llama built from its config, the byte tokenizer, and the CPU calibration fixture of that model
(copied to tmp_path and marked as measured on this machine, so no run writes into tests/fixtures)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from trainer_checks import arguments, dataset, texts
from transformers import DataCollatorForLanguageModeling, LlamaConfig, LlamaForCausalLM, Trainer

import benchtrain
from benchtrain import BenchtrainError, DeadlineCallback
from benchtrain.calibration.model import Calibration
from benchtrain.calibration.run_file import COMPLETED
from benchtrain.train.step.hardware import detect_hardware
from benchtrain.train.workload.model import resolve_model
from benchtrain.train.workload.tokenizer import byte_tokenizer

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "cpu-tiny-fullgrid.json"


@pytest.fixture()
def calibration_path(tmp_path: Path) -> Path:
    """The tiny model's CPU calibration, as if measured on this machine (a device another calibration names is refused)."""
    data = json.loads(FIXTURE.read_text())
    data["hardware"] = {**data["hardware"], **detect_hardware()}
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(data))
    return path


def tiny_llama() -> LlamaForCausalLM:
    import torch

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**resolve_model("tiny").config_dict))


def tiny_trainer(out: Path, eval_count: int = 0, callbacks: list[Any] | None = None, **overrides: Any) -> Trainer:
    values: dict[str, Any] = {"max_steps": -1, "num_train_epochs": 1, **overrides}
    return Trainer(
        model=tiny_llama(),
        args=arguments(out, **values),
        train_dataset=dataset(64),
        eval_dataset=dataset(eval_count) if eval_count else None,
        data_collator=DataCollatorForLanguageModeling(byte_tokenizer(), mlm=False),
        callbacks=callbacks,
    )


def deadline_callbacks(trainer: Trainer) -> list[DeadlineCallback]:
    return [callback for callback in trainer.callback_handler.callbacks if isinstance(callback, DeadlineCallback)]


def test_it_sets_the_plan_on_the_arguments_holding_the_effective_batch(
    tmp_path: Path, home: Path, calibration_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trainer = tiny_trainer(
        tmp_path / "out",
        eval_count=16,
        callbacks=[DeadlineCallback(deadline="1h", report=False)],
        per_device_train_batch_size=1,
        gradient_accumulation_steps=8,
        eval_strategy="steps",
        eval_steps=3,
        save_strategy="steps",
        save_steps=4,
    )
    plan = benchtrain.fit_to_deadline(trainer, "10m", str(calibration_path))
    args, chosen = trainer.args, plan.plan.chosen
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.dataloader_num_workers) == (
        chosen.config.micro_batch_size,
        chosen.config.grad_accum,
        chosen.config.num_workers,
    )
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 8  # the effective batch held
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) != (1, 8)  # a faster one was chosen
    assert trainer._train_batch_size == args.per_device_train_batch_size  # the Trainer's own copy follows
    assert args.activation_checkpointing is False and args.gradient_checkpointing is False
    assert args.per_device_eval_batch_size == plan.arguments["per_device_eval_batch_size"] >= 1
    assert args.max_steps == -1  # on_overrun="stop" leaves the run's length alone
    # Their cadence is counted: 8 optimizer steps, an evaluation every 3 (and the last), a save every 4 (and the last).
    overheads = chosen.overheads
    assert chosen.optimizer_steps == 8 and overheads.eval_count == 3 and overheads.checkpoint_count == 3
    assert overheads.model_build_seconds == 0.0  # the Trainer's model is built before the deadline's clock starts
    assert plan.plan.meets_deadline and chosen.total_seconds_promised <= plan.plan.available_seconds
    # One DeadlineCallback, the plan's (the one given at Trainer(...) replaced), holding the calibration.
    (callback,) = deadline_callbacks(trainer)
    assert callback.calibration is not None and callback.calibration.id == plan.calibration_id
    assert callback.on_overrun == "stop" and callback.deadline_text.text == "10m"
    text = plan.to_json()
    assert json.loads(json.dumps(text)) == text
    assert text["training_arguments"] == dict(plan.arguments) and text["plan"]["effective_batch"] == 8
    printed = capsys.readouterr()
    assert "plan (balanced): batch" in printed.out and "upper bound fits" in printed.out
    assert "set on trainer.args: per_device_train_batch_size=" in printed.out
    # A calibration of our own step: accepted, with how this Trainer's step differs.
    assert "measured benchtrain's own step, not this Trainer's" in printed.err and "compile:" in printed.err


def test_random_batches_are_priced_with_their_padding(tmp_path: Path, home: Path, calibration_path: Path) -> None:
    """A Trainer's sampler batches random samples (ours group by length): more positions computed for the same tokens."""
    random = benchtrain.fit_to_deadline(tiny_trainer(tmp_path / "a"), "10m", str(calibration_path), quiet=True)
    grouped = benchtrain.fit_to_deadline(
        tiny_trainer(tmp_path / "b", train_sampling_strategy="group_by_length"),
        "10m",
        str(calibration_path),
        quiet=True,
    )
    assert random.plan.chosen.tokens == grouped.plan.chosen.tokens
    assert random.plan.chosen.padded_tokens > grouped.plan.chosen.padded_tokens


def test_nothing_fits_is_one_line_and_changes_nothing(tmp_path: Path, home: Path, calibration_path: Path) -> None:
    trainer = tiny_trainer(tmp_path / "out", num_train_epochs=400)
    before = trainer.args.to_dict()
    callbacks = list(trainer.callback_handler.callbacks)
    with pytest.raises(BenchtrainError) as refused:
        benchtrain.fit_to_deadline(trainer, "20s", str(calibration_path))
    message = str(refused.value)
    assert "\n" not in message
    assert "num_train_epochs=" in message and "max_steps=" in message and "a later deadline" in message
    assert trainer.args.to_dict() == before and trainer.callback_handler.callbacks == callbacks
    # The epochs it names fit.
    epochs = float(message.split("num_train_epochs=")[1].split(",")[0])
    trainer.args.num_train_epochs = epochs
    assert benchtrain.fit_to_deadline(trainer, "20s", str(calibration_path), quiet=True).plan.meets_deadline


def test_fit_cuts_max_steps_to_the_steps_that_fit(tmp_path: Path, home: Path, calibration_path: Path) -> None:
    trainer = tiny_trainer(tmp_path / "out", num_train_epochs=400)
    plan = benchtrain.fit_to_deadline(trainer, "20s", str(calibration_path), on_overrun="fit", quiet=True)
    assert plan.plan.step_limit is not None and 0 < plan.plan.step_limit < 400 * 8  # 8 steps an epoch
    assert trainer.args.max_steps == plan.plan.step_limit == plan.arguments["max_steps"]
    (callback,) = deadline_callbacks(trainer)
    assert callback.on_overrun == "fit"


def test_a_calibration_is_found_by_id_and_latest_and_another_device_is_refused(
    tmp_path: Path, home: Path, calibration_path: Path
) -> None:
    data = json.loads(calibration_path.read_text())
    (home / "calibrations").mkdir(parents=True)
    (home / "calibrations" / f"{data['id']}.json").write_text(json.dumps(data))
    for reference in (data["id"], "latest", Calibration(data, calibration_path)):
        trainer = tiny_trainer(tmp_path / "out")
        assert benchtrain.fit_to_deadline(trainer, "10m", reference, quiet=True).calibration_id == data["id"]
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({**data, "hardware": {**data["hardware"], "name": "AMD EPYC 9999"}}))
    trainer = tiny_trainer(tmp_path / "out")
    before = trainer.args.to_dict()
    with pytest.raises(BenchtrainError, match="measured on AMD EPYC 9999") as refused:
        benchtrain.fit_to_deadline(trainer, "10m", str(foreign))
    assert "\n" not in str(refused.value) and trainer.args.to_dict() == before


def test_without_a_calibration_it_measures_the_trainer_then_plans_and_the_run_meets_its_deadline(
    tmp_path: Path, home: Path
) -> None:
    """The three lines end to end: calibration=None measures this Trainer's own step (benchtrain.calibrate, for real),
    the plan is set from it, and the guarded run ends before its deadline."""
    out = tmp_path / "out"
    trainer = tiny_trainer(out, per_device_train_batch_size=2, gradient_accumulation_steps=2, num_train_epochs=0.25)
    files_before = sorted(out.rglob("*")) if out.exists() else []
    plan = benchtrain.fit_to_deadline(trainer, "10m", budget="40s", quiet=True)
    stored = sorted((home / "calibrations").glob("*.json"))
    assert [path.stem for path in stored] == [plan.calibration_id]
    measured = Calibration(json.loads(stored[0].read_text()), stored[0])
    assert measured.training.trainer is not None and measured.training.trainer.class_name == "Trainer"
    assert plan.differences == ()  # it measured this very Trainer: nothing to say
    # calibrate left it as found: no step kept, nothing written to output_dir
    assert trainer.state.global_step == 0 and (sorted(out.rglob("*")) if out.exists() else []) == files_before
    trainer.train()
    assert trainer.state.global_step == plan.plan.chosen.optimizer_steps
    record = json.loads((out / "benchtrain" / "run.json").read_text())
    assert record["status"] == COMPLETED and record["met_deadline"] is True
    assert record["calibration_id"] == plan.calibration_id


def test_trl_sft_trainer(tmp_path: Path, home: Path, calibration_path: Path) -> None:
    """TRL tokenizes (and truncates at max_length) in its __init__: the plan reads those lengths."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    config = trl.SFTConfig(
        output_dir=str(tmp_path / "sft"),
        max_length=48,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        num_train_epochs=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
    )
    sft = trl.SFTTrainer(
        model=tiny_llama(),
        args=config,
        train_dataset=Dataset.from_dict({"text": texts(64)}),
        processing_class=byte_tokenizer(),
    )
    plan = benchtrain.fit_to_deadline(sft, "10m", str(calibration_path), quiet=True)
    assert plan.plan.chosen.config.seq_len == 48  # their max_length cuts the longer samples
    assert sft.args.per_device_train_batch_size * sft.args.gradient_accumulation_steps == 4
    assert len(deadline_callbacks(sft)) == 1


def test_a_fitted_run_finishes_before_its_deadline(tmp_path: Path, home: Path, calibration_path: Path) -> None:
    out = tmp_path / "out"
    trainer = tiny_trainer(out, per_device_train_batch_size=2, gradient_accumulation_steps=2, num_train_epochs=0.25)
    plan = benchtrain.fit_to_deadline(trainer, "10m", str(calibration_path), quiet=True)
    trainer.train()
    assert trainer.state.global_step == plan.plan.chosen.optimizer_steps == 4
    record = json.loads((out / "benchtrain" / "run.json").read_text())
    assert record["status"] == COMPLETED and record["met_deadline"] is True
    assert record["calibration_id"] == plan.calibration_id
