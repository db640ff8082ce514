"""What keeps THE step fast beyond its kernels: no host sync inside the micro-steps, no attention
mask where causality already hides the padding, and the peers benchmark runnable in one command."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from helpers import tokenized_from_samples
from step_profile import fixed_micro_step_seconds, profile_step

from benchtrain.train.step.engine import StepOptions, engine_from_options
from benchtrain.train.workload.batching import PackedBatches, PaddedBatches
from benchtrain.train.workload.method import MethodConfig
from benchtrain.train.workload.model import build_model, resolve_model

ROOT = Path(__file__).resolve().parent.parent


def _padded_batches() -> PaddedBatches:
    samples = [np.arange(3, 3 + n) % 300 for n in (50, 30, 70, 64)]
    return PaddedBatches(
        tokenized_from_samples(samples, [5, 0, 0, 3], "prompt_completion", "test"), [[0, 1], [2, 3]], 128, pad_id=0
    )


@pytest.mark.parametrize("kind", ["packed", "padded"])
def test_no_host_sync_inside_the_micro_steps(kind: str) -> None:
    """The number of `.item()`-like reads per optimizer step does not grow with accumulation: the
    only ones are per optimizer step (the loss read after the timer's synchronise)."""
    engine = engine_from_options(resolve_model("tiny"), MethodConfig(), Accelerator(cpu=True), StepOptions())
    stream = tokenized_from_samples([np.arange(4000) % 300], None, "text", "test")
    dataset = PackedBatches(stream, [[0, 1], [2, 3]], 64) if kind == "packed" else _padded_batches()
    batches = itertools.cycle([dataset[0], dataset[1]])
    engine.step.run(batches, 2)  # warm
    one = profile_step(engine.step, batches, grad_accum=1, optimizer_steps=2)
    four = profile_step(engine.step, batches, grad_accum=4, optimizer_steps=2)
    assert four.micro_steps == 4 * one.micro_steps
    assert four.syncs == one.syncs, (one.syncs, four.syncs)
    assert one.host_seconds > 0


def test_right_padding_needs_no_attention_mask() -> None:
    model = build_model(resolve_model("tiny"), "cpu").eval()
    batch = _padded_batches()[0]
    lengths = [50, 30]
    mask = torch.zeros_like(batch["input_ids"])
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    assert "attention_mask" not in batch
    with torch.no_grad():
        masked = model(input_ids=batch["input_ids"], attention_mask=mask, labels=batch["labels"]).loss
        unmasked = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    assert float(unmasked) == pytest.approx(float(masked), rel=1e-6)


def test_fixed_cost_per_micro_step_from_micro_batch_1_and_2() -> None:
    assert fixed_micro_step_seconds(0.060, 0.070) == pytest.approx(0.050)  # 50 ms fixed + 10 ms per row
    assert fixed_micro_step_seconds(0.010, 0.030) == 0.0


@pytest.mark.slow
def test_peers_benchmark_runs_in_one_command() -> None:
    command = [
        sys.executable,
        str(ROOT / "benchmarks" / "peers.py"),
        "--loops",
        "hf-trainer,ours-eager",
        "--steps",
        "2",
        "--warmup",
        "1",
    ]
    command += ["--micro-batch", "2", "--seq-len", "32"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {
        line.split()[0]: line.split()
        for line in done.stdout.splitlines()
        if line.split() and line.split()[0] in ("hf-trainer", "ours-eager")
    }
    assert set(rows) == {"hf-trainer", "ours-eager"}, done.stdout
    assert rows["hf-trainer"][4] == "1.00"  # the ratio column is relative to HF Trainer
    assert float(rows["ours-eager"][1].replace(",", "")) > 0
