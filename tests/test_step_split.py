"""The step's split into compute-bound kernels, memory-bound kernels and exposed host time (issue 41):
the profiler's path run on CPU with torch's own FunctionEvents standing in for a GPU's kernels, the
FLOP-count path, the probes chosen, and a CPU bench recording it."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from helpers import kernel
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

from benchtrain.bench.step_split import busy_seconds, kernel_kind, profile_split, record_step_split, split_from_events
from benchtrain.calibration.split import MATMUL_EFFICIENCY, flops_split, split_rows
from benchtrain.calibration.step_config import StepConfig

KERNELS = {
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas": "compute",
    "nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTN": "compute",
    "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_tn": "compute",
    "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, 64, 128>>(Flash_bwd_params)": "compute",
    "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t>::Params)": "compute",
    "triton_tem_fused_mm_0": "compute",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul>>": "memory",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>": "memory",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::LogSoftMaxForwardEpilogue>": "memory",
    "Memcpy HtoD (Pinned -> Device)": "memory",
    "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)": "communication",
    "void ncclKernel_AllGather_RING_LL_Sum_int8_t(ncclWorkElem)": "communication",
}


def host_op(name: str, start_us: float, end_us: float) -> FunctionEvent:
    return FunctionEvent(
        id=1, name=name, thread=1, start_us=start_us, end_us=end_us, device_type=DeviceType.CPU, use_device="cuda"
    )


@pytest.mark.parametrize(("name", "kind"), KERNELS.items())
def test_kernels_are_sorted_by_their_names(name: str, kind: str) -> None:
    assert kernel_kind(name) == kind


def test_the_device_time_splits_in_proportion_and_the_idle_rest_is_the_host() -> None:
    gemm, add, flash = next(iter(KERNELS)), "void at::native::vectorized_elementwise_kernel<4, add>", "flash_fwd_kernel"
    events = [host_op("aten::mm", 0, 2000), kernel(gemm, 0, 600), kernel(add, 600, 800), kernel(flash, 1000, 1300)]
    split = split_from_events(events, wall_seconds=0.002, steps=2)  # 2 ms for two steps, the device busy 1.1 ms
    assert split["compute_seconds"] == pytest.approx(450e-6) and split["memory_seconds"] == pytest.approx(100e-6)
    assert split["host_seconds"] == pytest.approx(450e-6)  # the host op's own 2 ms is not device time
    # Kernels on two streams at once keep the device busy once: the shares divide the union.
    assert busy_seconds([(0, 600), (500, 700), (1000, 1300)]) == pytest.approx(1000e-6)
    overlapping = split_from_events([*events, kernel(add, 500, 700)], wall_seconds=0.002, steps=1)
    assert overlapping["compute_seconds"] + overlapping["memory_seconds"] == pytest.approx(1100e-6)
    assert overlapping["compute_seconds"] == pytest.approx(1100e-6 * 900 / 1300)


def test_the_profiled_path_runs_the_real_step_on_cpu() -> None:
    """THE step of the tiny model, profiled by a stand-in whose events are a GPU's kernels."""
    from benchtrain.bench.probe import Workload
    from benchtrain.train.step.engine import StepOptions
    from benchtrain.train.workload.model import resolve_model

    workload = Workload(resolve_model("tiny"), options=StepOptions(compile="off", loss="plain"))
    calls: list[str] = []
    run = workload.engine.step.run

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append("step")
        return run(*args, **kwargs)

    workload.engine.step.run = counted  # type: ignore[method-assign]
    session = type(
        "Session",
        (),
        {"events": lambda self: [kernel("sm90_xmma_gemm", 0, 100), kernel("elementwise_kernel", 100, 150)]},
    )()

    @contextmanager
    def profiler() -> Any:
        calls.append("profiling")
        yield session

    config = StepConfig(micro_batch_size=2, num_workers=2, grad_accum=2, seq_len=32)
    record = profile_split(workload, config, steps=2, profiler=profiler)
    assert calls == ["step", "profiling", "step", "step"]  # one warm-up outside the profiler, two inside
    assert record["method"] == "profiler" and record["num_workers"] == 0 and record["grad_accum"] == 2
    assert record["compute_seconds"] == pytest.approx(50e-6) and record["memory_seconds"] == pytest.approx(25e-6)
    assert (
        record["host_seconds"] == pytest.approx((record["profiled_seconds"] - 150e-6) / 2, rel=1e-3, abs=1e-4)
        and record["host_seconds"] > 0
    )


def fit(fixed: float = 0.01, per_token: float = 1e-5, optimizer_step: float = 0.02) -> dict[str, Any]:
    terms = ("attention", "serial_data", "worker_supply", "per_worker", "recompute_per_token", "recompute_attention")
    return {
        "parameters": {
            "fixed": fixed,
            "per_token": per_token,
            "optimizer_step": optimizer_step,
            **dict.fromkeys(terms, 0.0),
        }
    }


def row(micro: int, length: int, step: float, **extra: Any) -> dict[str, Any]:
    return {
        "micro_batch_size": micro,
        "seq_len": length,
        "grad_accum": 1,
        "num_workers": 0,
        "status": "ok",
        "step_seconds": step,
        **extra,
    }


def test_the_flops_split_from_the_fits_terms_and_the_mfu() -> None:
    # Per micro-step: 0.01 host, 1e-5 × 4096 device, 0.02 optimizer = 0.07096 s; measured 0.1: scaled to it.
    split = flops_split(fit(), row(8, 512, 0.1))
    assert split["method"] == "flops"
    assert split["compute_seconds"] + split["memory_seconds"] + split["host_seconds"] == pytest.approx(0.1)
    assert split["host_seconds"] == pytest.approx(0.1 * 0.01 / 0.070960) and split["memory_seconds"] == pytest.approx(
        0.1 * 0.02 / 0.070960
    )
    # With the probe's MFU (a GPU's peak known): the matmuls at MATMUL_EFFICIENCY of the peak.
    with_mfu = flops_split(fit(), row(8, 512, 0.1, mfu=0.3))
    assert with_mfu["compute_seconds"] == pytest.approx(0.3 * 0.1 / MATMUL_EFFICIENCY)
    assert with_mfu["compute_seconds"] + with_mfu["memory_seconds"] == pytest.approx(
        split["compute_seconds"] + split["memory_seconds"]
    )


def test_two_probes_of_different_sizes_are_chosen() -> None:
    rows = [
        row(8, 512, 0.2),
        {**row(8, 512, 0.3), "grad_accum": 4},
        row(4, 1024, 0.2),
        row(4, 512, 0.1),
        row(2, 512, 0.1),
    ]
    rows.append({**row(16, 512, 1), "status": "oom"})
    chosen = split_rows(rows)
    assert [(r["micro_batch_size"], r["seq_len"], r["grad_accum"]) for r in chosen] == [(8, 512, 1), (4, 512, 1)]


class Coordinator:
    def __init__(self, answer: dict[str, Any]) -> None:
        self.handlers = {"step_split": None}
        self.answer, self.asked = answer, []  # type: ignore[var-annotated]

    def run(self, task: str, payload: dict[str, Any]) -> dict[str, Any]:
        self.asked.append((task, payload["config"]))
        return self.answer


def test_a_gpu_bench_profiles_through_the_coordinator_and_falls_back_on_failure() -> None:
    rows = [row(8, 512, 0.1, mfu=0.3), row(4, 512, 0.06, mfu=0.25)]
    record = {"hardware": {"device_type": "cuda"}, "measurements": rows, "fit": fit()}
    workload = type("Workload", (), {"engine": object()})()
    profiled = {"compute_seconds": 0.05, "memory_seconds": 0.03, "host_seconds": 0.02, "method": "profiler"}
    coordinator = Coordinator(profiled)
    entries = record_step_split(type("Run", (), {"coordinator": coordinator})(), record, workload)
    assert entries == [profiled, profiled] and [config["micro_batch_size"] for _, config in coordinator.asked] == [8, 4]
    failing = Coordinator({"error": "RuntimeError: CUPTI unavailable"})
    entries = record_step_split(type("Run", (), {"coordinator": failing})(), record, workload)
    assert [entry["method"] for entry in entries] == ["flops", "flops"] and entries[0]["profiler_error"].startswith(
        "RuntimeError"
    )
    # A released model (the compile-cache timing ran last) or a CPU: no process is asked to profile.
    for device, held in (("cuda", type("Released", (), {"engine": None})()), ("cpu", workload)):
        quiet = Coordinator(profiled)
        entries = record_step_split(
            type("Run", (), {"coordinator": quiet})(), {**record, "hardware": {"device_type": device}}, held
        )
        assert quiet.asked == [] and [entry["method"] for entry in entries] == ["flops", "flops"]


@pytest.mark.slow
def test_a_cpu_bench_records_the_split_in_the_calibration(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from helpers import TINY_GRID, run_main

    code, _, err = run_main("bench", ["run", "--gpu", "cpu", *TINY_GRID, "--no-report"], capsys)
    assert code == 0, err
    data = json.loads(next((home / "calibrations").glob("*.json")).read_text())
    entries = data["step_split"]
    assert [entry["method"] for entry in entries] == ["flops", "flops"]
    assert (
        entries[0]["micro_batch_size"] * entries[0]["seq_len"] > entries[1]["micro_batch_size"] * entries[1]["seq_len"]
    )
    ok = [r for r in data["measurements"] if r["status"] == "ok"]
    measured = {(r["micro_batch_size"], r["seq_len"], r["grad_accum"], r["num_workers"]): r["step_seconds"] for r in ok}
    for entry in entries:
        total = entry["compute_seconds"] + entry["memory_seconds"] + entry["host_seconds"]
        assert total == pytest.approx(
            measured[(entry["micro_batch_size"], entry["seq_len"], entry["grad_accum"], entry["num_workers"])]
        )
