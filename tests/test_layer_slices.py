"""Issue 40: calibrate a model on layer slices of its real architecture and plan the whole.

The fit (rows with a known fixed + per-layer truth recover it), the refusal of architectures whose
layers differ, the memory check's device count for a model too big for one (simulated) H100, and a
slice calibration driving `train --dry-run` of the whole model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import assert_one_line_error, run_main

from benchtrain.bench.layer_slices import auto_depths, choose_depths, non_uniform_reason, parse_layers, slice_spec
from benchtrain.calibration.hardware import Hardware
from benchtrain.calibration.slices import UNTESTED_SLICE_ERROR, DepthLine, derive_full_rows, slice_widening
from benchtrain.calibration.step_config import StepConfig
from benchtrain.common.errors import BenchtrainError, DoesNotFitError
from benchtrain.train.planning.memory_check import check_fits, gpus_needed, memory_need, meta_model
from benchtrain.train.workload.method import MethodConfig
from benchtrain.train.workload.model import PRESETS, ModelSpec, model_shape, resolve_model

GIB = 2**30
CONFIGS = [StepConfig(b, 0, a, s) for b in (1, 4) for a in (1, 2) for s in (128, 512)]


def truth(config: StepConfig, layers: int) -> tuple[float, float]:
    """(step seconds, activation bytes) of a model `layers` deep: a fixed part and a per-layer part,
    both depending on the configuration as a step does."""
    tokens = config.micro_batch_size * config.seq_len
    step = config.grad_accum * (0.010 + 2e-6 * tokens + layers * (0.002 + 4e-6 * tokens)) + 0.003
    activations = 50e6 + 3000.0 * tokens + layers * 9000.0 * tokens
    return step, activations


def static_of(layers: int) -> float:
    return 1e9 + layers * 2e8


def synthetic_depth_rows(depths: tuple[int, ...], wait_seconds: float = 0.0) -> dict[int, list[dict[str, Any]]]:
    """Each configuration at each depth as the truth says, waiting `wait_seconds` a step for data."""
    rows: dict[int, list[dict[str, Any]]] = {}
    for depth in depths:
        rows[depth] = []
        for config in CONFIGS:
            step, activations = truth(config, depth)
            rows[depth].append(
                {
                    **config.to_row(),
                    "status": "ok",
                    "step_seconds": step,
                    "step_seconds_mean": step * 1.05,
                    "peak_memory_bytes": static_of(depth) + activations,
                    "data_wait_share": wait_seconds / step,
                }
            )
    return rows


def test_lines_in_depth_recover_a_known_fixed_and_per_layer_part() -> None:
    static = {depth: static_of(depth) for depth in (2, 4, 6, 32)}
    fitted = derive_full_rows(synthetic_depth_rows((2, 4, 6), wait_seconds=0.002), 32, static)
    assert len(fitted.rows) == len(CONFIGS)
    for row, terms in zip(fitted.rows, fitted.per_config, strict=True):
        config = StepConfig.from_row(row)
        step, activations = truth(config, 32)
        assert row["step_seconds"] == pytest.approx(step, rel=1e-9)
        assert row["peak_memory_bytes"] == pytest.approx(static_of(32) + activations, rel=1e-9)
        assert row["from_slices"]["depths"] == [2, 4, 6]
        # The per-layer part is the truth's, the tail (mean / median) and the data wait's seconds carry over.
        tokens = config.micro_batch_size * config.seq_len
        assert terms["per_layer_seconds"] == pytest.approx(config.grad_accum * (0.002 + 4e-6 * tokens))
        assert terms["per_layer_activation_bytes"] == pytest.approx(9000.0 * tokens)
        assert row["step_seconds_mean"] == pytest.approx(1.05 * step)
        assert row["data_wait_share"] * row["step_seconds"] == pytest.approx(0.002)
    # Three depths: the 6-layer probes were predicted from the 2 and 4-layer ones, exactly here.
    assert fitted.held_out_time.count == len(CONFIGS) and fitted.held_out_time.max_abs_pct < 1e-6
    assert fitted.held_out_memory.count == len(CONFIGS) and fitted.held_out_memory.max_abs_pct < 1e-6


def test_the_held_out_depth_measures_how_far_the_extrapolation_misses() -> None:
    rows = synthetic_depth_rows((2, 4, 6))
    for row in rows[6]:
        row["step_seconds"] *= 0.9  # the deepest slice 10% faster than the line through 2 and 4 says
    fitted = derive_full_rows(rows, 32, {depth: static_of(depth) for depth in (2, 4, 6, 32)})
    assert fitted.held_out_time.median_abs_pct == pytest.approx(100 / 0.9 - 100, rel=1e-6)
    # Two depths only: nothing held out.
    two = derive_full_rows(synthetic_depth_rows((2, 4)), 32, {depth: static_of(depth) for depth in (2, 4, 32)})
    assert two.held_out_time.count == 0


def test_a_line_in_depth_never_falls_and_needs_two_depths() -> None:
    assert DepthLine.fit([2, 4], [1.0, 0.8]) == DepthLine(0.9, 0.0)
    with pytest.raises(ValueError, match="two distinct depths"):
        DepthLine.fit([4, 4], [1.0, 1.1])


def test_plans_widen_by_the_slices_measured_error() -> None:
    data = {
        "slices": {
            "depths": [2, 4, 6],
            "full_layers": 24,
            "held_out": {"time": {"p90_abs_pct": 5.0, "count": 8}, "memory": {"p90_abs_pct": 1.0, "count": 8}},
        }
    }
    # 5% at 6 layers, stretched by 1 + log2(24 / 6) = 3: 15%, on top of the fit's own 10%.
    assert slice_widening(data, 0.10) == pytest.approx(1.10 * 1.15 - 1)
    assert slice_widening(data, 0.10, "memory") == pytest.approx(1.10 * 1.03 - 1)
    assert slice_widening({}, 0.10) == 0.10
    untested = {"slices": {"depths": [2, 4], "full_layers": 4, "held_out": {"time": {}, "memory": {}}}}
    assert slice_widening(untested, 0.0) == pytest.approx(UNTESTED_SLICE_ERROR)


def test_a_slice_is_the_real_config_cut_to_k_layers() -> None:
    gpt2 = slice_spec(resolve_model("gpt2"), 2)
    assert (
        gpt2.config_dict["n_layer"] == 2
        and gpt2.config_dict["n_embd"] == 768
        and gpt2.config_dict["vocab_size"] == 50257
    )
    llama = slice_spec(resolve_model("llama-3.1-8b"), 3)
    shape = model_shape(meta_model(llama, MethodConfig(method="lora")))
    assert shape.layers == 3 and shape.heads == 32 and shape.adapter_parameter_count > 0
    assert llama.fingerprint != resolve_model("llama-3.1-8b").fingerprint
    qwen = ModelSpec(
        "q",
        {
            "model_type": "qwen2",
            "num_hidden_layers": 4,
            "layer_types": ["full_attention"] * 4,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "intermediate_size": 128,
            "vocab_size": 100,
        },
    )
    assert slice_spec(qwen, 2).config_dict["layer_types"] == ["full_attention"] * 2


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        (
            {
                "model_type": "gemma2",
                "num_hidden_layers": 4,
                "hidden_size": 64,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "head_dim": 16,
            },
            "layer_types",
        ),
        (
            {
                "model_type": "qwen2",
                "num_hidden_layers": 4,
                "use_sliding_window": True,
                "sliding_window": 64,
                "max_window_layers": 2,
            },
            "layer_types",
        ),
        ({"model_type": "deepseek_v3", "num_hidden_layers": 4, "first_k_dense_replace": 1}, "first_k_dense_replace"),
        ({"model_type": "qwen2_moe", "num_hidden_layers": 4, "decoder_sparse_step": 2}, "decoder_sparse_step"),
    ],
)
def test_architectures_whose_layers_differ_are_measured_whole(
    config: dict[str, Any], reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = ModelSpec("mixed", config)
    assert reason in (non_uniform_reason(spec) or "")
    depths, rule = choose_depths(None, spec, MethodConfig(), (1, 2), None)
    assert depths is None and reason in rule
    said = [line for line in capsys.readouterr().err.splitlines() if "cannot be measured on slices" in line]
    assert len(said) == 1 and "measuring the whole model" in said[0]


def test_uniform_architectures_take_slices() -> None:
    for name in ("gpt2", "llama-3.1-8b", "qwen2.5-7b", "mistral-7b"):
        assert non_uniform_reason(resolve_model(name)) is None


@pytest.mark.parametrize(
    ("text", "fragment"),
    [("4", "two or more"), ("0,2", "positive"), ("two,4", "auto or a list"), ("3,3", "two or more")],
)
def test_bad_layers_are_one_line(text: str, fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(BenchtrainError, match=fragment):
        parse_layers(text)
    code, _, err = run_main("bench", ["run", "--layers", text], capsys)
    assert_one_line_error(code, err, fragment)
    assert parse_layers("6,2,4") == (2, 4, 6) and parse_layers("auto") == "auto"


def h100() -> dict[str, Any]:
    from simulated import H100Measurements

    return H100Measurements.load().hardware


def test_the_memory_check_says_how_many_h100s_a_model_too_big_for_one_needs() -> None:
    hardware = Hardware.from_record(h100())
    eight = memory_need(resolve_model("llama-3.1-8b"), MethodConfig(), "cuda")
    assert gpus_needed(eight, hardware) == 2  # 8B × 16 bytes ≈ 120 GiB: two 80 GB shards
    seventy_spec = resolve_model("llama-3.1-70b")
    seventy = memory_need(seventy_spec, MethodConfig(), "cuda")
    count = gpus_needed(seventy, hardware)
    assert count is not None and count > 10
    assert (
        seventy.per_process_bytes("fsdp", count, "cuda")
        <= hardware.memory_bytes
        < seventy.per_process_bytes("fsdp", count - 1, "cuda")
    )
    assert gpus_needed(memory_need(resolve_model("llama-3.2-1b"), MethodConfig(), "cuda"), hardware) == 1
    with pytest.raises(
        DoesNotFitError,
        match=rf"--num_processes {count} .*; it needs {count} of these devices under FSDP \(≈\d+\.\d GiB per process",
    ):
        check_fits(seventy_spec, MethodConfig(), hardware)
    # Slices of it do fit: auto takes the deepest ladder whose deepest slice leaves room for activations.
    assert auto_depths(resolve_model("llama-3.1-8b"), MethodConfig(), h100(), (1, "none")) == (2, 4, 6)
    assert auto_depths(seventy_spec, MethodConfig(), h100(), (1, "none")) == (1, 2)


@pytest.fixture()
def deep_tiny(monkeypatch: pytest.MonkeyPatch) -> str:
    """The tiny preset 8 layers deep (byte tokenizer, CPU-fast)."""
    monkeypatch.setitem(
        PRESETS, "tiny-deep", {**PRESETS["tiny"], "num_hidden_layers": 8, "hidden_size": 64, "intermediate_size": 172}
    )
    return "tiny-deep"


@pytest.mark.slow  # two benches of a tiny model and a dry run: about 30 s on a busy 2-core machine
def test_a_slice_calibration_drives_a_dry_run_of_the_whole_model(
    home: Path, deep_tiny: str, capsys: pytest.CaptureFixture[str]
) -> None:
    grid = [
        "--batch-sizes",
        "1,2",
        "--seq-lens",
        "32,64",
        "--accum",
        "1",
        "--workers",
        "0",
        "--max-probe-seconds",
        "0.2",
        "--no-report",
        "--quiet",
    ]
    code, out, err = run_main("bench", ["run", "--gpu", "cpu", "--model", deep_tiny, "--layers", "2,4", *grid], capsys)
    assert code == 0, err
    assert "layer slices of 2, 4" in out
    path = next((home / "calibrations").glob("*.json"))
    data = json.loads(path.read_text())
    whole = resolve_model(deep_tiny)
    # The calibration is the whole model's: train finds it for that model, and plans its bytes.
    assert data["model"]["fingerprint"] == whole.fingerprint and data["model"]["layers"] == 8
    assert data["training"]["trainable_parameters"] == memory_need(whole, MethodConfig(), "cpu").trainable_parameters
    assert data["slices"]["depths"] == [2, 4] and data["slices"]["full_layers"] == 8
    assert all(row["from_slices"]["depths"] == [2, 4] for row in data["measurements"])
    assert not list((home / "calibrations" / "unfinished").glob("*.json"))  # every depth's kept rows are gone
    code, out, err = run_main(
        "train",
        ["--use-calibration", "latest", "--model", deep_tiny, "--data", "sample", "--deadline", "24h", "--dry-run"],
        capsys,
    )
    assert code == 0, err
    assert data["id"] in out and "layer slices of 2, 4 of its 8" in out
    from benchtrain.calibration.model import Calibration

    cal = Calibration(data)
    # Two depths: nothing held out, so the bound widens by the assumed error, stretched to 8 layers.
    own = slice_widening({}, max(0.02, data["fit"]["held_out_error"]["p90_abs_pct"] / 100))
    assert cal.relative_bound == pytest.approx((1 + own) * (1 + UNTESTED_SLICE_ERROR * 2) - 1)


@pytest.mark.slow  # three simulated benches of an 8B shape (meta builds, the fit): about 20-30 s on a busy machine
def test_full_fine_tuning_too_big_for_one_simulated_h100_is_calibrated_on_slices_and_its_dry_run_counts_the_devices(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from simulated import simulated_h100
    from simulated_slices import simulate_slices

    from benchtrain.calibration.model import Calibration
    from benchtrain.calibration.store import save_calibration

    record, _, _ = simulate_slices("llama-3.1-8b", False, 300.0, (2, 4, 6))
    assert record["slices"]["gpus_needed"] == 2 and record["model"]["layers"] == 32
    # The simulated H100's own step and peak at full depth (its physics is linear in layers): the slices predict them.
    device, *_ = simulated_h100("llama-3.1-8b", False)
    cal = Calibration(record)
    for row in record["measurements"]:
        config = StepConfig.from_row(row)
        assert cal.throughput.micro_step_seconds(config) * config.grad_accum == pytest.approx(
            device.step_seconds(config), rel=0.03
        )
        assert row["peak_memory_bytes"] == pytest.approx(device.peak_bytes(config), rel=0.001)
    record.pop("left_out_configs")
    path = save_calibration(record)
    code, _, err = run_main(
        "train",
        [
            "--use-calibration",
            str(path),
            "--model",
            "llama-3.1-8b",
            "--data",
            "sample",
            "--deadline",
            "24h",
            "--dry-run",
        ],
        capsys,
    )
    assert_one_line_error(code, err, "it needs 2 of these devices under FSDP", expected_code=code)
    assert code != 0


def ok_probes(record: dict[str, Any]) -> int:
    return sum(1 for row in record["measurements"] if row["status"] == "ok" and "predicted" in row)


@pytest.mark.slow  # four simulated benches of an 8B shape: about 15 s each on a busy 2-core machine
@pytest.mark.parametrize(("budget", "times"), [(120, 3), (300, 2)], ids=["2m", "5m"])
def test_slices_buy_three_times_the_probes_of_a_whole_model_bench_on_a_simulated_h100(
    budget: int, times: int, home: Path
) -> None:
    """Issue 40's `bench run --model llama-3.1-8b --lora --budget 2m --layers auto` on the simulated
    H100: one process benches the depths, so the block compiled at one depth is compiled for the
    next (the device still charges COMPILE_SECONDS per new shape of the process), the checkpoint and
    compile-cache timings are made once, and the budget is split by the planner's prices.

    2 minutes: 12 probes on slices (the one shape the budget compiles, its 4 configurations at each
    depth) against the whole model's 4. 5 minutes: 40 against 18, not 3×: slices and the whole model
    alike pay COMPILE_SECONDS per shape and measure 4 configurations of each shape (workers ×
    accumulation), so 54 probes would need every depth to run 5 compiled shapes' 20 configurations;
    the compilations alone take 200 of the 300 seconds."""
    from simulated import COMPILE_SECONDS, simulate_bench, simulated_h100
    from simulated_slices import simulate_slices

    from benchtrain.calibration.model import Calibration
    from benchtrain.calibration.store import save_calibration

    whole, _ = simulate_bench("llama-3.1-8b", lora=True, budget=budget)
    record, depths, seconds = simulate_slices("llama-3.1-8b", True, float(budget), "auto")
    assert sorted(depths) == [2, 4, 6]
    slice_probes = sum(ok_probes(depth) for depth in depths.values())
    assert slice_probes >= times * ok_probes(whole), (slice_probes, ok_probes(whole))
    # Inside the budget, every depth with a fit of its own and the whole model's rows from them.
    assert seconds <= budget and all(depth["fit"] is not None for depth in depths.values())
    assert record["overheads"]["benchmark_seconds"] <= budget
    # Compiled once per shape for all depths, and the whole model's compilation is what that cost.
    assert record["overheads"]["compile_seconds_per_shape"] == pytest.approx(COMPILE_SECONDS, rel=0.02)
    assert sum(depth["overheads"].get("compile_shapes_measured", 0) for depth in depths.values()) == len(
        {
            (r["micro_batch_size"], r["seq_len"], r["gradient_checkpointing"])
            for depth in depths.values()
            for r in depth["measurements"]
            if r["status"] == "ok"
        }
    )
    # A usable calibration of the whole model whose predictions hold within its own recorded bound.
    cal = Calibration(json.loads(save_calibration(record).read_text()))
    device, *_ = simulated_h100("llama-3.1-8b", True)
    assert len(cal.ok_rows()) >= 3 and record["model"]["layers"] == 32
    for row in cal.ok_rows():
        config = StepConfig.from_row(row)
        predicted = cal.throughput.micro_step_seconds(config) * config.grad_accum
        assert abs(predicted / device.step_seconds(config) - 1) <= cal.relative_bound
    assert record["overheads"]["checkpoint_bytes"] == device.checkpoint_bytes


def test_the_budget_is_split_by_the_planners_prices_and_compiles_each_shape_once() -> None:
    """bench.layer_slices: the first depth's minimum pays the compilations, the later depths probe
    the same shapes at a repeated shape's price; each depth's share covers its minimum, in
    proportion to the minimums; a budget short of them all is one line naming what they need."""
    from benchtrain.bench.choose import ProbePlanner, shape_of
    from benchtrain.bench.cost import COMPILE_PRIOR_SECONDS, CostModel, DeviceSpeed
    from benchtrain.bench.layer_slices import depth_share, price_depths, refuse_if_unaffordable
    from benchtrain.bench.space import SearchSpace
    from benchtrain.bench.timing import ProbeSettings
    from benchtrain.bench.variant_measurement import Carry

    def planner(layers: int) -> ProbePlanner:
        cost = CostModel(lambda config: 1e9 * (2 + layers), DeviceSpeed(1e13, "test"), ProbeSettings(), compiled=True)
        return ProbePlanner(SearchSpace((1, 2), (0,), (1, 2), (64, 128)), cost)

    planners = {depth: planner(depth) for depth in (2, 4, 6)}
    prices = price_depths({depth: (p, 1.0, 0.5) for depth, p in planners.items()})
    first, *later = (prices[depth] for depth in (2, 4, 6))
    assert first > COMPILE_PRIOR_SECONDS > max(later)  # one compilation, at the first depth
    budget = 2 * sum(prices.values())
    shares = [depth_share(budget - sum(prices[d] * 2 for d in (2, 4, 6)[:i]), prices, (2, 4, 6)[i:]) for i in range(3)]
    assert shares == pytest.approx([2 * prices[d] for d in (2, 4, 6)])
    with pytest.raises(
        BenchtrainError,
        match=r"--budget .* cannot pay for a minimum calibration at each of the slice depths 2, 4, 6 of m: they need",
    ):
        refuse_if_unaffordable(prices, sum(prices.values()) * 0.9, "m")
    # What a depth leaves the next: the shapes it ran (priced as compiled) and the compilation it measured.
    from benchtrain.bench.calibrate import BenchTask

    small, large = StepConfig(1, 0, 1, 64), StepConfig(2, 0, 1, 128)
    assert planners[4].price(small) > COMPILE_PRIOR_SECONDS
    planners[2].seen_shapes.add(shape_of(small))
    carry = Carry()
    carry.done(planners[2])
    carry.one_off = True
    task = carry.prepare(
        BenchTask(SearchSpace((1,), (0,), (1,), (64,)), ProbeSettings(), {}, {}, {}, {}, "test"), planners[4]
    )
    assert task.one_off_timings and planners[4].price(small) < COMPILE_PRIOR_SECONDS < planners[4].price(large)
    seen = {shape_of(large)}
    carry.seed(seen)
    assert shape_of(small) in seen  # a workload's shapes run: (rows, length, switches on), as the planner keys them


def test_a_budget_too_small_for_every_depth_is_one_line_before_anything_is_built(
    home: Path, deep_tiny: str, capsys: pytest.CaptureFixture[str]
) -> None:
    grid = ["--batch-sizes", "1,2", "--seq-lens", "32,64", "--accum", "1", "--workers", "0", "--no-report", "--quiet"]
    code, _, err = run_main(
        "bench", ["run", "--gpu", "cpu", "--model", deep_tiny, "--layers", "2,4", "--budget", "0.5s", *grid], capsys
    )
    assert_one_line_error(
        code, err, "cannot pay for a minimum calibration at each of the slice depths 2, 4 of tiny-deep"
    )
    assert "building" not in err
