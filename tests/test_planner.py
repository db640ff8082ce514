"""The planner: fastest feasible configuration, effective batch held, exact token counts."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import GIB, heavy_tailed, synthetic_calibration, synthetic_rows, tokenized

from benchtrain.calibration.model import Calibration
from benchtrain.calibration.step_config import StepConfig
from benchtrain.common.errors import BenchtrainError
from benchtrain.train.planning.deadline import Deadline
from benchtrain.train.planning.planner import deadline_options, make_plan
from benchtrain.train.planning.types import PlanRequest
from benchtrain.train.workload.batching import (
    PackedBatches,
    PaddedBatches,
    batch_shapes,
    epoch_batches,
    packed_row_count,
    plan_padded_batches,
)
from benchtrain.train.workload.method import MethodConfig
from benchtrain.train.workload.model import resolve_model


def test_padding_token_counts_are_exact() -> None:
    lengths = [5, 9, 3, 7, 2, 8]
    data = tokenized(lengths)
    batches = plan_padded_batches(lengths, micro_batch_size=2, max_length=6, seed=1, epoch=0)
    assert sorted(i for batch in batches for i in batch) == list(range(6))
    shapes = batch_shapes(data, batches, max_length=6)
    dataset = PaddedBatches(data, batches, max_length=6, pad_id=0)
    for index, shape in enumerate(shapes):
        item = dataset[index]
        assert tuple(item["input_ids"].shape) == (shape.rows, shape.length)
        expected_real = sum(min(lengths[i], 6) for i in batches[index])
        assert int((item["labels"] != -100).sum()) == expected_real
    assert data.real_tokens(6) == sum(min(n, 6) for n in lengths)


def test_prompt_tokens_carry_no_loss() -> None:
    data = tokenized([10, 6], fmt="prompt_completion", prompt=4)
    dataset = PaddedBatches(data, [[0, 1]], max_length=16, pad_id=0)
    labels = dataset[0]["labels"]
    assert int((labels != -100).sum()) == (10 - 4) + (6 - 4)
    assert data.real_tokens(16) == 8


def test_packing_token_counts_are_exact() -> None:
    lengths = [5, 9, 3, 7]
    data = tokenized(lengths, fmt="text")
    assert packed_row_count(sum(lengths), 4) == 6  # 24 tokens → 6 rows of 4, no padding
    batches = epoch_batches(data, micro_batch_size=4, max_length=4, seed=0, epoch=0)
    assert sorted(row for batch in batches for row in batch) == list(range(6))
    dataset = PackedBatches(data, batches, max_length=4)
    seen = np.concatenate([dataset[i]["input_ids"].numpy().ravel() for i in range(len(dataset))])
    # every token exactly once
    assert sorted(seen.tolist()) == sorted(data.stream_take(np.arange(data.stream_length)).tolist())
    assert data.real_tokens(4) == 24


def test_planner_picks_the_fastest_feasible_configuration_and_keeps_the_effective_batch() -> None:
    calibration = Calibration(synthetic_calibration())
    data = tokenized(heavy_tailed())
    plan = make_plan(
        calibration,
        data,
        PlanRequest(epochs=1, deadline=Deadline.with_margin_share(10_000, 0.05), priority="fast", effective_batch=16),
    )
    c = plan.chosen
    assert c.config.micro_batch_size * c.config.grad_accum * c.world_size == 16
    for alternative in plan.alternatives:
        assert alternative.config.micro_batch_size * alternative.config.grad_accum == 16
        assert alternative.total_seconds >= c.total_seconds
    # Brute force over every candidate the calibration allows: nothing is faster.
    best = min(
        sum(
            calibration.micro_step_seconds(
                StepConfig(micro_batch_size=s.rows, num_workers=w, grad_accum=16 // b, seq_len=s.length)
            )
            for s in batch_shapes(data, epoch_batches(data, b, c.config.seq_len, 0, 0), c.config.seq_len)
        )
        for b in (1, 2, 4, 8)
        for w in (0, 2)
    )
    assert c.step_seconds == pytest.approx(best, rel=1e-9)
    assert plan.meets_deadline
    assert c.total_seconds_low < c.total_seconds < c.total_seconds_high


def test_padding_costs_are_counted_from_real_batches() -> None:
    calibration = Calibration(synthetic_calibration())
    data = tokenized(heavy_tailed())
    plan = make_plan(
        calibration, data, PlanRequest(epochs=1, deadline=Deadline.with_margin_share(10_000, 0.05), effective_batch=8)
    )
    c = plan.chosen
    assert c.padded_tokens > c.tokens  # padding exists and is counted
    assert c.tokens == data.real_tokens(c.config.seq_len)


def test_max_length_auto_covers_995_percent_and_quality_covers_all() -> None:
    calibration = Calibration(synthetic_calibration(synthetic_rows(seq_lens=(128, 256, 512, 1024, 2048))))
    lengths = [100] * 990 + [300] * 7 + [1500] * 3
    data = tokenized(lengths)
    balanced = make_plan(calibration, data, PlanRequest(epochs=1, deadline=Deadline.with_margin_share(1e6, 0.05)))
    assert balanced.chosen.config.seq_len == 512  # 99.5% ≤ 300 tokens: smallest calibrated length ≥ 300
    assert balanced.chosen.truncation["samples_truncated"] == 3
    quality = make_plan(
        calibration, data, PlanRequest(epochs=1, deadline=Deadline.with_margin_share(1e6, 0.05), priority="quality")
    )
    assert quality.chosen.config.seq_len == 2048
    assert quality.chosen.truncation["samples_truncated"] == 0


def test_memory_efficient_takes_less_memory_within_the_time_slack() -> None:
    calibration = Calibration(synthetic_calibration())
    data = tokenized(heavy_tailed())
    fast = make_plan(
        calibration, data, PlanRequest(epochs=1, deadline=Deadline.with_margin_share(1e6, 0.05), priority="fast")
    ).chosen
    lean = make_plan(
        calibration,
        data,
        PlanRequest(epochs=1, deadline=Deadline.with_margin_share(1e6, 0.05), priority="memory_efficient"),
    ).chosen
    assert lean.peak_memory_bytes <= fast.peak_memory_bytes
    assert lean.total_seconds <= fast.total_seconds * 1.10 + 1e-9


def test_configurations_that_do_not_fit_in_memory_are_never_chosen() -> None:
    rows = synthetic_rows(memory_limit=3.2e9)
    calibration = Calibration(synthetic_calibration(rows, memory_bytes=3.2e9))
    data = tokenized(heavy_tailed())
    plan = make_plan(
        calibration, data, PlanRequest(epochs=1, deadline=Deadline.with_margin_share(1e6, 0.05), priority="fast")
    )
    assert plan.chosen.fits_in_memory
    assert calibration.predict(
        StepConfig(plan.chosen.config.micro_batch_size, 0, 1, plan.chosen.config.seq_len)
    ).fits_in_memory


def test_an_impossible_deadline_is_reported_with_options_and_fit_deadline_cuts_steps() -> None:
    calibration = Calibration(synthetic_calibration())
    data = tokenized(heavy_tailed())
    plan = make_plan(calibration, data, PlanRequest(epochs=50, deadline=Deadline.with_margin_share(30, 0.05)))
    assert not plan.meets_deadline
    options = deadline_options(plan)
    assert "--epochs" in options and "--max-steps" in options and "--max-length" in options
    fitted = make_plan(
        calibration, data, PlanRequest(epochs=50, deadline=Deadline.with_margin_share(30, 0.05), fit_deadline=True)
    )
    assert fitted.meets_deadline and fitted.step_limit is not None
    assert fitted.chosen.optimizer_steps == fitted.step_limit < plan.chosen.optimizer_steps


def test_bad_requests_are_one_line_errors() -> None:
    calibration = Calibration(synthetic_calibration())
    data = tokenized(heavy_tailed())
    with pytest.raises(BenchtrainError, match="--priority"):
        PlanRequest(epochs=1, deadline=Deadline.with_margin_share(10, 0.05), priority="cheap")
    with pytest.raises(BenchtrainError, match="--effective-batch"):
        PlanRequest(epochs=1, deadline=Deadline.with_margin_share(10, 0.05), effective_batch=0)
    with pytest.raises(BenchtrainError, match="--epochs"):
        PlanRequest(epochs=0, deadline=Deadline.with_margin_share(10, 0.05))
    with pytest.raises(BenchtrainError, match="--max-length"):
        make_plan(calibration, data, PlanRequest(epochs=1, deadline=Deadline.with_margin_share(10, 0.05), max_length=0))
    only_big = Calibration(synthetic_calibration(synthetic_rows(batch_sizes=(4, 8))))
    with pytest.raises(BenchtrainError, match="divides --effective-batch 3"):
        make_plan(
            only_big, data, PlanRequest(epochs=1, deadline=Deadline.with_margin_share(10, 0.05), effective_batch=3)
        )


def test_the_calibrated_overheads_are_added() -> None:
    calibration = Calibration(synthetic_calibration())
    plan = make_plan(
        calibration, tokenized(heavy_tailed()), PlanRequest(epochs=1, deadline=Deadline.with_margin_share(1e6, 0.05))
    )
    overheads = calibration.overheads
    minimum = overheads["model_build_seconds"] + overheads["checkpoint_save_seconds"] + overheads["report_seconds"]
    assert plan.chosen.overheads.total_seconds >= minimum
    assert plan.chosen.total_seconds == pytest.approx(plan.chosen.step_seconds + plan.chosen.overheads.total_seconds)


def test_the_final_export_is_planned_by_its_bytes() -> None:
    """A preset's base in final/ and --merge-lora write far more than one checkpoint: their bytes at the measured
    write bandwidth go into the plan and the guard's reserve (older calibrations: the timed save
    scaled by bytes)."""
    from benchtrain.train.planning.disk import export_bytes
    from benchtrain.train.planning.memory_check import memory_need

    need = memory_need(resolve_model("llama-3.1-8b"), MethodConfig(method="lora"), "cuda")
    adapters_only = export_bytes(need, lora=True, preset_base=False, merge=False, device_type="cuda")
    with_base = export_bytes(need, lora=True, preset_base=True, merge=True, device_type="cuda")
    # two bf16 copies of the base
    assert with_base - adapters_only == 2 * 2 * (need.total_parameters - need.trainable_parameters)
    assert with_base > 30e9  # the base in final/ and final-merged/ of an 8B model

    measured = {
        "model_build_seconds": 1.0,
        "checkpoint_save_seconds": 0.5,
        "checkpoint_bytes": 5e8,
        "disk_write_bytes_per_second": 1e9,
        "report_seconds": 2.0,
    }
    data = tokenized(heavy_tailed())
    for overheads, seconds in (
        (measured, with_base / 1e9),
        ({**measured, "disk_write_bytes_per_second": None}, 0.5 * with_base / 5e8),
    ):
        calibration = Calibration(synthetic_calibration(overheads=overheads))
        chosen = make_plan(
            calibration,
            data,
            PlanRequest(epochs=1, deadline=Deadline.with_margin_share(1e6, 0.05), export_bytes=with_base),
        ).chosen
        assert chosen.overheads.export_seconds == pytest.approx(seconds)
        assert chosen.overheads.after_training_seconds >= seconds  # kept in reserve by the guard
        assert chosen.overheads.total_seconds >= seconds


def test_gib_constant_is_binary() -> None:
    assert GIB == 1024**3
