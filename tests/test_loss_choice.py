"""The loss as a measured choice (issue 24): bench compares the losses that apply, keeps the
fastest whose logits memory is not at stake, and `train --loss auto` runs what bench chose."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from benchtrain.bench.calibrate import BenchTask, choose_measured_loss
from benchtrain.bench.choose import ProbePlanner
from benchtrain.bench.cost import CostModel, DeviceSpeed
from benchtrain.bench.space import SearchSpace
from benchtrain.bench.timing import ProbeSettings

GIB = 2**30


def task_and_planner(memory_bytes: float, largest_batch: int = 8) -> tuple[BenchTask, ProbePlanner]:
    space = SearchSpace((1, largest_batch), (0,), (1,), (256,))
    task = BenchTask(
        space,
        ProbeSettings(),
        {"memory_bytes": memory_bytes},
        {},
        {},
        {"loss": "chunked"},
        "cpu",
        losses=("chunked", "plain"),
    )
    return task, ProbePlanner(space, CostModel(lambda config: 1.0, DeviceSpeed(1e9, "test"), ProbeSettings()))


def rows(plain_step: float, plain_peak: float) -> list[dict[str, Any]]:
    common = {
        "micro_batch_size": 1,
        "num_workers": 0,
        "grad_accum": 1,
        "seq_len": 256,
        "gradient_checkpointing": 0,
        "status": "ok",
    }
    chunked = {**common, "loss": "chunked", "step_seconds": 1.0, "peak_memory_bytes": 2 * GIB}
    plain = {**common, "loss": "plain", "step_seconds": plain_step, "peak_memory_bytes": plain_peak}
    return [chunked, plain, chunked, plain]


def test_the_faster_loss_wins_where_its_memory_is_not_at_stake() -> None:
    task, planner = task_and_planner(memory_bytes=80 * GIB)
    chosen, reason = choose_measured_loss(rows(plain_step=0.8, plain_peak=2.1 * GIB), task, planner)
    assert chosen == "plain" and "plain 800 ms/step" in reason


def test_memory_decides_where_the_full_logits_would_cost_much_of_the_device() -> None:
    # 1 GiB more at one row of 256 tokens is 8 GiB at the grid's 8 rows: more than 10% of 60 GiB.
    task, planner = task_and_planner(memory_bytes=60 * GIB)
    chosen, _ = choose_measured_loss(rows(plain_step=0.8, plain_peak=3 * GIB), task, planner)
    assert chosen == "chunked"


def test_a_tie_goes_to_the_leaner_loss() -> None:
    task, planner = task_and_planner(memory_bytes=80 * GIB)
    chosen, _ = choose_measured_loss(rows(plain_step=0.99, plain_peak=2.2 * GIB), task, planner)
    assert chosen == "chunked"


def test_losses_swap_on_one_model_and_compute_the_same_loss() -> None:
    from benchtrain.train.step.loss import install_loss
    from benchtrain.train.workload.batching import SyntheticBatches
    from benchtrain.train.workload.model import build_model, resolve_model

    model = build_model(resolve_model("tiny"), "cpu")
    batch = SyntheticBatches(1, 2, 32, model.config.vocab_size)[0]
    losses = {}
    for kind in ("chunked", "plain", "chunked", "plain"):
        install_loss(model, kind)
        with torch.no_grad():
            losses.setdefault(kind, []).append(float(model(input_ids=batch["input_ids"], labels=batch["labels"]).loss))
    assert losses["plain"][0] == losses["plain"][1] and losses["chunked"][0] == losses["chunked"][1]
    assert losses["plain"][0] == pytest.approx(losses["chunked"][0], rel=1e-5)
    assert model._benchtrain_loss == "plain" and "forward" in model.__dict__


@pytest.mark.slow
def test_bench_compares_the_losses_and_train_runs_the_one_it_chose(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from helpers import run_main

    grid = ["--batch-sizes", "1,4", "--workers", "0", "--accum", "1,2", "--seq-lens", "32,64"]
    code, _, err = run_main("bench", ["run", *grid, "--quiet", "--no-report"], capsys)
    assert code == 0, err
    path = next((home / "calibrations").glob("*.json"))
    record = json.loads(path.read_text())
    choice = record["loss_choice"]
    assert {row["loss"] for row in choice["measurements"]} == {"chunked", "plain"} and len(choice["measurements"]) == 4
    assert record["training"]["loss"] == choice["chosen"]
    assert {row["loss"] for row in record["measurements"] if row["status"] == "ok"} == {choice["chosen"]}
    # Make the other loss the measured choice: `train --loss auto` runs it.
    other = "plain" if choice["chosen"] == "chunked" else "chunked"
    record["training"]["loss"] = choice["chosen"] = other
    path.write_text(json.dumps(record))
    code, _, err = run_main(
        "train", ["--data", "sample", "--deadline", "10m", "--max-steps", "2", "--no-report"], capsys
    )
    assert code == 0, err
    run = json.loads(next((home / "runs").glob("*/run.json")).read_text())
    assert run["training"]["loss"] == other
