"""Probes on the tiny model, OOM handling, grid and Optuna search, budget, resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from benchtrain.bench.probe import ProbeSettings, Workload, run_probe
from benchtrain.bench.runner import Budget, OptunaStudy, run_grid, run_optuna
from benchtrain.bench.space import SearchSpace
from benchtrain.calibration.step_config import StepConfig
from benchtrain.train.workload.model import resolve_model

FAST = ProbeSettings(warmup_steps=1, min_steps=2, max_steps=3, max_seconds=1.0)


@pytest.fixture(scope="module")
def workload() -> Workload:
    return Workload(resolve_model("tiny"))


def test_a_probe_measures_the_training_step(workload: Workload) -> None:
    row = run_probe(workload, StepConfig(micro_batch_size=2, num_workers=0, grad_accum=2, seq_len=64), FAST)
    assert row["status"] == "ok"
    assert row["tokens_per_second"] > 0
    assert row["tokens_per_second"] == pytest.approx(2 * 64 * 2 / row["step_seconds"])
    assert 2 <= row["timed_steps"] <= 3
    assert row["peak_memory_bytes"] > 50 * 2**20  # a Python process with torch loaded
    assert 0 <= row["data_wait_share"] <= 1
    assert row["mfu"] is None  # no peak FLOP/s for a CPU


def test_the_probe_trains_the_model(workload: Workload) -> None:
    before = [p.detach().clone() for p in workload.engine.model.parameters()]
    run_probe(workload, StepConfig(micro_batch_size=1, num_workers=0, grad_accum=1, seq_len=32), FAST)
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, workload.engine.model.parameters(), strict=True))


def test_a_probe_with_dataloader_workers(workload: Workload) -> None:
    row = run_probe(workload, StepConfig(micro_batch_size=2, num_workers=2, grad_accum=1, seq_len=64), FAST)
    assert row["status"] == "ok" and row["num_workers"] == 2


def test_a_faked_out_of_memory_error_is_recorded_not_raised(
    workload: Workload, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_run = workload.engine.step.run

    def run(batches: Any, grad_accum: int, synchronize: bool = True) -> Any:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(workload.engine.step, "run", run)
    row = run_probe(workload, StepConfig(micro_batch_size=8, num_workers=0, grad_accum=1, seq_len=256), FAST)
    assert row["status"] == "oom"
    assert "out of memory" in row["error"]
    monkeypatch.setattr(workload.engine.step, "run", real_run)
    # the workload recovered
    assert (
        run_probe(workload, StepConfig(micro_batch_size=1, num_workers=0, grad_accum=1, seq_len=32), FAST)["status"]
        == "ok"
    )


def test_other_failures_are_errors(workload: Workload, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        workload.engine.step, "run", lambda *_, **__: (_ for _ in ()).throw(ValueError("shape mismatch"))
    )
    row = run_probe(workload, StepConfig(micro_batch_size=1, num_workers=0, grad_accum=1, seq_len=32), FAST)
    assert row["status"] == "error" and "shape mismatch" in row["error"]


def fake_probe(oom_at: tuple[int, int] | None = None, calls: list | None = None):
    """A probe that costs nothing: tokens/s from a formula, OOM at and beyond (batch, length)."""

    def probe(config: StepConfig, _remaining: float | None) -> dict[str, Any]:
        if calls is not None:
            calls.append(config)
        row = {**config.to_row(), "probe_seconds": 0.01}
        if oom_at and config.micro_batch_size >= oom_at[0] and config.seq_len >= oom_at[1]:
            return {**row, "status": "oom", "error": "OutOfMemoryError"}
        step = 0.01 + 1e-5 * config.micro_batch_size * config.seq_len * config.grad_accum
        tokens = config.micro_batch_size * config.seq_len * config.grad_accum
        return {
            **row,
            "status": "ok",
            "step_seconds": step,
            "tokens_per_second": tokens / step,
            "peak_memory_bytes": 1e6,
        }

    return probe


SPACE = SearchSpace((1, 2, 4, 8), (0, 2), (1, 2), (64, 128))


def test_grid_probes_everything_and_prunes_after_oom() -> None:
    calls: list[StepConfig] = []
    result = run_grid(SPACE, fake_probe(oom_at=(4, 128), calls=calls), Budget(None))
    statuses = {
        (r["micro_batch_size"], r["seq_len"], r["num_workers"], r["grad_accum"]): r["status"] for r in result.rows
    }
    assert len(result.rows) == SPACE.size
    assert statuses[(8, 128, 0, 1)] in ("oom", "skipped")
    skipped = [r for r in result.rows if r["status"] == "skipped"]
    assert skipped, "larger batches at the OOM length must be skipped, not probed"
    assert all(r["micro_batch_size"] >= 4 and r["seq_len"] >= 128 for r in skipped)
    assert not any(
        c.micro_batch_size >= 8 and c.seq_len >= 128
        for c in calls[calls.index(next(c for c in calls if c.micro_batch_size >= 4 and c.seq_len >= 128)) + 1 :]
    )
    assert all(r["status"] == "ok" for r in result.rows if r["seq_len"] < 128)


def test_the_budget_stops_the_grid_and_says_what_was_left_out() -> None:
    from simulated import VirtualClock

    clock = VirtualClock()  # each probe takes 0.05 s of it, however busy the machine is

    def slow(config: StepConfig, remaining: float | None) -> dict[str, Any]:
        clock.advance(0.05)
        row = fake_probe()(config, remaining)
        row["probe_seconds"] = 0.05
        return row

    result = run_grid(SPACE, slow, Budget(0.3, clock=clock))
    probed = [r for r in result.rows if r["status"] == "ok"]
    assert result.stopped_by_budget
    assert 2 <= len(probed) < SPACE.size
    assert len(probed) + len(result.left_out) == SPACE.size
    # Cheapest first (a minimum viable fit), then what the fit learns most from per second: other
    # sizes among the first few.
    assert (probed[0]["micro_batch_size"], probed[0]["grad_accum"], probed[0]["seq_len"]) == (1, 1, 64)
    assert len({r["micro_batch_size"] * r["seq_len"] for r in probed}) >= 2


def test_optuna_samples_the_same_space(home: Path) -> None:
    result = run_optuna(
        SPACE, fake_probe(), Budget(None), trials=8, study=OptunaStudy(home / "studies" / "bench.db", "t1")
    )
    configs = {(r["micro_batch_size"], r["num_workers"], r["grad_accum"], r["seq_len"]) for r in result.rows}
    assert len(result.rows) == 8 == len(configs)
    assert all(r["status"] == "ok" for r in result.rows)


def test_an_interrupted_optuna_benchmark_resumes_without_repeats(home: Path) -> None:
    storage = home / "studies" / "bench.db"
    calls: list[StepConfig] = []
    probe = fake_probe(oom_at=(8, 128), calls=calls)

    def interrupted(config: StepConfig, remaining: float | None) -> dict[str, Any]:
        if len(calls) == 4:
            raise KeyboardInterrupt
        return probe(config, remaining)

    with pytest.raises(KeyboardInterrupt):
        run_optuna(SPACE, interrupted, Budget(None), trials=10, study=OptunaStudy(storage, "resume"))
    first = list(calls)
    assert len(first) == 4
    result = run_optuna(SPACE, probe, Budget(None), trials=10, study=OptunaStudy(storage, "resume"))
    second = calls[4:]
    assert result.reused == 4
    assert not set(first) & set(second), "finished probes were repeated"
    assert len(set(first) | set(second)) == len(first) + len(second)
    measured = [r for r in result.rows if r["status"] != "skipped"]
    assert len(measured) == 10
    assert any(r["status"] == "oom" for r in result.rows) or all(
        c.micro_batch_size < 8 or c.seq_len < 128 for c in first + second
    )


def test_a_faked_oom_in_the_real_probe_prunes_the_grid(workload: Workload, monkeypatch: pytest.MonkeyPatch) -> None:
    real_run = workload.engine.step.run
    sizes: list[tuple[int, int]] = []

    def run(batches: Any, grad_accum: int, synchronize: bool = True) -> Any:
        batch = next(batches)
        rows, length = batch["input_ids"].shape
        sizes.append((rows, length))
        if rows >= 4 and length >= 64:
            raise torch.OutOfMemoryError("CUDA out of memory (faked)")
        return real_run(iter([batch, *[next(batches) for _ in range(grad_accum - 1)]]), grad_accum, synchronize)

    monkeypatch.setattr(workload.engine.step, "run", run)
    space = SearchSpace((1, 4, 8), (0,), (1,), (32, 64, 128))
    result = run_grid(space, lambda config, remaining: run_probe(workload, config, FAST), Budget(None))
    by_config = {(r["micro_batch_size"], r["seq_len"]): r["status"] for r in result.rows}
    # An OOM rules out the larger batches at that and longer lengths: they are never run.
    assert by_config[(4, 64)] == "oom" and by_config[(8, 128)] in ("oom", "skipped")
    assert all(by_config[(b, s)] == "ok" for b, s in [(1, 32), (1, 64), (1, 128), (4, 32), (8, 32)])
    run_sizes = list(dict.fromkeys(sizes))
    for index, (rows, length) in enumerate(run_sizes):
        earlier_oom = [(b, s) for b, s in run_sizes[:index] if by_config[(b, s)] == "oom"]
        assert not any(rows >= b and length >= s for b, s in earlier_oom), (rows, length)
    assert result.drift is not None and not result.drift["applied"]


def test_drift_is_measured_with_a_reference_probe_and_corrected() -> None:
    clock = {"probes": 0}

    def slowing_machine(config: StepConfig, remaining: float | None) -> dict[str, Any]:
        # Every probe the machine gets 1% slower; the model's "true" speed does not change.
        clock["probes"] += 1
        row = fake_probe()(config, remaining)
        # Steps of 50–150 ms: long enough to time well, so the first probe is the reference.
        slowdown = STEP_SCALE * (1 + 0.01 * clock["probes"])
        row["step_seconds"] *= slowdown
        row["tokens_per_second"] /= slowdown
        return row

    result = run_grid(SPACE, slowing_machine, Budget(None), reference_every=4)
    # The reference is the first probe that succeeded with steps that time well, measured again as it goes.
    first = next(r for r in result.rows if r["status"] == "ok")
    assert result.drift["applied"] and result.drift["reference"] == {k: first[k] for k in result.drift["reference"]}
    assert len(result.drift["measurements"]) >= SPACE.size // 4
    assert result.drift["spread_pct"] > 20
    truth = {
        (r["micro_batch_size"], r["num_workers"], r["grad_accum"], r["seq_len"]): r["tokens_per_second"] / STEP_SCALE
        for r in fake_probe_rows()
    }
    corrected = [
        abs(
            r["tokens_per_second"] / truth[(r["micro_batch_size"], r["num_workers"], r["grad_accum"], r["seq_len"])] - 1
        )
        for r in result.rows
    ]
    raw = [
        abs(
            r["tokens_per_second_raw"] / truth[(r["micro_batch_size"], r["num_workers"], r["grad_accum"], r["seq_len"])]
            - 1
        )
        for r in result.rows
    ]
    # Rescaled to the benchmark's median speed: the spread across the benchmark shrinks.
    assert (
        np.ptp(
            [
                r["tokens_per_second"] / truth[(r["micro_batch_size"], r["num_workers"], r["grad_accum"], r["seq_len"])]
                for r in result.rows
            ]
        )
        < 0.05
    )
    assert max(raw) > 0.2 and max(corrected) < max(raw)


STEP_SCALE = 5.0


def fake_probe_rows() -> list[dict[str, Any]]:
    probe = fake_probe()
    return [probe(config, None) for config in SPACE.all_configs()]


def test_no_reference_no_correction() -> None:
    result = run_grid(SPACE, fake_probe(), Budget(None), reference_every=None)
    assert result.drift is None
    assert "tokens_per_second_raw" not in result.rows[0]


def test_a_correction_that_does_not_help_the_fit_is_undone() -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from helpers import synthetic_rows

    from benchtrain.bench.disturbed import correct_for_drift, median_of_three
    from benchtrain.bench.record import fit_with_drift_choice

    assert median_of_three(np.array([10.0, 2.0, 11.0, 10.0])).tolist() == [10.0, 10.0, 10.0, 10.0]
    rows = synthetic_rows(noise=0.01)  # a steady machine...
    raw = [row.get("tokens_per_second") for row in rows]
    # ...but references that claim a steep slowdown half-way: the correction would distort the data.
    reference = StepConfig(micro_batch_size=2, num_workers=0, grad_accum=1, seq_len=256)
    drift = correct_for_drift(rows, [(0, 1000.0), (20, 1000.0), (40, 500.0), (60, 500.0)], reference)
    assert drift["applied"]
    fit = fit_with_drift_choice(rows, drift, {}, [])
    assert not drift["applied"] and "did not help" in drift["reason"]
    assert [row.get("tokens_per_second") for row in rows] == raw
    assert fit["held_out_error"]["median_abs_pct"] < 5


def test_lengths_beyond_the_models_positions_are_known_before_it_is_built(
    home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """gpt2 has 1024 positions: --seq-lens past them is one line before anything is built, and a big
    GPU's default lengths (up to 2048) stop at 1024 instead of failing after the model is built."""
    from helpers import assert_one_line_error, run_main

    import benchtrain.bench.variant_measurement
    from benchtrain.bench.space import default_space, within_positions

    monkeypatch.setattr(
        benchtrain.bench.variant_measurement,
        "Workload",
        lambda *args, **kwargs: pytest.fail("the model was built first"),
    )
    code, _, err = run_main("bench", ["run", "--model", "gpt2", "--seq-lens", "512,2048", "--quiet"], capsys)
    assert_one_line_error(code, err, "--seq-lens [2048] exceed the model's 1024 positions")
    big_gpu = default_space("cuda", 80 * 2**30)
    assert max(big_gpu.axis("seq_lens")) > 1024
    assert within_positions(big_gpu, 1024, asked=False).axis("seq_lens") == (512, 1024)
    assert within_positions(big_gpu, 4096, asked=False) == big_gpu
