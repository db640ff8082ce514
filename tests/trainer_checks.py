"""A user's own Trainer on CPU, for tests/test_trainer_callback.py: a two-layer llama built from a
config, the byte tokenizer, a real padding collator, and a clock the test drives.

Run as a script under `accelerate launch --num_processes 2` (gloo) it trains with
DeadlineCallback on each rank, each rank's steps taking another time on its own clock, and writes
what each rank saw to OUT/rank-N.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import (
    DataCollatorForLanguageModeling,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from benchtrain.train.workload.tokenizer import byte_tokenizer

START = 1_800_000_000.0  # the fake clock's start (epoch seconds: 2027-01-15)


class FakeClock:
    """Seconds since the epoch that move only when the test says."""

    def __init__(self, now: float = START) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Pace(TrainerCallback):
    """Listed before DeadlineCallback: each optimizer step, save and evaluation takes the given
    seconds on the fake clock (the Trainer calls callbacks in order, so the deadline callback
    measures exactly these)."""

    def __init__(self, clock: FakeClock, step: float, save: float = 0.0, evaluation: float = 0.0) -> None:
        self.clock, self.step, self.save, self.evaluation = clock, step, save, evaluation

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.clock.now += self.step

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.clock.now += self.save

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.clock.now += self.evaluation


def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    tokenizer = byte_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def texts(count: int = 64) -> list[str]:
    """Texts of different lengths, so that the collator pads."""
    return [("benchtrain measures the step " * (1 + index % 5))[: 20 + (index * 7) % 60] for index in range(count)]


def dataset(count: int = 64) -> Any:
    from datasets import Dataset

    tokenizer = byte_tokenizer()
    return Dataset.from_dict({"text": texts(count)}).map(lambda row: tokenizer(row["text"]), remove_columns=["text"])


def arguments(out: Path, **overrides: Any) -> TrainingArguments:
    values: dict[str, Any] = {
        "output_dir": str(out),
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "max_steps": 40,
        "learning_rate": 1e-3,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "seed": 0,
    }
    values.update(overrides)
    return TrainingArguments(**values)


def trainer(out: Path, callbacks: list[Any], eval_count: int = 0, **overrides: Any) -> Trainer:
    tokenizer = byte_tokenizer()
    return Trainer(
        model=tiny_model(),
        args=arguments(out, **overrides),
        train_dataset=dataset(),
        eval_dataset=dataset(eval_count) if eval_count else None,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
        callbacks=callbacks,
    )


class Started(TrainerCallback):
    """Writes OUT/started-R once step 5 has ended, then slows each step a little (real time), so that
    a test has time to signal the processes mid-run."""

    def __init__(self, out: Path, rank: int) -> None:
        self.out, self.rank = out, rank

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == 5:
            (self.out / f"started-{self.rank}").write_text("5")
        if state.global_step >= 5:
            time.sleep(0.2)


def main(out: Path, signalled: bool) -> None:
    """Under accelerate launch: rank r's steps take 10 + 3r seconds on its own clock (`signalled`:
    a long deadline, and the test's signal stops the run)."""
    from benchtrain import DeadlineCallback

    rank = int(os.environ.get("RANK", "0"))
    clock = FakeClock()
    callback = DeadlineCallback(deadline="10h" if signalled else "400s", clock=clock, report=False)
    callbacks = [Pace(clock, step=10.0 + 3.0 * rank, save=5.0), callback, *([Started(out, rank)] if signalled else [])]
    run = trainer(out, callbacks, max_steps=60, per_device_train_batch_size=2, gradient_accumulation_steps=1)
    run.train()
    outcome = {
        "global_step": run.state.global_step,
        "status": callback.status,
        "elapsed": clock.now - START,
        "exit_signal": callback.exit_signal,
    }
    (out / f"rank-{rank}.json").write_text(json.dumps(outcome))


if __name__ == "__main__":
    main(Path(sys.argv[1]), signalled=sys.argv[2:] == ["signalled"])
