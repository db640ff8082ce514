"""calibrate → fit_to_deadline → train, in rounds, on a Trainer the test suite does not use: does the
run land inside the bounds its plan gave?

Each round starts from an empty BENCHTRAIN_HOME: it measures the Trainer's own step
(`benchtrain.calibrate`, `--budget`), plans its arguments to `--deadline` from that measurement and
the data's real lengths (`benchtrain.fit_to_deadline`, holding the effective batch), and trains
with the DeadlineCallback it attached. The table gives the plan's estimate and bounds beside the
time `trainer.train()` took, the whole-run error and whether the run landed inside its bounds.

The Trainer: a 4-layer GPT-2 (hidden 128) built from a config, the byte tokenizer, 1,200 texts
of 40–400 bytes through DataCollatorForLanguageModeling, batch 8 × accumulation 2, one epoch, an
evaluation every 20 steps on 64 held-out texts.

    PYTHONPATH=. python benchmarks/trainer_plan.py --rounds 5

On a machine others share, steps drift between the calibration and the run (the table prints the
load before each round): a bound is a promise about this machine as it was measured.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import DataCollatorForLanguageModeling, GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import benchtrain
from benchtrain.train.workload.tokenizer import byte_tokenizer

WORDS = "the plan measures each step before it promises a finish and the guard saves before the deadline".split()


def texts(count: int, seed: int) -> list[str]:
    """Texts of 40–400 bytes: a spread of lengths, so the collator pads as a real corpus makes it."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        length = rng.randint(40, 400)
        text = ""
        while len(text) < length:
            text += rng.choice(WORDS) + " "
        out.append(text[:length])
    return out


def build_trainer(out: Path, seed: int) -> Trainer:
    tokenizer = byte_tokenizer()
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=len(tokenizer),
            n_embd=128,
            n_layer=4,
            n_head=4,
            n_positions=512,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )

    def tokenized(rows: list[str]) -> Dataset:
        return Dataset.from_dict({"text": rows}).map(
            lambda batch: tokenizer(batch["text"], truncation=True, max_length=512),
            batched=True,
            remove_columns=["text"],
        )

    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        num_train_epochs=1,
        learning_rate=3e-4,
        eval_strategy="steps",
        eval_steps=20,
        save_strategy="no",
        logging_steps=10,
        report_to=[],
        disable_tqdm=True,
        seed=seed,
        use_cpu=not torch.cuda.is_available(),
    )
    return Trainer(
        model=model,
        args=args,
        train_dataset=tokenized(texts(1200, seed)),
        eval_dataset=tokenized(texts(64, seed + 1)),
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )


def one_round(seed: int, budget: str, deadline: str) -> dict[str, Any]:
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as folder:
        os.environ["BENCHTRAIN_HOME"] = str(Path(folder) / "home")
        trainer = build_trainer(Path(folder) / "out", seed)
        started = time.monotonic()
        calibration = benchtrain.calibrate(trainer, budget=budget, quiet=True)
        calibrate_seconds = time.monotonic() - started
        plan = benchtrain.fit_to_deadline(trainer, deadline, calibration, quiet=True)
        chosen = plan.plan.chosen
        started = time.monotonic()
        trainer.train()
        actual = time.monotonic() - started
    probes = sum(row["status"] == "ok" for row in calibration.data["measurements"])
    return {
        "seed": seed,
        "load": load,
        "probes": probes,
        "calibrate_s": calibrate_seconds,
        "config": f"B={chosen.config.micro_batch_size} A={chosen.config.grad_accum} "
        f"W={chosen.config.num_workers} C={int(bool(chosen.config.switches))}",
        "steps": chosen.optimizer_steps,
        "estimate_s": chosen.total_seconds,
        "low_s": chosen.total_seconds_low,
        "high_s": chosen.total_seconds_high,
        "actual_s": actual,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--budget", default="60s", help="calibrate's budget per round")
    parser.add_argument("--deadline", default="30m", help="fit_to_deadline's deadline per round")
    args = parser.parse_args()
    rows = [one_round(seed, args.budget, args.deadline) for seed in range(args.rounds)]
    header = "round  load  probes  calibrate  configuration        steps  estimate  bounds              actual  error   inside"
    print(header)
    errors, widths, inside = [], [], 0
    for index, row in enumerate(rows):
        error = (row["actual_s"] - row["estimate_s"]) / row["estimate_s"] * 100
        width = (row["high_s"] - row["low_s"]) / 2 / row["estimate_s"] * 100
        hit = row["low_s"] <= row["actual_s"] <= row["high_s"]
        errors.append(abs(error))
        widths.append(width)
        inside += hit
        print(
            f"{index + 1:>5}  {row['load']:>4.1f}  {row['probes']:>6}  {row['calibrate_s']:>8.0f}s  "
            f"{row['config']:<19}  {row['steps']:>5}  {row['estimate_s']:>7.0f}s  "
            f"{row['low_s']:>6.0f}s–{row['high_s']:<6.0f}s (±{width:.0f}%)  {row['actual_s']:>5.0f}s  "
            f"{error:>+5.1f}%  {'yes' if hit else 'NO'}"
        )
    print(
        f"inside its bounds: {inside} of {len(rows)}; median |whole-run error| {statistics.median(errors):.1f}%; "
        f"median half-width of the bounds ±{statistics.median(widths):.0f}%"
    )


if __name__ == "__main__":
    main()
