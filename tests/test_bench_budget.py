"""`bench run` at our users' scale (issue 21): probes priced before they run, timed as long as the
statistics need, chosen for what the fit learns per second, and never past the budget. The 8B and
12B cases run on a simulated H100 (tests/simulated.py: the real H100 measurements scaled by FLOPs) on
a virtual clock, through the same planner, runner, timing loop and fit as a real run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from simulated import COMPILE_SECONDS, simulate_bench

from benchtrain.bench.choose import ProbePlanner
from benchtrain.bench.cost import CostModel, DeviceSpeed
from benchtrain.bench.space import SearchSpace
from benchtrain.bench.timing import ProbeSettings, StepTiming, time_steps
from benchtrain.calibration.model import Calibration
from benchtrain.calibration.step_config import StepConfig
from benchtrain.common.errors import BenchtrainError
from benchtrain.train.step.step import StepResult

GIB = 2**30


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def steps_of(clock: FakeClock, seconds: list[float]) -> Any:
    durations = iter(seconds)

    def run() -> StepResult:
        value = next(durations)
        clock.now += value
        return StepResult(value, 0.0, 1.0, 0, 0, 1)

    return run


def test_a_steady_expensive_step_is_timed_twice_and_a_noisy_cheap_one_until_its_median_is_known() -> None:
    clock = FakeClock()
    gpu = ProbeSettings(warmup_steps=1, min_steps=3, max_steps=30, max_seconds=10.0)
    # 15 s steps steady to 0.1%: one warm-up, then two timed steps (three would pass the 10 s share).
    timing = time_steps(steps_of(clock, [55.0, 15.0, 15.01, 15.0, 15.02]), gpu, clock)
    assert (timing.warmup_steps, len(timing.step_seconds), timing.stop_reason) == (1, 2, "converged")
    # 20 ms steps scattering by ±10%: many more, until the median's standard error is below 1%.
    clock = FakeClock()
    noisy = [0.02 * (1 + 0.1 * ((i * 7) % 5 - 2) / 2) for i in range(40)]
    cpu = ProbeSettings(warmup_steps=1, min_steps=3, max_steps=30, max_seconds=10.0)
    timing = time_steps(steps_of(clock, noisy), cpu, clock)
    assert len(timing.step_seconds) > 10
    assert timing.record()["median_standard_error"] <= 0.01 or timing.stop_reason == "max steps"


def test_no_step_starts_that_the_time_limit_cannot_pay_for() -> None:
    clock = FakeClock()
    settings = ProbeSettings(
        warmup_steps=1,
        min_steps=3,
        max_steps=30,
        max_seconds=100.0,
        time_limit_seconds=40.0,
        expected_step_seconds=10.0,
    )
    timing = time_steps(steps_of(clock, [12.0, 10.0, 10.0, 10.0, 10.0]), settings, clock)
    assert clock.now <= 40.0
    assert timing.stop_reason == "time limit" and len(timing.step_seconds) == 2
    # The warm-up alone used the limit: no timed step, and the probe says so.
    clock = FakeClock()
    tight = ProbeSettings(warmup_steps=1, time_limit_seconds=15.0, expected_step_seconds=10.0)
    timing = time_steps(steps_of(clock, [12.0, 10.0]), tight, clock)
    assert not timing.complete and timing.stop_reason == "time limit"


def test_a_first_timed_step_still_warming_up_is_moved_to_the_warm_up() -> None:
    clock = FakeClock()
    settings = ProbeSettings(warmup_steps=1, min_steps=4, max_steps=4, max_seconds=100.0)
    timing = time_steps(steps_of(clock, [9.0, 3.0, 1.0, 1.0, 1.0]), settings, clock)
    assert timing.warmup_steps == 2 and timing.step_seconds == [1.0, 1.0, 1.0]
    assert isinstance(timing, StepTiming)


def flops_planner(space: SearchSpace, compiled: bool = False) -> ProbePlanner:
    return ProbePlanner(
        space, CostModel(lambda config: 1e9, DeviceSpeed(1e12, "test"), ProbeSettings(), compiled=compiled)
    )


def test_prices_start_from_flops_and_follow_the_measurements() -> None:
    planner = flops_planner(SearchSpace((1, 4), (0,), (1,), (64, 256)), compiled=True)
    small = StepConfig(micro_batch_size=1, num_workers=0, grad_accum=1, seq_len=64)
    large = StepConfig(micro_batch_size=4, num_workers=0, grad_accum=1, seq_len=256)
    assert planner.cost.step_seconds(large) == pytest.approx(16 * planner.cost.step_seconds(small))
    assert not planner.cost.measured and "prior" in planner.cost.source
    # The device turns out 10x slower than the prior, plus a fixed 50 ms: prices follow.
    for config in (small, large):
        step = 0.05 + 10 * planner.cost.step_flops(config) / 1e12
        row = {
            **config.to_row(),
            "status": "ok",
            "step_seconds": step,
            "first_step_seconds": step + 20.0,
            "timed_steps": 4,
            "warmup_steps": 1,
        }
        planner.record({**row, "probe_seconds": 20.0 + 5 * step, "new_shape": True})
    assert planner.cost.measured
    wide_short = StepConfig(micro_batch_size=4, num_workers=0, grad_accum=1, seq_len=64)
    assert planner.cost.step_seconds(wide_short) == pytest.approx(0.05 + 10 * 4 * 64 * 1e9 / 1e12, rel=1e-3)
    # A compiled step's new shape costs the compilation measured; a repeated one does not.
    assert (
        planner.price(wide_short)
        > 20.0
        > planner.price(StepConfig(micro_batch_size=1, num_workers=0, grad_accum=2, seq_len=64))
    )


def test_the_first_probes_are_cheap_and_cover_both_checkpointing_modes() -> None:
    space = SearchSpace((1, 2, 4, 8), (0, 2), (1, 2), (64, 128, 256), (0, 1))
    planner = flops_planner(space)
    chosen = [config for config, _ in planner.preview(None, stop_when_viable=True)]
    assert len(chosen) >= 3 and {c.gradient_checkpointing for c in chosen} == {0, 1}
    cheapest = min(planner.price(c) for c in space.all_configs())
    assert planner.price(chosen[0]) == cheapest


def check_simulated_calibration(record: dict[str, Any], device: Any, budget_seconds: float, home: Path) -> Calibration:
    """The promises of issue 21 on a simulated run."""
    limit = device.hardware["memory_bytes"]
    probes = [row for row in record["measurements"] if "predicted" in row]
    assert len([row for row in probes if row["status"] == "ok"]) >= 3
    # No probe crossed the budget; the whole benchmark ended inside it.
    assert all(entry["ended"] <= budget_seconds for entry in device.log)
    assert device.clock() <= budget_seconds and record["overheads"]["benchmark_seconds"] <= budget_seconds
    # None was predicted past the 80 GB, and none ran out of memory.
    assert all(row["predicted"]["peak_memory_bytes"] <= limit for row in probes)
    assert not [row for row in record["measurements"] if row["status"] == "oom"]
    # Every probe says how it was timed.
    assert all(row["timing_stop"] and row["warmup_steps"] >= 1 for row in probes if row["status"] == "ok")
    from benchtrain.calibration.store import save_calibration

    path = save_calibration(record)
    calibration = Calibration(json.loads(path.read_text()))
    assert calibration.fit["held_out_error"]["median_abs_pct"] is not None
    assert calibration.fit["memory"]["held_out_error"]["median_abs_pct"] is not None
    return calibration


@pytest.mark.slow
def test_llama_8b_lora_with_and_without_checkpointing_in_5_minutes_on_a_simulated_h100(home: Path) -> None:
    record, device = simulate_bench("llama-3.1-8b", lora=True, budget=300, checkpointing=(0, 1))
    calibration = check_simulated_calibration(record, device, 300, home)
    assert set(calibration.measured_values("gradient_checkpointing")) == {0, 1}
    # The compilation the simulated device charges per shape was measured, not assumed.
    assert record["overheads"]["compile_seconds_per_shape"] == pytest.approx(COMPILE_SECONDS, rel=0.02)
    # Plan-relevant sizes: a micro-batch of several thousand tokens was measured in each mode.
    for mode in (0, 1):
        largest = max(
            r["micro_batch_size"] * r["seq_len"] for r in calibration.ok_rows() if r["gradient_checkpointing"] == mode
        )
        assert largest >= 2048


@pytest.mark.slow
def test_mistral_nemo_12b_lora_in_5_minutes_on_a_simulated_h100(home: Path) -> None:
    record, device = simulate_bench("mistral-nemo-12b", lora=True, budget=300)
    check_simulated_calibration(record, device, 300, home)


def test_a_budget_too_small_for_any_fit_is_refused_before_the_model_is_built() -> None:
    said: list[str] = []
    with pytest.raises(BenchtrainError, match=r"cannot pay for even a minimum calibration.*use --budget") as refused:
        simulate_bench("llama-3.1-8b", lora=True, budget=45, checkpointing=(0, 1), say=said.append)
    assert "needs ≈" in str(refused.value) and "\n" not in str(refused.value)
    assert any("the whole grid" in line for line in said)


def test_budget_auto_pays_for_a_calibration_and_stays_inside_it(home: Path) -> None:
    said: list[str] = []
    record, device = simulate_bench("llama-3.1-8b", lora=True, budget="auto", say=said.append)
    budget = record["search"]["budget_seconds"]
    assert record["search"]["budget_auto"] is True and budget > 60
    assert any(line.startswith("--budget auto:") for line in said)
    check_simulated_calibration(record, device, budget, home)


def test_a_budget_that_cannot_reach_both_checkpointing_modes_keeps_the_one_it_measured(home: Path) -> None:
    """2 minutes for llama-3.1-8b: the build and one compilation leave no room for the second
    mode's compilation. The minimum settles for the measured mode, says so, and stores a calibration
    instead of spending the budget and failing."""
    record, device = simulate_bench("llama-3.1-8b", lora=True, budget=120, checkpointing=(0, 1))
    calibration = check_simulated_calibration(record, device, 120, home)
    assert len(calibration.measured_values("gradient_checkpointing")) == 1
    assert any("budget could not pay" in warning for warning in record["warnings"])


def busy_then_quiet_probe(clock: Any, disturbed: int, slower: float = 60.0) -> Any:
    """A probe on a virtual clock: the first `disturbed` probes run `slower` times slower (two CPU
    hogs start with the benchmark), the rest at the machine's quiet speed."""
    calls: list[StepConfig] = []

    def probe(config: StepConfig, remaining: float | None) -> dict[str, Any]:
        factor = slower if len(calls) < disturbed else 1.0
        calls.append(config)
        step = factor * (0.01 + 2e-5 * config.micro_batch_size * config.seq_len) * config.grad_accum
        seconds = 6 * step + 0.1 * factor
        clock.advance(seconds)
        tokens = config.micro_batch_size * config.seq_len * config.grad_accum
        return {
            **config.to_row(),
            "status": "ok",
            "step_seconds": step,
            "tokens_per_second": tokens / step,
            "peak_memory_bytes": 1e6,
            "probe_seconds": seconds,
            "first_step_seconds": step,
            "timed_steps": 5,
            "warmup_steps": 1,
        }

    probe.calls = calls  # type: ignore[attr-defined]
    return probe


@pytest.mark.parametrize("before_the_grid", [0, 4], ids=["first-probe", "loss-comparison"])
def test_one_disturbed_price_does_not_end_the_benchmark(before_the_grid: int) -> None:
    """Issue 38: on a 2-core machine with two CPU hogs, bench priced every probe from its first,
    disturbed ones and gave up on a minimum viable fit ("only 0 of 0 probes succeeded") with most
    of its budget left. A size measured again at the quiet speed replaces the disturbed price, and
    prices decide a give-up only once two probes of the grid measured them. `before_the_grid`:
    the loss comparison's probes (at one configuration, all in the busy moment) came first."""
    from simulated import VirtualClock

    from benchtrain.bench.runner import Budget, run_grid

    clock = VirtualClock()
    space = SearchSpace((1, 2, 4, 8), (0, 2), (1, 2), (64, 128, 256))
    planner = flops_planner(space)
    probe = busy_then_quiet_probe(
        clock, disturbed=max(1, before_the_grid), slower=300.0 if before_the_grid == 0 else 1000.0
    )
    cheapest = StepConfig(micro_batch_size=1, num_workers=0, grad_accum=1, seq_len=64)
    for _ in range(before_the_grid):
        planner.cost.observe(probe(cheapest, None))
    budget = Budget(150.0, clock=clock)  # from the grid's start
    result = run_grid(space, probe, budget, planner=planner, reference_every=None)
    # the cheapest first, priced by its busy moment
    assert probe.calls[0].micro_batch_size * probe.calls[0].seq_len == 64
    assert len([row for row in result.rows if row["status"] == "ok"]) >= 3
    assert budget.elapsed() <= 150.0


def test_on_two_cores_the_probes_before_a_fit_start_no_dataloader_workers() -> None:
    """Each DataLoader worker is a process that competes with the step for one of two cores: the
    minimum viable fit is measured without them; more cores leave workers to the gain."""
    space = SearchSpace((1, 2, 4, 8), (0, 2), (1, 2), (64, 128, 256))
    few = flops_planner(space)
    few.host_cores = 2
    chosen = [config for config, _ in few.preview(None, stop_when_viable=True)]
    assert len(chosen) >= 3 and all(config.num_workers == 0 for config in chosen)
    many = flops_planner(space)
    many.host_cores = 16
    assert any(config.num_workers == 2 for config, _ in many.preview(None, stop_when_viable=False)[:6])
