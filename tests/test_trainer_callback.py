"""DeadlineCallback in a user's own transformers Trainer and TRL SFTTrainer, on CPU, with the real
libraries: a two-layer llama from a config, the byte tokenizer, a real padding collator. Time is
the test's: a FakeClock the Pace callback moves by a set amount per step, save and evaluation, so
every decision is exact (no wall-clock bound anywhere)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import free_port
from trainer_checks import START, FakeClock, Pace, tiny_model, trainer
from transformers import TrainerCallback

from benchtrain import BenchtrainError, DeadlineCallback
from benchtrain.calibration.run_file import COMPLETED, INTERRUPTED, STEP_LIMIT, STOPPED_FOR_DEADLINE
from benchtrain.train.step.hardware import detect_hardware
from benchtrain.trainer.estimate import model_setup

ROOT = Path(__file__).resolve().parents[1]


def read_run(out: Path) -> dict[str, Any]:
    return json.loads((out / "benchtrain" / "run.json").read_text())


def checkpoints(out: Path) -> list[str]:
    return sorted(path.name for path in out.glob("checkpoint-*"))


class Logs(TrainerCallback):
    """Listed after DeadlineCallback: the log dicts as the progress bar receives them."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.seen.append(dict(logs or {}))


def test_a_deadline_cuts_the_run_with_a_checkpoint_that_resumes_on_the_same_budget(tmp_path: Path, home: Path) -> None:
    out = tmp_path / "out"
    clock = FakeClock()
    callback = DeadlineCallback(deadline="400s", clock=clock)
    logs = Logs()
    run = trainer(out, [Pace(clock, step=10.0, save=5.0), callback, logs], max_steps=50)
    run.train()
    # 50 steps of 10 s need 500 s: the budget (400 s less the 5% margin) holds 38; one more step
    # (at 1.5× the slowest) and a save must still fit, so the run stops at 37 and saves there.
    assert run.state.global_step == 37
    assert callback.status == STOPPED_FOR_DEADLINE
    assert checkpoints(out) == ["checkpoint-37"]
    assert clock.now - START == 37 * 10.0 + 5.0 < 400.0  # saved before the deadline
    record = read_run(out)
    assert record["status"] == STOPPED_FOR_DEADLINE and record["met_deadline"] is True
    assert record["actual"]["checkpoint_seconds"] == [5.0] and record["actual"]["steps"] == 37
    assert record["estimate"]["basis"] == "measured" and record["estimate"]["step_seconds"] == 10.0
    assert record["estimate_check"]["steps_run"] == 37 and record["estimate_check"]["planned_steps"] == 50
    # The collator padded: fewer real tokens than positions computed.
    assert 0 < record["actual"]["tokens"] < record["actual"]["padded_tokens"]
    assert (out / "benchtrain" / "report.html").is_file()
    # The ETA rides on the Trainer's own log (steps left × 10 s, and the save).
    assert any(
        entry.get("eta_seconds") == pytest.approx(130.0, abs=6) for entry in logs.seen if entry.get("loss") is not None
    )

    # The job comes back an hour later: a duration budget counts training time, so the downtime
    # is not spent, but the 370 s used before the checkpoint are.
    clock.now += 3600
    resumed_callback = DeadlineCallback(deadline="400s", clock=clock)
    resumed = trainer(out, [Pace(clock, step=10.0, save=5.0), resumed_callback], max_steps=50)
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-37"))
    assert resumed_callback.start_step == 37
    # continued, and stopped by the same budget (a fresh one would finish all 50)
    assert 37 < resumed.state.global_step < 50
    assert resumed_callback.status == STOPPED_FOR_DEADLINE
    assert resumed_callback.used_seconds <= 400.0
    record = read_run(out)
    # the earlier steps kept
    assert record["actual"]["start_step"] == 37 and [entry["step"] for entry in record["losses"]][:2] == [
        1,
        2,
    ]

    from benchtrain.reports.cli import main as report_main

    assert report_main([str(out / "benchtrain")]) == 0


def test_the_trainer_may_rebuild_the_callback_on_resume(tmp_path: Path, home: Path) -> None:
    """With restore_callback_states_from_checkpoint=True the Trainer replaces the callback by one it
    builds from state()'s args and attributes: that one continues the same budget."""
    out = tmp_path / "out"
    clock = FakeClock()
    first = DeadlineCallback(deadline="400s", clock=clock, report=False)
    trainer(out, [Pace(clock, step=10.0, save=5.0), first], max_steps=50).train()
    assert checkpoints(out) == ["checkpoint-37"]
    resumed = trainer(
        out,
        [DeadlineCallback(deadline="400s", report=False)],
        max_steps=50,
        restore_callback_states_from_checkpoint=True,
    )
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-37"))
    rebuilt = next(
        callback for callback in resumed.callback_handler.callbacks if isinstance(callback, DeadlineCallback)
    )
    # the 370 s used before the checkpoint, and this run's on top
    assert rebuilt.start_step == 37 and rebuilt.used_seconds >= 370.0
    assert read_run(out)["losses"][0]["step"] == 1  # the same run folder, its earlier steps kept


def test_the_report_renders_the_run(tmp_path: Path, home: Path) -> None:
    """`report RUN_DIR`, the command line, draws the callback's run folder."""
    out = tmp_path / "out"
    clock = FakeClock()
    trainer(
        out,
        [Pace(clock, step=10.0, save=2.0), DeadlineCallback(deadline="2m", clock=clock, report=False)],
        max_steps=30,
    ).train()
    result = subprocess.run(
        [sys.executable, "-m", "benchtrain.reports", str(out / "benchtrain")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    html = (out / "benchtrain" / "report.html").read_text()
    assert "Estimate vs actual" in html and (out / "benchtrain" / "progress.png").is_file()


def test_a_run_that_fits_completes_untouched(tmp_path: Path, home: Path) -> None:
    out = tmp_path / "out"
    clock = FakeClock()
    callback = DeadlineCallback(deadline="1h", clock=clock, report=False)
    run = trainer(out, [Pace(clock, step=10.0), callback], max_steps=12)
    run.train()
    assert run.state.global_step == 12 and callback.status is None
    assert read_run(out)["status"] == COMPLETED and checkpoints(out) == []


def test_fit_cuts_the_run_to_the_steps_that_fit(tmp_path: Path, home: Path) -> None:
    out = tmp_path / "out"
    clock = FakeClock()
    callback = DeadlineCallback(deadline="200s", on_overrun="fit", clock=clock, report=False)
    run = trainer(out, [Pace(clock, step=10.0, save=3.0), callback], max_steps=40)
    run.train()
    assert run.state.global_step < 20 and run.state.max_steps == run.state.global_step
    assert callback.status == STEP_LIMIT and callback.shrunk_to == run.state.global_step
    assert checkpoints(out) == [f"checkpoint-{run.state.global_step}"]
    assert clock.now - START < 200.0
    assert read_run(out)["actual"]["shrunk_to"] == run.state.global_step


class SignalDuringEvaluation(TrainerCallback):
    """Listed before DeadlineCallback: SIGUSR1 arrives in the middle of the evaluation at `step`."""

    def __init__(self, step: int) -> None:
        self.step, self.sent = step, False

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step and not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGUSR1)


def test_sigusr1_during_an_evaluation_saves_as_it_ends(tmp_path: Path, home: Path) -> None:
    out = tmp_path / "out"
    clock = FakeClock()
    callback = DeadlineCallback(deadline="10h", clock=clock, report=False)
    run = trainer(
        out,
        [Pace(clock, step=10.0, save=2.0, evaluation=30.0), SignalDuringEvaluation(step=6), callback],
        eval_count=16,
        max_steps=20,
        eval_strategy="steps",
        eval_steps=3,
        per_device_eval_batch_size=4,
    )
    run.train()
    assert run.state.global_step == 6  # no step after the evaluation the signal came in
    assert checkpoints(out) == ["checkpoint-6"]
    assert callback.status == INTERRUPTED and callback.exit_signal == signal.SIGUSR1
    assert read_run(out)["actual"]["exit_signal"] == signal.SIGUSR1
    # The lead time it tells SLURM covers the evaluation (during which a signal waits) and a save.
    assert callback.lead_seconds() == pytest.approx(30.0 + 2.0)
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # the user's handler back


def test_an_evaluation_that_would_not_fit_is_skipped(tmp_path: Path, home: Path) -> None:
    out = tmp_path / "out"
    clock = FakeClock()
    callback = DeadlineCallback(deadline="300s", clock=clock, report=False)
    run = trainer(
        out,
        [Pace(clock, step=10.0, save=2.0, evaluation=60.0), callback],
        eval_count=8,
        max_steps=50,
        eval_strategy="steps",
        eval_steps=4,
    )
    run.train()
    # Evaluations at steps 4 and 8 fit; at step 12 (240 s) one would end at 300 s, past the 285 s budget.
    assert [event.split(":")[0] for event in callback.events if "skipped the evaluation" in event] == ["step 12"]
    assert len(callback.watch.eval_seconds) == 2
    assert callback.status == STOPPED_FOR_DEADLINE and clock.now - START < 300.0


def matching_calibration(tmp_path: Path, **overrides: Any) -> Path:
    from helpers import synthetic_calibration

    spec, _ = model_setup(tiny_model())
    values: dict[str, Any] = {
        "model": {"name": spec.name, "parameter_count": 1000, "fingerprint": spec.fingerprint},
        "hardware": {**detect_hardware(), "memory_bytes": 64 * 2**30},
        "training": {"method": "full", "lora": None},
    }
    data = synthetic_calibration(**{**values, **overrides})
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(data))
    return path


def test_a_calibration_of_this_model_gives_the_step_time_and_takes_the_run_back(tmp_path: Path, home: Path) -> None:
    out = tmp_path / "out"
    path = matching_calibration(tmp_path)
    clock = FakeClock()
    callback = DeadlineCallback(deadline="1h", calibration=str(path), clock=clock, report=False)
    run = trainer(out, [Pace(clock, step=0.05), callback], max_steps=10)
    run.train()
    record = read_run(out)
    assert record["estimate"]["basis"] == "calibration" and record["calibration_id"] == "test-tiny-20260101-000000"
    assert record["losses"][0]["predicted_seconds"] == pytest.approx(callback.estimate.step_seconds)
    history = json.loads(path.read_text())["history"]
    assert [entry["run_id"] for entry in history] == [record["run_id"]]  # the next plan uses this run's speed


def test_bad_arguments_are_one_line_errors(tmp_path: Path, home: Path) -> None:
    def one_line(error: pytest.ExceptionInfo[BenchtrainError]) -> str:
        text = str(error.value)
        assert "\n" not in text
        return text

    with pytest.raises(BenchtrainError) as past:
        DeadlineCallback(deadline="2020-01-01T00:00")
    assert "in the past" in one_line(past)
    with pytest.raises(BenchtrainError) as unknown:
        DeadlineCallback(deadline="1h", calibration="no-such-calibration")
    assert "no-such-calibration" in one_line(unknown)
    with pytest.raises(BenchtrainError) as overrun:
        DeadlineCallback(deadline="1h", on_overrun="shrink")
    assert "on_overrun" in one_line(overrun)
    with pytest.raises(BenchtrainError) as nonsense:
        DeadlineCallback(deadline="tomorrow")
    assert "duration" in one_line(nonsense)
    other = matching_calibration(
        tmp_path, model={"name": "gpt2", "parameter_count": 10, "fingerprint": "0123456789abcdef"}
    )
    with pytest.raises(BenchtrainError) as another_model:  # at Trainer(...), before any training
        trainer(tmp_path / "out", [DeadlineCallback(deadline="1h", calibration=str(other))])
    assert "measured for model gpt2" in one_line(another_model)
    bf16 = matching_calibration(tmp_path, training={"method": "full", "lora": None, "precision": "bf16"})
    with pytest.raises(BenchtrainError) as another_precision:
        trainer(tmp_path / "out", [DeadlineCallback(deadline="1h", calibration=str(bf16))])
    assert "measured a bf16 step" in one_line(another_precision)


def test_an_absolute_deadline_is_kept_as_a_time(tmp_path: Path, home: Path) -> None:
    from datetime import datetime

    clock = FakeClock()
    at = datetime.fromtimestamp(START + 250)
    callback = DeadlineCallback(deadline=at, clock=clock, report=False)
    run = trainer(tmp_path / "out", [Pace(clock, step=10.0, save=1.0), callback], max_steps=40)
    run.train()
    assert callback.status == STOPPED_FOR_DEADLINE and clock.now < START + 250


def test_trl_sft_trainer(tmp_path: Path, home: Path) -> None:
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    from trainer_checks import texts

    from benchtrain.train.workload.tokenizer import byte_tokenizer

    out = tmp_path / "sft"
    clock = FakeClock()
    callback = DeadlineCallback(deadline="5m", clock=clock)
    config = trl.SFTConfig(
        output_dir=str(out),
        max_length=64,
        per_device_train_batch_size=4,
        max_steps=60,
        logging_steps=5,
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
        callbacks=[Pace(clock, step=10.0, save=4.0), callback],
    )
    sft.train()
    assert callback.status == STOPPED_FOR_DEADLINE and sft.state.global_step < 60
    assert checkpoints(out) == [f"checkpoint-{sft.state.global_step}"] and clock.now - START < 300.0
    record = read_run(out)
    assert 0 < record["actual"]["tokens"] <= record["actual"]["padded_tokens"]
    assert (out / "benchtrain" / "report.html").is_file()


def launch_two_ranks(out: Path, *arguments: str) -> subprocess.Popen[str]:
    # --multi_gpu is accelerate's multi-process launcher (torchrun, in the launcher's own process;
    # its --cpu starts one process unless mpirun is set up): the Trainer's use_cpu=True joins the
    # two processes over gloo.
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
    ]
    command += [
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(ROOT / "tests" / "trainer_checks.py"),
        str(out),
        *arguments,
    ]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=out.parent)


def rank_outcomes(process: subprocess.Popen[str], out: Path) -> list[dict[str, Any]]:
    _, stderr = process.communicate(timeout=280)
    assert process.returncode == 0, stderr[-4000:]
    return [json.loads((out / f"rank-{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.slow
def test_two_ranks_stop_at_the_same_step_with_one_checkpoint(tmp_path: Path, home: Path) -> None:
    """Under accelerate launch (gloo, CPU), rank 1's steps take 13 s on its clock and rank 0's 10 s:
    each alone would stop at another step; together they stop at the same one and save once."""
    out = tmp_path / "ranks"
    out.mkdir()
    ranks = rank_outcomes(launch_two_ranks(out), out)
    assert ranks[0]["global_step"] == ranks[1]["global_step"] < 60
    assert {rank["status"] for rank in ranks} == {STOPPED_FOR_DEADLINE}
    assert checkpoints(out) == [f"checkpoint-{ranks[0]['global_step']}"]
    # The slower rank decided: its own clock stayed inside the deadline.
    assert ranks[1]["elapsed"] < 400.0


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_both_as_the_slurm_recipe_sends_it(tmp_path: Path, home: Path) -> None:
    """docs/trainer.md's recipe forwards SIGUSR1 to the launcher's children, the training processes
    (accelerate runs torchrun in its own process). Here it reaches rank 1 alone: both ranks stop at
    the same step, with one checkpoint, and the launcher lives to exit cleanly."""
    import psutil

    out = tmp_path / "signalled"
    out.mkdir()
    process = launch_two_ranks(out, "signalled")
    while not (out / "started-1").exists() and process.poll() is None:  # rank 1 has passed step 5
        time.sleep(0.1)
    workers = psutil.Process(process.pid).children()
    assert len(workers) == 2  # the launcher's children are the two training processes
    rank_one = next(worker for worker in workers if "RANK" in worker.environ() and worker.environ()["RANK"] == "1")
    rank_one.send_signal(signal.SIGUSR1)
    ranks = rank_outcomes(process, out)
    assert ranks[0]["global_step"] == ranks[1]["global_step"] < 60
    assert [rank["status"] for rank in ranks] == [INTERRUPTED, INTERRUPTED]
    assert [rank["exit_signal"] for rank in ranks] == [signal.SIGUSR1, signal.SIGUSR1]  # rank 0's run.json names it too
    assert checkpoints(out) == [f"checkpoint-{ranks[0]['global_step']}"]


def test_a_dry_run_for_a_trainer_gives_its_arguments(
    tmp_path: Path, home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`train --dry-run --for-trainer --json`: the chosen configuration as TrainingArguments fields,
    which build a real TrainingArguments."""
    from transformers import TrainingArguments

    from benchtrain.train.cli import main as train_main

    data, calibration = (
        ROOT / "benchtrain" / "train" / "sample_data" / "sample.jsonl",
        ROOT / "tests" / "fixtures" / "cpu-tiny-fullgrid.json",
    )
    code = train_main(
        [
            "--use-calibration",
            str(calibration),
            "--data",
            str(data),
            "--deadline",
            "10m",
            "--dry-run",
            "--for-trainer",
            "--json",
        ]
    )
    assert code == 0
    fields = json.loads(capsys.readouterr().out)
    arguments = fields["training_arguments"]
    assert set(arguments) >= {
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "dataloader_num_workers",
        "bf16",
        "max_steps",
    }
    assert fields["sft_config"]["max_length"] > 0 and fields["calibration_id"]
    assert any(line.startswith("compile:") for line in fields["differences"])
    built = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, **arguments)
    assert (
        built.per_device_train_batch_size == arguments["per_device_train_batch_size"]
        and built.max_steps == arguments["max_steps"]
    )
    with pytest.raises(BenchtrainError, match="add --dry-run"):
        train_main(["--data", str(data), "--deadline", "10m", "--for-trainer"])


def test_a_peft_model_is_a_lora_run(tmp_path: Path, home: Path) -> None:
    """A peft model trains LoRA: its run says so, and a calibration of full fine-tuning is refused."""
    from peft import LoraConfig, get_peft_model

    def lora_trainer(callback: DeadlineCallback) -> Any:
        run = trainer(tmp_path / "out", [callback], max_steps=4)
        model = get_peft_model(
            tiny_model(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        )
        return type(run)(
            model=model,
            args=run.args,
            train_dataset=run.train_dataset,
            data_collator=run.data_collator,
            callbacks=[callback],
        )

    clock = FakeClock()
    lora_trainer(DeadlineCallback(deadline="1h", clock=clock, report=False)).train()
    record = read_run(tmp_path / "out")
    assert (
        record["plan"]["method"] == "lora"
        and record["model"]["fingerprint"] == model_setup(tiny_model())[0].fingerprint
    )
    with pytest.raises(BenchtrainError, match="measured full fine-tuning, this Trainer trains lora"):
        lora_trainer(DeadlineCallback(deadline="1h", calibration=str(matching_calibration(tmp_path))))
