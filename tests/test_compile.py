"""torch.compile in THE step (train/step/compile.py): few shapes, compile time measured and planned,
the guard not fooled by compiling steps, and the compiled step computing what the eager one does."""

from __future__ import annotations

import json
import shutil
import socket

import numpy as np
import pytest
import torch
from helpers import assert_one_line_error, heavy_tailed, run_main, synthetic_calibration, tokenized

from benchtrain.bench.calibrate import warmup_costs
from benchtrain.calibration.model import Calibration
from benchtrain.common.errors import BenchtrainError
from benchtrain.train.planning.deadline import Deadline
from benchtrain.train.planning.planner import make_plan
from benchtrain.train.planning.types import PlanRequest
from benchtrain.train.running.guard import DeadlineGuard, GuardSettings
from benchtrain.train.step.compile import SHAPE_BUCKET, compile_enabled, compile_seconds
from benchtrain.train.step.engine import StepOptions
from benchtrain.train.workload.batching import PaddedBatches, batch_shape_counts, padded_width, plan_padded_batches
from benchtrain.train.workload.method import MethodConfig

# Inductor compiles C++ for the CPU: without a compiler there is no compiled step to test.
needs_compiler = pytest.mark.skipif(
    not (shutil.which("g++") or shutil.which("c++")), reason="torch.compile on CPU needs a C++ compiler"
)


def test_compile_auto_means_cuda_only() -> None:
    assert compile_enabled("auto", "cuda") and not compile_enabled("auto", "cpu")
    assert compile_enabled("on", "cpu") and not compile_enabled("off", "cuda")
    with pytest.raises(BenchtrainError, match="--compile must be one of auto, on, off, got 'yes'"):
        StepOptions(compile="yes")


def test_padded_batches_are_bucketed_to_few_widths() -> None:
    assert [padded_width(n, 300, 64) for n in (1, 64, 65, 250, 299, 5000)] == [64, 64, 128, 256, 300, 300]
    assert padded_width(65, 300) == 65  # eager: the longest sample
    lengths = heavy_tailed(600)
    batches = plan_padded_batches(lengths, 4, 1024, seed=0, epoch=0)
    data = tokenized(lengths)
    exact = batch_shape_counts(data, batches, 1024)
    bucketed = batch_shape_counts(data, batches, 1024, SHAPE_BUCKET)
    assert sum(exact.values()) == sum(bucketed.values()) == len(batches)
    assert len(bucketed) <= 2 * 1024 // SHAPE_BUCKET < len(exact)  # rows: 4, and the last batch's
    assert all(length % SHAPE_BUCKET == 0 or length == 1024 for _, length in bucketed)
    dataset = PaddedBatches(data, batches, 1024, pad_id=0, bucket=SHAPE_BUCKET)
    for index in range(5):  # what the DataLoader delivers is what the planner counted
        rows, width = dataset[index]["input_ids"].shape
        assert (rows, width) in bucketed


def test_compile_seconds_per_shape_cached_only_on_the_machine_that_compiled() -> None:
    measured = {"compile_seconds_per_shape": 30.0, "compile_cached_seconds_per_shape": 2.0}
    shapes = {(8, 1024), (8, 512), (3, 512)}
    probed = {(8, 1024), (8, 512)}
    here = {"dir": "/", "host": socket.gethostname()}
    assert compile_seconds(measured, shapes, probed, here) == 2.0 + 2.0 + 30.0
    assert compile_seconds(measured, shapes, probed, {"dir": "/", "host": "elsewhere"}) == 90.0
    assert compile_seconds(measured, shapes, probed, {"dir": "/no/such/cache", "host": socket.gethostname()}) == 90.0
    assert compile_seconds({}, shapes, probed, here) == 0.0  # an eager calibration


def test_bench_separates_compilation_from_warm_up() -> None:
    def row(warmup: float, new: bool) -> dict:
        return {"status": "ok", "warmup_seconds": warmup, "step_seconds": 1.0, "new_shape": new}

    rows = [row(21.5, True), row(1.5, False), row(31.5, True), row(1.5, False), row(26.5, True), {"status": "oom"}]
    costs = warmup_costs(rows, warmup_steps=1, compiled=True)
    assert costs["warmup_extra_seconds"] == 0.5
    assert costs["compile_seconds_per_shape"] == 25.0
    assert costs["compile_shapes_measured"] == 3
    assert warmup_costs(rows, 1, compiled=False) == {"warmup_extra_seconds": 20.5}


def test_guard_leaves_compiling_steps_out_and_counts_compilation_still_to_come() -> None:
    guard = DeadlineGuard(GuardSettings(Deadline(100, 0), reserve_seconds=0, warmup_steps=0), limit=50)
    verdict = guard.observe(
        1, elapsed=31, actual_seconds=31, predicted_seconds=1, remaining_predicted=49, compiled=True
    )
    assert verdict.ratio == 1.0 and verdict.message is None  # 31 s of compiling is not a 31× slower step
    verdict = guard.observe(
        2, elapsed=32, actual_seconds=1, predicted_seconds=1, remaining_predicted=48, pending_compile_seconds=30
    )
    assert verdict.projected_finish == pytest.approx(32 + 48 + 30)
    assert verdict.move.value == "stop" or verdict.message  # 110 s > 100 s: said


def test_planner_charges_one_compilation_per_distinct_shape() -> None:
    overheads = {
        "model_build_seconds": 1.0,
        "checkpoint_save_seconds": 0.5,
        "warmup_extra_seconds": 0.2,
        "compile_seconds_per_shape": 7.0,
    }
    calibration = Calibration(
        synthetic_calibration(overheads=overheads, training={"method": "full", "lora": None, "compile": True})
    )
    data = tokenized(heavy_tailed())
    request = PlanRequest(epochs=1, deadline=Deadline.with_margin_share(1e6, 0.05), effective_batch=8, compiled=True)
    plan = make_plan(calibration, data, request)
    chosen = plan.chosen
    batches = plan_padded_batches(data.lengths, chosen.config.micro_batch_size, chosen.config.seq_len, seed=0, epoch=0)
    shapes = batch_shape_counts(data, batches, chosen.config.seq_len, SHAPE_BUCKET)
    assert chosen.overheads.compile_shapes == len(shapes)
    assert chosen.overheads.compile_seconds == pytest.approx(7.0 * len(shapes))
    assert chosen.overheads.total_seconds >= chosen.overheads.compile_seconds
    eager = make_plan(
        Calibration(synthetic_calibration(overheads=overheads)),
        data,
        PlanRequest(epochs=1, deadline=Deadline.with_margin_share(1e6, 0.05), effective_batch=8),
    ).chosen
    assert eager.overheads.compile_seconds == 0.0 and eager.overheads.compile_shapes == 0


@needs_compiler
def test_compiled_step_computes_what_the_eager_step_does() -> None:
    from accelerate import Accelerator

    from benchtrain.train.step.engine import StepOptions, engine_from_options
    from benchtrain.train.workload.batching import SyntheticBatches
    from benchtrain.train.workload.model import resolve_model

    losses = {}
    for mode in ("off", "on"):
        torch.manual_seed(0)
        engine = engine_from_options(
            resolve_model("tiny"), MethodConfig(), Accelerator(cpu=True), StepOptions(compile=mode)
        )
        assert engine.setup.compiled == (mode == "on") and engine.setup.loss == "chunked"
        batch = SyntheticBatches(1, 2, 64, 320)[0]
        losses[mode] = [engine.step.run(iter([batch, batch]), 2).loss for _ in range(3)]
    np.testing.assert_allclose(losses["on"], losses["off"], rtol=1e-4)
    assert losses["on"][2] < losses["on"][0]  # it trains


@pytest.fixture()
def compile_home(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCHTRAIN_HOME", str(tmp_path / "home"))
    return tmp_path


@pytest.mark.slow
@needs_compiler
def test_bench_and_train_with_a_compiled_step(compile_home, capsys) -> None:
    """bench measures compilation per shape and records it; train plans it, runs compiled, and a
    run that would be eager is refused against a compiled calibration."""
    # Two shapes, each probed at two accumulations: the second probe of a shape compiles nothing.
    argv = [
        "run",
        "--gpu",
        "cpu",
        "--compile",
        "on",
        "--batch-sizes",
        "1,2",
        "--seq-lens",
        "64",
        "--workers",
        "0",
        "--accum",
        "1,2",
        "--no-report",
        "--quiet",
    ]
    code, _, err = run_main("bench", argv, capsys)
    assert code == 0, err
    (path,) = (compile_home / "home" / "calibrations").glob("*.json")
    calibration = json.loads(path.read_text())
    # --loss auto: the loss is the one the comparison measured fastest (which one is the machine's call).
    assert (
        calibration["training"]["compile"] is True
        and calibration["training"]["loss"] == calibration["loss_choice"]["chosen"]
    )
    assert calibration["training"]["compile_cache"]["host"] == socket.gethostname()
    overheads = calibration["overheads"]
    rows = calibration["measurements"]
    # The drift reference probe compiles the first shape; the rows hold the others' first probes.
    assert overheads["compile_shapes_measured"] == sum(1 for row in rows if row.get("new_shape")) >= 1
    assert any(not row.get("new_shape") for row in rows)  # warm-up measured where nothing compiled
    # both depend on what inductor has cached
    assert overheads["compile_seconds_per_shape"] >= 0 and overheads["warmup_extra_seconds"] >= 0
    assert "compile_cached_seconds_per_shape" in overheads

    out = compile_home / "run"
    base = [
        "--use-calibration",
        "latest",
        "--data",
        "sample",
        "--deadline",
        "30m",
        "--max-length",
        "64",
        "--effective-batch",
        "2",
        "--no-report",
    ]
    code, printed, err = run_main("train", [*base, "--compile", "on", "--max-steps", "3", "--out", str(out)], capsys)
    assert code == 0, err
    assert "compile" in printed  # the overheads line names it
    record = json.loads((out / "run.json").read_text())
    assert record["training"]["compile"] is True
    assert record["estimate"]["overheads"]["compile_shapes"] >= 1
    assert record["actual"]["batch_shapes"] >= 1  # packed rows: one shape, and the last batch's
    actual = record["actual"]  # train.step.metrics figures over the run
    assert actual["tflops"] > 0 and actual["mfu"] is None  # no peak-FLOPs entry for a CPU
    assert 0 <= actual["data_wait_share"] <= 1 and actual["peak_memory_bytes"] > 0

    code, _, err = run_main("train", [*base, "--dry-run"], capsys)  # auto on CPU: eager
    assert_one_line_error(code, err, "--compile on")


def test_a_calibration_of_another_step_is_refused_or_said() -> None:
    from types import SimpleNamespace

    from benchtrain.calibration.hardware import Hardware
    from benchtrain.common.errors import BenchtrainError
    from benchtrain.train.recipes.choice import check_compatible
    from benchtrain.train.workload.method import MethodConfig

    spec = SimpleNamespace(fingerprint="abc", name="tiny")
    hardware = Hardware.from_record({"name": "Test CPU", "device_type": "cpu"})
    eager_plain = Calibration(
        synthetic_calibration(training={"method": "full", "lora": None, "compile": False, "loss": "plain"})
    )
    notes = check_compatible(eager_plain, spec, hardware, False, MethodConfig(), compiled=False, loss="chunked")
    assert any("plain loss" in note and "uses chunked" in note for note in notes)
    with pytest.raises(BenchtrainError, match="--compile off"):
        check_compatible(eager_plain, spec, hardware, False, MethodConfig(), compiled=True, loss="plain")
    assert check_compatible(eager_plain, spec, hardware, False, MethodConfig(), compiled=False, loss="plain") == []
