"""`bench run --gpu NAME` where torch sees no usable CUDA (issue 39, fault 10): refused in one line
that says what torch sees and the install that fixes it, instead of benchmarking the CPU under the
GPU's name (what a torch build for another CUDA than the driver's gave on a rented machine: exit 0
and a CPU calibration). `--gpu cpu` stays the CPU path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import assert_one_line_error, run_main

import benchtrain.train.step.hardware as hardware

# Exits before any model is built; the old code measured this grid on the CPU and exited 0.
GRID = [
    "--batch-sizes",
    "1,2,4",
    "--seq-lens",
    "16",
    "--workers",
    "0",
    "--accum",
    "1",
    "--no-report",
    "--quiet",
    "--budget",
    "30s",
]


def _no_usable_cuda(
    monkeypatch: pytest.MonkeyPatch, build: str | None, driver: str | None, driver_cuda: str | None
) -> None:
    """This machine as torch sees it on a rented GPU whose torch build does not match the driver."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", build)
    monkeypatch.setattr(hardware, "driver_version", lambda: driver)
    monkeypatch.setattr(hardware, "driver_cuda_version", lambda: driver_cuda)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_a_torch_for_a_newer_cuda_than_the_driver_is_refused_with_the_install_that_fixes_it(
    home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _no_usable_cuda(monkeypatch, "12.8", "535.104.05", "12.2")
    code, _, err = run_main("bench", ["run", "--gpu", "h100", *GRID], capsys)
    assert_one_line_error(code, err, "--gpu h100: torch ")
    line = err.strip().splitlines()[-1]
    for fact in (
        "built for CUDA 12.8",
        "NVIDIA driver 535.104.05 supporting CUDA 12.2",
        "torch.cuda.is_available() is False",
    ):
        assert fact in line, line
    release = torch.__version__.split("+")[0]
    assert f"pip install --force-reinstall torch=={release} --index-url https://download.pytorch.org/whl/cu122" in line
    assert not list((home / "calibrations").glob("*.json"))  # nothing measured, nothing stored


def test_a_cpu_only_torch_or_no_driver_each_say_so(
    home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _no_usable_cuda(monkeypatch, None, "550.54.15", "12.4")
    code, _, err = run_main("bench", ["run", "--gpu", "a100", *GRID], capsys)
    assert_one_line_error(code, err, "is a CPU-only build, NVIDIA driver 550.54.15 supporting CUDA 12.4")
    assert "/whl/cu124" in err
    _no_usable_cuda(monkeypatch, None, None, None)
    code, _, err = run_main("bench", ["run", "--gpu", "h200", *GRID], capsys)
    assert_one_line_error(code, err, "no NVIDIA driver found")
    assert "--gpu cpu" in err
    # torch and the driver agree, the device is hidden: the fix is the variable, not an install.
    _no_usable_cuda(monkeypatch, "12.4", "550.54.15", "12.4")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    code, _, err = run_main("bench", ["run", "--gpu", "h100", *GRID], capsys)
    assert_one_line_error(code, err, "CUDA_VISIBLE_DEVICES=''")
    assert "pip install" not in err


def test_cpu_and_a_usable_gpu_pass_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """--gpu cpu (any case), no --gpu, and a GPU name where CUDA works are not refused (a GPU that is
    not the one named is still only a warning: train.step.hardware.requested_mismatch)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for requested in ("cpu", "CPU", None, ""):
        hardware.require_requested_device(requested)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    hardware.require_requested_device("h100")


def test_the_real_probes_of_the_driver_answer_on_this_machine() -> None:
    """Whatever this machine has, the driver probes answer without raising (None without a driver)."""
    version, cuda = hardware.driver_version(), hardware.driver_cuda_version()
    assert version is None or version[0].isdigit()
    assert cuda is None or cuda.replace(".", "").isdigit()
