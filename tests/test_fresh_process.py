"""The step measured again in fresh processes: the speed a plan uses, its bound between processes,
and the drift correction judged where a calibration is used."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import micro_seconds, run_main, synthetic_calibration, synthetic_rows

from benchtrain.bench.disturbed import correct_for_drift
from benchtrain.bench.fresh_process import PROCESSES, check_configs, measure_in_fresh_processes
from benchtrain.bench.record import fit_with_drift_choice
from benchtrain.bench.runner import Budget, run_grid
from benchtrain.bench.space import SearchSpace
from benchtrain.bench.timing import WELL_TIMED_STEP_SECONDS, ProbeSettings
from benchtrain.calibration.model import MIN_MEMORY_MARGIN, Calibration
from benchtrain.calibration.process_check import judge, median_error
from benchtrain.calibration.step_config import StepConfig
from benchtrain.train.step.engine import StepOptions
from benchtrain.train.workload.method import MethodConfig
from benchtrain.train.workload.model import resolve_model

BENCH_RSS = 400e6
# Longer sequences than the helpers' default: most steps time well (≥ 40 ms), as a CPU's do.
SEQ_LENS = (1024, 2048, 4096)


@pytest.fixture(scope="module")
def fitted() -> dict[str, Any]:
    return synthetic_calibration(synthetic_rows(seq_lens=SEQ_LENS))


@pytest.fixture
def data(fitted: dict[str, Any]) -> dict[str, Any]:
    return copy.deepcopy(fitted)


def fresh_rows(
    rows: list[dict[str, Any]], speedup: list[float], rss_before: float = BENCH_RSS, peak_scale: float = 1.0
) -> list[dict[str, Any]]:
    """What fresh processes measured at the check's configurations: the true step (tests/helpers,
    not the fit) run `speedup[i]` times faster in measurement i, alternating between two processes."""
    configs = check_configs(rows)
    by_config = {StepConfig.from_row(row): row for row in rows}
    measured = []
    for index, factor in enumerate(speedup):
        config = configs[index % len(configs)]
        step = micro_seconds(config) * config.grad_accum / factor
        peak = by_config[config]["peak_memory_bytes"] * peak_scale + (rss_before - BENCH_RSS)
        measured.append(
            {
                **config.to_row(),
                "status": "ok",
                "step_seconds": step,
                "step_seconds_mean": step,
                "tokens_per_second": config.micro_batch_size * config.seq_len * config.grad_accum / step,
                "peak_memory_bytes": peak,
                "process": index // len(configs),
                "rss_before_model_bytes": rss_before,
            }
        )
    return measured


def test_the_check_measures_well_timed_measured_configurations_at_their_quartiles() -> None:
    rows = synthetic_rows(seq_lens=SEQ_LENS)
    configs = check_configs(rows)
    steps = {StepConfig.from_row(row): row["step_seconds"] for row in rows}
    assert 2 <= len(configs) <= 3 and len(set(configs)) == len(configs)
    assert all(steps[config] >= WELL_TIMED_STEP_SECONDS for config in configs)
    assert steps[configs[0]] < steps[configs[1]] < steps[configs[-1]]
    # Steps too short to time well anywhere: nothing to check.
    assert check_configs([{**row, "step_seconds": WELL_TIMED_STEP_SECONDS / 2} for row in rows]) == []


def test_fresh_processes_spread_is_the_machines_part_of_the_bound_and_their_speed_moves_no_plan(
    data: dict[str, Any],
) -> None:
    before = Calibration(copy.deepcopy(data))
    rows = data["measurements"]
    # Six measurements, two processes, 12–20% faster than the bench process's fit.
    speedups = [1.12, 1.16, 1.20, 1.14, 1.18, 1.15]
    check = judge(data["fit"], fresh_rows(rows, speedups), BENCH_RSS)
    assert check["processes"] == PROCESSES and check["median_ratio"] == pytest.approx(np.median(speedups), rel=0.03)
    assert check["time_spread"] == pytest.approx(max(abs(s - 1) for s in speedups), abs=0.02)
    after = Calibration({**data, "process_check": check})
    config = StepConfig(micro_batch_size=4, num_workers=0, grad_accum=2, seq_len=2048)
    # A process's speed is a draw: the bound holds it, the prediction stays the fit's.
    assert after.predict(config).tokens_per_second == pytest.approx(before.predict(config).tokens_per_second)
    parts = after.bound_parts
    assert parts.fit == before.bound_parts.fit and parts.machine == pytest.approx(check["time_spread"])
    assert (
        after.relative_bound == pytest.approx(parts.fit + parts.machine) and parts.machine_source == "fresh processes"
    )
    assert before.bound_parts.machine == 0 and before.bound_parts.machine_source == "not measured"
    # Runs that used the calibration and spread wider than the fresh processes decide instead.
    history = [
        {"predicted_tokens_per_second": 1000.0, "actual_tokens_per_second": value} for value in (1000.0, 1300.0, 800.0)
    ]
    runs = Calibration({**data, "process_check": check, "history": history}).bound_parts
    assert runs.machine_source == "past runs" and runs.machine > check["time_spread"]


def test_the_memory_margin_holds_fresh_processes_peaks_their_own_baseline_counted(data: dict[str, Any]) -> None:
    rows = data["measurements"]
    # A fresh process that holds 50 MB more before its model peaks 50 MB higher: not a miss of the
    # fit (train adds its own excess the same way).
    heavier = judge(data["fit"], fresh_rows(rows, [1.0] * 6, rss_before=BENCH_RSS + 50e6), BENCH_RSS)
    assert heavier["memory_spread"] < 0.03
    # Peaks 6% above the fit in fresh processes: the margin grows by that.
    higher = judge(data["fit"], fresh_rows(rows, [1.0] * 6, peak_scale=1.06), BENCH_RSS)
    assert higher["memory_spread"] == pytest.approx(0.06, abs=0.03)
    base = Calibration(copy.deepcopy(data)).memory_margin
    assert base >= MIN_MEMORY_MARGIN
    assert Calibration({**data, "process_check": higher}).memory_margin == pytest.approx(base + higher["memory_spread"])


def test_the_drift_correction_is_judged_in_fresh_processes() -> None:
    rows = synthetic_rows(noise=0.01, seq_lens=SEQ_LENS)
    truth = copy.deepcopy(rows)
    # References that claim the machine slowed by half after the first probes: the correction
    # rescales those probes, and fresh processes (which run at the true speed) show it is wrong.
    reference = StepConfig(micro_batch_size=2, num_workers=0, grad_accum=1, seq_len=256)
    drift = correct_for_drift(rows, [(0, 1000.0), (10, 1000.0), (20, 500.0), (90, 500.0)], reference)
    assert drift["applied"]
    fresh = fresh_rows(truth, [1.0] * 6)
    fit = fit_with_drift_choice(rows, drift, {}, fresh)
    assert not drift["applied"] and drift["median_error_pct"]["judged_by"] == "fresh processes"
    errors = drift["median_error_pct"]
    assert errors["raw"] < min(errors["median"], errors["first"])
    assert [row["tokens_per_second"] for row in rows] == [row["tokens_per_second"] for row in truth]
    assert median_error(fit, fresh) < 5


def test_a_bench_process_that_slows_is_corrected_to_the_speed_it_started_at() -> None:
    """The bench process ran 20% slower from its 24th probe on (seen on a 2-core VM: its reference
    21.8k → 17.8k tokens/s, while fresh processes afterwards ran at the early speed). Corrected to
    the median reference, half the probes stay slow; to the first, the fit is what a fresh process runs."""
    rows = synthetic_rows(noise=0.005, seq_lens=SEQ_LENS)
    truth = copy.deepcopy(rows)
    for row in rows[24:]:
        row["step_seconds"] *= 1.25
        row["tokens_per_second"] /= 1.25
    references = [(position, 1000.0 if position < 24 else 800.0) for position in range(0, 48, 8)]
    reference = StepConfig(micro_batch_size=2, num_workers=0, grad_accum=1, seq_len=2048)
    drift = correct_for_drift(rows, references, reference)
    fresh = fresh_rows(truth, [1.0] * 6)
    fit = fit_with_drift_choice(rows, drift, {}, fresh)
    assert drift["applied"] and drift["level"] == "first"
    errors = drift["median_error_pct"]
    assert errors["first"] < 2 < min(errors["median"], errors["raw"])
    assert median_error(fit, fresh) < 2
    # Where the references are flat (not between the last fast one and the first slow one), every
    # probe is back at the speed the process started at.
    flat = [index for index in range(48) if not 16 < index < 24]
    assert all(
        rows[index]["tokens_per_second"] == pytest.approx(truth[index]["tokens_per_second"], rel=0.01) for index in flat
    )


def test_the_drift_reference_is_the_first_probe_whose_steps_time_well() -> None:
    def probe(config: StepConfig, _remaining: float | None) -> dict[str, Any]:
        step = 0.004 * config.micro_batch_size * config.seq_len / 64  # 4 ms at 1 × 64, 64 ms at 8 × 128
        tokens_per_second = config.micro_batch_size * config.seq_len / step
        return {
            **config.to_row(),
            "status": "ok",
            "probe_seconds": 0.1,
            "step_seconds": step,
            "tokens_per_second": tokens_per_second,
        }

    result = run_grid(SearchSpace((1, 2, 4, 8), (0,), (1,), (64, 128)), probe, Budget(None), reference_every=2)
    first_well_timed = next(
        row
        for row in sorted(result.rows, key=lambda r: r["position"])
        if row["step_seconds"] >= WELL_TIMED_STEP_SECONDS
    )
    assert result.rows[0]["step_seconds"] < WELL_TIMED_STEP_SECONDS  # the first probe was not it
    assert result.drift["reference"] == StepConfig.from_row(first_well_timed).to_row()


@pytest.fixture(scope="module")
def tiny_spec() -> Any:
    return resolve_model("tiny")


@pytest.mark.slow
def test_a_fresh_process_runs_trains_step_and_reports_its_rows(tiny_spec: Any) -> None:
    configs = [
        StepConfig(micro_batch_size=2, num_workers=0, grad_accum=2, seq_len=64),
        StepConfig(micro_batch_size=1, num_workers=1, grad_accum=1, seq_len=32),
    ]
    settings = ProbeSettings(warmup_steps=1, min_steps=2, max_steps=3, max_seconds=0.5)
    rows = measure_in_fresh_processes(tiny_spec, MethodConfig(), StepOptions(), configs, settings, 600, processes=1)
    assert [StepConfig.from_row(row) for row in rows] == configs
    assert all(row["status"] == "ok" and row["process"] == 0 and row["rss_before_model_bytes"] > 0 for row in rows)
    assert all(
        row["peak_memory_bytes"] > row["rss_before_model_bytes"] and row["step_seconds_mean"] > 0 for row in rows
    )
    # The child builds what this process builds (same parameters), and a failing child adds nothing.
    assert rows[0]["tokens_per_second"] > 0
    broken = MethodConfig(method="lora", lora_targets=("no_such_module",))
    assert measure_in_fresh_processes(tiny_spec, broken, StepOptions(), configs[:1], settings, 600, processes=1) == []


@pytest.mark.slow
def test_bench_run_on_a_cpu_records_the_check_and_plans_with_it(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("BENCHTRAIN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("BENCHTRAIN_FRESH_PROCESSES", "1")
    # Steps of 25–100 ms on a 2-core CPU (longer on a busy one): the check needs ≥ 40 ms.
    grid = [
        "--batch-sizes",
        "4,8",
        "--seq-lens",
        "128",
        "--accum",
        "1,2",
        "--workers",
        "0",
        "--max-probe-seconds",
        "0.3",
    ]
    code, _, err = run_main("bench", ["run", *grid, "--quiet", "--no-report"], capsys)
    assert code == 0, err
    record = json.loads(next((tmp_path / "home" / "calibrations").glob("cpu-tiny-*.json")).read_text())
    check = record["process_check"]
    assert check["processes"] == PROCESSES and len(check["measurements"]) >= PROCESSES
    measured = {StepConfig.from_row(row) for row in record["measurements"] if row["status"] == "ok"}
    assert {StepConfig.from_row(row) for row in check["measurements"]} <= measured
    assert len(check["speed_ratios"]) == len(check["measurements"]) and check["time_spread"] >= 0
    cal = Calibration(record)
    assert cal.bound_parts.machine >= check["time_spread"] and cal.bound_parts.machine_source in (
        "fresh processes",
        "not measured",
    )


def test_a_plan_says_which_part_of_its_bound_is_the_fit_and_which_the_machine(
    data: dict[str, Any], tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchtrain.train.step.hardware import detect_hardware

    home = tmp_path / "home"
    monkeypatch.setenv("BENCHTRAIN_HOME", str(home))
    data.update(
        hardware=detect_hardware(),
        model={"name": "tiny", "parameter_count": 1, "fingerprint": resolve_model("tiny").fingerprint},
    )
    data["process_check"] = judge(
        data["fit"], fresh_rows(data["measurements"], [1.12, 1.16, 1.20, 1.14, 1.18, 1.15]), BENCH_RSS
    )
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(data))
    code, out, err = run_main(
        "train", ["--use-calibration", str(path), "--data", "sample", "--deadline", "1h", "--dry-run", "--json"], capsys
    )
    assert code == 0, err
    cal = Calibration(data)
    assert json.loads(out)["bound_parts"] == {
        "fit": cal.bound_parts.fit,
        "machine": cal.bound_parts.machine,
        "machine_source": "fresh processes",
    }
    code, out, err = run_main(
        "train", ["--use-calibration", str(path), "--data", "sample", "--deadline", "1h", "--dry-run"], capsys
    )
    assert (
        code == 0
        and f"the fit's {cal.bound_parts.fit:.0%} + {cal.bound_parts.machine:.0%} between processes (measured in fresh processes)"
        in out
    )


def test_the_resident_set_before_a_model_is_measured_with_the_builds_libraries_loaded() -> None:
    """bench and train measure it at different points: with the libraries a build imports loaded
    first, their difference is what the processes hold, not the order they imported in."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from benchtrain.train.step.peak_memory import resident_bytes_before_model\n"
        "assert 'peft' not in sys.modules and 'sympy' not in sys.modules\n"
        "assert resident_bytes_before_model() > 0\n"
        "assert 'peft' in sys.modules and 'sympy' in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_sigterm_to_bench_ends_the_child_measuring_for_it(tmp_path: Path) -> None:
    """An engine stopping bench (SIGTERM) stops the fresh process measuring for it too: it would hold the device."""
    import os
    import signal
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "child.pid"
    child = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    bench = (
        "from benchtrain.bench.fresh_process import run_own_group; "
        f"run_own_group([{sys.executable!r}, '-c', {child!r}], 300)"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", bench], env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    )
    try:
        while not pid_file.is_file() or not pid_file.read_text():
            assert parent.poll() is None
            time.sleep(0.05)
        child_pid = int(pid_file.read_text())
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(timeout=60) == -signal.SIGTERM  # bench itself ends as a SIGTERM ends it
        for _ in range(200):  # the child was killed with its group; gone once reaped by init
            try:
                os.kill(child_pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            os.kill(child_pid, signal.SIGKILL)
            pytest.fail("the child outlived bench")
    finally:
        parent.kill()
