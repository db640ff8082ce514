"""benchmarks/gpu_check.py (issue 34): every GPU claim in one command. On CPU its --smoke runs the
same checks (peers, loss, the LoRA bench, bench + train, compile, memory) at tiny shapes; each must
come back with a measured number, in the JSON and as a row of the markdown table."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchtrain.calibration.step_config import StepConfig

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
# ≈ 1.5 min on a quiet cpu-vm; a busy or slow CPU gets larger budgets (sized_bench), not a failure
@pytest.mark.timeout(660)
def test_the_smoke_run_measures_every_check_and_writes_one_row_each(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "BENCHTRAIN_HOME": str(tmp_path / "home")}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    names = list(load_script().CHECKS)
    document = json.loads((out / "gpu_check.json").read_text())
    assert document["smoke"] is True and [check["name"] for check in document["checks"]] == names
    for check in document["checks"]:
        assert isinstance(check["value"], (int, float)), check
        assert check["claim"] and check["command"] and check["measured"], check
    table = (out / "gpu_check.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| check |")]
    assert [row.split(" | ")[0].removeprefix("| ") for row in rows] == names
    assert "not measured" not in table


def test_without_cuda_it_asks_for_smoke_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts benchmarks/ on it
    assert load_script().main(["--out", "unused"]) == 2
    captured = capsys.readouterr()
    assert captured.err == "no CUDA device: use --smoke\n" and captured.out == ""


# -- issue 39: sizes that fit an H100, a price under ten minutes, installs checked, smoke sized by the machine --
def test_each_fixed_shape_check_fits_the_bundled_h100_with_ten_percent_to_spare() -> None:
    """peers, loss and compile run full fine-tuning of llama-3.2-1b at one shape: the bundled H100
    calibration's peak for it, with its memory fit's margin, leaves 10% of the card (8 × 2048 needed
    ≈ 82 GiB of 79 GiB: HF Trainer and the plain loss ran out of memory and the script exited 1)."""
    from benchtrain import calibration

    gpu = load_script().GPU
    h100 = calibration.load(
        Path(__file__).resolve().parents[1] / "benchtrain" / "calibration" / "bundled" / "h100-llama-3.2-1b.json"
    )
    assert h100.data["model"]["name"] == gpu.model
    device = h100.data["hardware"]["memory_bytes"]
    prediction = h100.predict(StepConfig(gpu.micro_batch, 0, 1, gpu.seq_len))
    assert prediction.peak_memory_bytes is not None and prediction.peak_memory_bytes_high is not None
    assert prediction.peak_memory_bytes <= prediction.peak_memory_bytes_high <= 0.9 * device
    assert prediction.fits_in_memory


@pytest.mark.slow
def test_the_whole_script_is_priced_within_ten_minutes_on_the_simulated_h100() -> None:
    """Every check at the H100 sizes, priced from the bundled calibration (step, model build) and the
    simulated H100 built on it (the two `bench run`s on its virtual clock, a compilation's 40 s), plus
    a process start for each command: at most 600 s. The old sizes priced 10m28s."""
    from simulated import COMPILE_SECONDS

    module = load_script()
    from gpu_check_price import LIMIT_SECONDS, PROCESS_SECONDS, price_checks

    priced = {check.name: check for check in price_checks(module.GPU, list(module.CHECKS))}
    assert set(priced) == {"start", *module.CHECKS}
    # Each part is what it says: two compiled peers loops and the compile check pay a compilation,
    # the train check its whole deadline, both benches at least their process start.
    assert priced["peers"].seconds > 2 * COMPILE_SECONDS and priced["compile"].seconds > COMPILE_SECONDS
    assert priced["train"].parts["train deadline"] == module.GPU.train_deadline
    assert priced["lora-8b"].seconds > PROCESS_SECONDS + module.GPU.lora_budget / 2
    assert sum(check.seconds for check in priced.values()) <= LIMIT_SECONDS == 600


def test_price_prints_the_table_without_a_gpu(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    module = load_script()
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert module.main(["--price", "--checks", "peers,memory"]) == 0
    out = capsys.readouterr().out
    assert "peers" in out and "peak ≤ 55.7 of 79.2 GiB" in out and "total" in out


@pytest.mark.parametrize("smoke", [True, False])
def test_a_missing_install_is_named_in_one_line_with_its_pip_command(
    smoke: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    import torch

    module = load_script()
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real_find_spec = importlib.util.find_spec
    gone = "peft" if smoke else "liger_kernel"  # the GPU run needs Liger for the loss check; --smoke does not
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *args: None if name == gone else real_find_spec(name, *args)
    )
    monkeypatch.setattr(module, "CHECKS", {})  # nothing may run past the check
    assert module.main([*(["--smoke"] if smoke else []), "--out", "unused", "--checks", ""]) == 2
    err = capsys.readouterr().err
    expected = (
        "peft (the lora-8b bench), which is not installed: pip install -e ."
        if smoke
        else "liger-kernel (the loss check's Liger row), which is not installed: pip install -e '.[gpu]'"
    )
    assert err == f"gpu_check needs {expected}\n"


def test_a_bench_the_machine_finds_too_small_runs_again_at_the_budget_it_asked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """On a CPU without AVX-512 the smoke's 15 s LoRA bench measured "0 of 0 probes in 13.3s" and the
    check failed: at --smoke's scale the budget follows what bench measured there."""
    module = load_script()
    calls: list[float] = []
    stored = tmp_path / "calibration.json"

    def real_bench(model, lora, checkpointing, budget, device, extra, home):
        calls.append(budget)
        if len(calls) == 1:
            return {
                "result": "error: only 0 of 0 probes succeeded in 13.3s; a fit needs at least 3: at the prices measured, "
                "a minimum calibration needs ≈ 24.5s: use --budget 25.0s. Nothing was stored"
            }, None
        return {"probes ok": 8}, stored

    monkeypatch.setattr(module.bench_budget, "real_bench", real_bench)
    ctx = module.Context(module.SMOKE, tmp_path)
    row, path, budget, _ = module.sized_bench(ctx, "tiny", True, 15.0, (), tmp_path)
    assert calls == [15.0, 37.5] and path == stored and budget == 37.5 and row["first_budget_too_small"]
    # bench_budget cuts the line before "use --budget": twice the budget, or more where refusing took long.
    calls.clear()
    monkeypatch.setattr(
        module.bench_budget,
        "real_bench",
        lambda *args: (
            calls.append(args[3]),
            ({"result": "error: only 0 of 0 probes succeeded in 17.4s; a fit"}, None),
        )[1],
    )
    assert module.sized_bench(ctx, "tiny", True, 15.0, (), tmp_path)[2] == 30.0 and calls == [15.0, 30.0]
    # On the H100 the ten minutes are priced: no second run.
    calls.clear()
    monkeypatch.setattr(
        module.bench_budget,
        "real_bench",
        lambda *args: (calls.append(args[3]), ({"result": "use --budget 3m"}, None))[1],
    )
    assert module.sized_bench(module.Context(module.GPU, tmp_path), "llama-3.1-8b", True, 120.0, (), tmp_path)[
        1
    ] is None and calls == [120.0]
    assert module.budget_asked({"result": "… needs ≈ 1m15s; use --budget 1m18s or more"}) == 78.0
    assert module.budget_asked({"result": "CUDA out of memory"}) is None


def test_the_smoke_train_deadline_follows_a_timed_dry_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    module = load_script()
    monkeypatch.setattr(module, "dry_run_seconds", lambda ctx, calibration, home, deadline: 30.0)
    assert (
        module.sized_deadline(module.Context(module.SMOKE, tmp_path), tmp_path, tmp_path) == 30.0 / module.DRY_RUN_SHARE
    )
    assert module.sized_deadline(module.Context(module.GPU, tmp_path), tmp_path, tmp_path) == module.GPU.train_deadline
    monkeypatch.setattr(module, "dry_run_seconds", lambda ctx, calibration, home, deadline: 2.0)
    assert (
        module.sized_deadline(module.Context(module.SMOKE, tmp_path), tmp_path, tmp_path) == module.SMOKE.train_deadline
    )
