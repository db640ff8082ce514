"""On a CUDA device: bf16 probe with CUDA events, allocator peak memory and MFU from the table."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def test_probe_on_cuda_reports_mfu_and_allocator_peak() -> None:
    from bench.probe import ProbeSettings, Workload, run_probe
    from bench.space import ProbeConfig
    from train.hardware import detect_hardware
    from train.model import resolve_model

    hardware = detect_hardware()
    workload = Workload(resolve_model("gpt2"))
    assert workload.accelerator.mixed_precision == "bf16"
    row = run_probe(workload, ProbeConfig(4, 2, 1, 512), ProbeSettings.for_device("cuda"), hardware["peak_bf16_flops"])
    assert row["status"] == "ok" and row["tokens_per_second"] > 0
    assert row["peak_memory_bytes"] > 124e6 * 4  # at least the fp32 weights
    if hardware["peak_bf16_flops"]:
        assert 0 < row["mfu"] < 1
