"""GPU-path faults that a reading of torch's, accelerate's, bitsandbytes' and NCCL's sources found and
no CPU test saw; each test here failed before its fix."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from benchtrain.calibration.hardware import Hardware

# -- the compile-cache child of a slice calibration built the whole model ---------------------------


def test_the_compile_cache_child_of_a_slice_builds_the_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under `--layers` the workload is a 2-layer slice of an 8B: the child process that times the
    cached compile must build those 2 layers, not the 32 that the preset's name alone gives (32 GB of
    fp32 weights: out of memory exactly where slices were chosen)."""
    import benchtrain.bench.fresh_process as fresh_process
    from benchtrain.bench.layer_slices import slice_spec
    from benchtrain.bench.probe_tasks import measure_cached_compile
    from benchtrain.train.workload.method import MethodConfig
    from benchtrain.train.workload.model import make_config, resolve_model

    started: list[list[str]] = []

    def child(command: list[str], timeout_seconds: float) -> subprocess.CompletedProcess:
        started.append(command)
        return subprocess.CompletedProcess(
            command, 0, stdout=json.dumps({"first_step_seconds": 3.0, "step_seconds": 1.0}), stderr=""
        )

    monkeypatch.setattr(fresh_process, "run_own_group", child)
    sliced = slice_spec(resolve_model("llama-3.1-8b"), 2)
    workload = SimpleNamespace(
        spec=sliced,
        method=MethodConfig(),
        engine=SimpleNamespace(setup=SimpleNamespace(loss="plain")),
        release=lambda: None,
    )
    assert measure_cached_compile(workload, {"micro_batch_size": 1, "seq_len": 64}, 60.0)["first_step_seconds"] == 3.0

    built: list[Any] = []

    class Built(Exception):
        pass

    def capture(spec: Any, *arguments: Any) -> None:
        built.append(spec)
        raise Built

    monkeypatch.setattr(fresh_process, "engine_from_options", capture)  # where the child looks them up
    monkeypatch.setattr(fresh_process, "make_accelerator", lambda *arguments: None)
    with pytest.raises(Built):  # the child's own reading of the request, up to the model it builds
        fresh_process.main([started[0][-1]])
    assert make_config(built[0]).num_hidden_layers == 2
    assert not built[0].load_weights


# -- FSDP with bitsandbytes' 8-bit AdamW crashed at the first optimizer step ------------------------


@pytest.mark.slow
def test_fsdp_with_8bit_adamw_is_one_line_before_any_probe(fork_server: Any, tmp_path: Path) -> None:
    """Two gloo ranks benching `--sharding fsdp --optimizer adamw-8bit`: bitsandbytes' state is sized
    from the whole tensor, so every probe failed at its first optimizer step ("mixed torch.Tensor and
    DTensor") and the budget went with them. Now each rank says why in one line, before building."""
    arguments = [
        "run",
        "--gpu",
        "cpu",
        "--sharding",
        "fsdp",
        "--optimizer",
        "adamw-8bit",
        "--budget",
        "40s",
        "--batch-sizes",
        "1",
        "--seq-lens",
        "32",
    ]
    result = fork_server.run_group(
        "bench", arguments, tmp_path / "ranks", env={"BENCHTRAIN_HOME": str(tmp_path / "home")}, timeout=200
    )
    assert result.returncode != 0
    refusals = [line for line in result.stderr.splitlines() if "adamw-8bit" in line]
    assert len(refusals) == 2 and all("FSDP" in line and "--sharding ddp" in line for line in refusals), result.stderr[
        -2000:
    ]
    assert "Traceback" not in result.stderr and "probe" not in result.stdout + result.stderr
    assert not (tmp_path / "home" / "calibrations").exists() or not any((tmp_path / "home" / "calibrations").iterdir())


def test_the_optimizer_table_says_which_rows_step_sharded_parameters() -> None:
    from benchtrain.common.errors import BenchtrainError
    from benchtrain.train.step.engine import StepOptions, process_layout
    from benchtrain.train.workload.method import MethodConfig

    for name in ("adamw-8bit", "paged-adamw-8bit"):
        with pytest.raises(BenchtrainError, match=f"--optimizer {name} cannot step FSDP"):
            process_layout(StepOptions(sharding="fsdp"), MethodConfig(optimizer=name), processes=4)
        assert process_layout(StepOptions(sharding="ddp"), MethodConfig(optimizer=name), processes=4).sharding == "ddp"
        # one process shards nothing
        assert (
            process_layout(StepOptions(sharding="fsdp"), MethodConfig(optimizer=name), processes=1).sharding == "none"
        )
    assert process_layout(StepOptions(sharding="fsdp"), MethodConfig(optimizer="adamw"), processes=4).sharding == "fsdp"


# -- a multi-GPU plan from a 1-process calibration left out NCCL's own memory -----------------------


def test_a_ddp_plan_for_8_gpus_from_a_1_process_calibration_holds_nccls_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """The H100 calibration was measured by one process: no communicator existed, so its peak holds
    none of NCCL's buffers, nor the NVLS memory NCCL binds on each GPU of an NVSwitch. The plan for
    8 DDP processes adds them per GPU (calibration.comm); over PCIe the buffers alone."""
    from helpers import FIXTURE, run_consider

    import benchtrain.train.recipes.run_plan as planner
    from benchtrain.calibration.schema import read_calibration_file

    requests: list[Any] = []
    make_plan = planner.make_plan

    def capture(cal: Any, data: Any, request: Any, eval_data: Any = None) -> Any:
        requests.append(request)
        return make_plan(cal, data, request, eval_data)

    monkeypatch.setattr(planner, "make_plan", capture)
    comparison = run_consider("h100:1,h100:8:nvswitch,h100:8:pcie", [read_calibration_file(FIXTURE)])
    alone, switched, pcie = requests
    assert [row.run_plan.fitted.step.sharding for row in comparison.rows] == ["none", "ddp", "ddp"]
    assert alone.world_size == 1 and alone.memory_offset_bytes == 0.0
    # channels × ring peers × (Simple + LL128 + LL): ≈294 MiB
    buffers = 16 * 2 * (4 * 2**20 + 120 * 640 * 8 * 8 + 8 * 512 * 8 * 16)
    assert pcie.world_size == 8 and pcie.memory_offset_bytes == buffers
    assert switched.memory_offset_bytes == buffers + 8 * 32 * 2**20  # NVLS: 32 MiB per GPU of the node on each
    from benchtrain.calibration.comm import communicator_bytes

    h100 = read_calibration_file(FIXTURE)["hardware"]
    assert (
        communicator_bytes(Hardware.from_record({**h100, "interconnect": "nvswitch"}), 8)
        == switched.memory_offset_bytes
    )
    # no NVLS before Hopper
    assert (
        communicator_bytes(Hardware.from_record({**h100, "compute_capability": "8.0", "interconnect": "nvswitch"}), 8)
        == buffers
    )
    assert (
        communicator_bytes(Hardware.from_record({"device_type": "cpu"}), 8) == 0.0
        and communicator_bytes(Hardware.from_record(h100), 1) == 0.0
    )


# -- collectives priced at datasheet signalling rates, and NVLink pairs read as a fabric ------------


def fake_nvml(links: dict[int, list[int]], gpus: int, switched: bool = False) -> Any:
    """pynvml for a node of `gpus` GPUs whose GPU 0 has an active NVLink to each GPU of `links`
    (link number → the GPU at its other end; -1: an NVSwitch)."""
    import types

    module = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    def bus(index: int) -> Any:
        return types.SimpleNamespace(busId=f"00000000:{0x18 + index:02x}:00.0".encode())

    def state(handle: str, link: int) -> int:
        if link not in links:
            raise NVMLError("Invalid Argument")
        return 1

    module.NVMLError = NVMLError  # type: ignore[attr-defined]
    module.NVML_FEATURE_ENABLED = 1  # type: ignore[attr-defined]
    module.NVML_NVLINK_MAX_LINKS = 18  # type: ignore[attr-defined]
    module.nvmlInit = lambda: None  # type: ignore[attr-defined]
    module.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    module.nvmlDeviceGetCount = lambda: gpus  # type: ignore[attr-defined]
    module.nvmlDeviceGetHandleByIndex = lambda index: f"gpu{index}"  # type: ignore[attr-defined]
    module.nvmlDeviceGetPciInfo = lambda handle: bus(int(handle[3:]))  # type: ignore[attr-defined]
    module.nvmlDeviceGetNvLinkState = state  # type: ignore[attr-defined]
    module.nvmlDeviceGetNvLinkRemoteDeviceType = lambda handle, link: 2 if switched else 0  # type: ignore[attr-defined]
    module.nvmlDeviceGetNvLinkRemotePciInfo = lambda handle, link: (
        bus(links[link]) if links[link] >= 0 else types.SimpleNamespace(busId=b"0000:c0:00.0")
    )  # type: ignore[attr-defined]
    return module


def test_collectives_are_priced_at_nccls_own_link_figures_and_bridged_pairs_at_pcie(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NCCL's topology model (src/graph/topo.h, topo.cc): 20.6 GB/s per SM90 NVLink (18 links: 370.8
    GB/s, not 900/2 = 450), 20.0 per SM80 link, PCIe x16 Gen4 24 GB/s and Gen5 48 (not 32 and 64).
    And 8 PCIe H100s bridged in pairs: GPU 0's NVLinks reach GPU 1 alone, so a ring over all 8
    crosses PCIe between pairs: the node is pcie, not an NVLink fabric."""
    import sys

    from benchtrain.calibration.topology import link_figures
    from benchtrain.train.step import hardware

    def detected(module: Any) -> Any:
        monkeypatch.setitem(sys.modules, "pynvml", module)
        hardware.detect_interconnect.cache_clear()
        return hardware.detect_interconnect()["interconnect"]

    try:
        assert detected(fake_nvml(dict.fromkeys(range(18), -1), 8, switched=True)) == "nvswitch"  # HGX H100
        # 4 A100s, each linked to every other
        assert detected(fake_nvml({link: 1 + link % 3 for link in range(12)}, 4)) == "nvlink"
        assert detected(fake_nvml({link: 1 for link in range(12)}, 8)) == "pcie"  # 8 H100 PCIe, bridged in pairs
        assert detected(fake_nvml({link: 1 for link in range(12)}, 2)) == "nvlink"  # the one pair alone: its bridge
        assert detected(fake_nvml({}, 8)) == "pcie"
    finally:
        hardware.detect_interconnect.cache_clear()
    matrix = (
        "\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\nGPU0\t X \tNV12\tPXB\tSYS\t0-31\nGPU1\tNV12\t X \tSYS\tPXB\t0-31\n"
    )
    assert hardware._smi_peers(matrix, 0) == (1, 4)  # nvidia-smi topo -m: one NVLink peer of four GPUs

    assert link_figures("nvswitch", "NVIDIA H100 80GB HBM3").bandwidth_bytes_per_second == pytest.approx(18 * 20.6e9)
    assert link_figures("nvlink", "NVIDIA A100-SXM4-80GB").bandwidth_bytes_per_second == pytest.approx(12 * 20.0e9)
    # its 600 GB/s bridge
    assert link_figures("nvlink", "NVIDIA H100 PCIe").bandwidth_bytes_per_second == pytest.approx(12 * 20.6e9)
    assert link_figures("pcie", "NVIDIA H100 PCIe").bandwidth_bytes_per_second == 48e9  # Gen5 x16
    assert link_figures("pcie", "NVIDIA A100 80GB PCIe").bandwidth_bytes_per_second == 24e9  # Gen4 x16
    assert link_figures("pcie", "NVIDIA RTX A6000").bandwidth_bytes_per_second == 24e9  # not in the table: Gen4 assumed
    assert (
        "topo.h" in link_figures("pcie", "NVIDIA L4").source
        and "20.6 GB/s" in link_figures("nvlink", "NVIDIA H200").source
    )


# -- the profiler's split counted NCCL's kernels as memory-bound time --------------------------------


def test_a_concurrent_nccl_kernel_is_communication_not_memory_bound_time() -> None:
    """An FSDP step: a GEMM (0-600 µs) and an elementwise kernel (600-800) on the compute stream, an
    NCCL all-gather on its own stream from 500 to 1000 µs, the last 200 µs of it alone. The GEMM's
    share of the step's kernels stays 600/800; the all-gather is neither compute nor memory: 200 µs
    of exposed communication, and the host's exposed time is what ran nothing (1000-2000 µs)."""
    from helpers import kernel

    from benchtrain.bench.step_split import kernel_kind, split_from_events

    gemm, add = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", "void at::native::vectorized_elementwise_kernel<4, add>"
    gather = "ncclDevKernel_AllGather_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"
    assert kernel_kind(gather) == "communication"
    split = split_from_events(
        [kernel(gemm, 0, 600), kernel(add, 600, 800), kernel(gather, 500, 1000)], wall_seconds=0.002, steps=1
    )
    assert split["compute_seconds"] == pytest.approx(600e-6) and split["memory_seconds"] == pytest.approx(200e-6)
    assert split["comm_seconds"] == pytest.approx(200e-6) and split["host_seconds"] == pytest.approx(1000e-6)


# -- a slice calibration kept the deepest slice's step split as the whole model's ---------------------


def test_a_slice_calibrations_split_is_the_whole_models_not_the_deepest_slices() -> None:
    """Llama-3.1-8B's matmuls per layer hold 4096 × (2 × 4096 + 2 × 1024 + 3 × 14336) = 218.1M
    weights, its head 4096 × 128256 = 525.3M: at 6 of 32 layers the head is ≈29% of the matmul
    FLOPs, at 32 ≈7%. Splits measured at 2, 4 and 6 layers (compute-bound seconds in proportion to
    those FLOPs) give the whole model's split as lines in depth, not the 6-layer one."""
    from benchtrain.calibration.slices import derive_step_split

    # seconds at 1 s per 1e9 weights: any scale
    layer, head = (
        4096 * (2 * 4096 + 2 * 1024 + 3 * 14336) / 1e9,
        4096 * 128256 / 1e9,
    )
    config = {"micro_batch_size": 4, "seq_len": 2048, "grad_accum": 1, "num_workers": 0, "gradient_checkpointing": 0}

    def split(depth: int) -> dict[str, Any]:
        return {
            **config,
            "compute_seconds": head + depth * layer,
            "memory_seconds": 0.02 + 0.01 * depth,
            "host_seconds": 0.05,
            "method": "profiler",
        }

    assert head / split(6)["compute_seconds"] == pytest.approx(0.286, abs=0.002)  # the deepest slice's
    alone = {**split(6), "micro_batch_size": 1}  # split at one depth only: no line
    derived = derive_step_split({2: [split(2)], 4: [split(4)], 6: [split(6), alone]}, 32)
    (whole,) = derived
    assert whole["compute_seconds"] == pytest.approx(head + 32 * layer) and head / whole[
        "compute_seconds"
    ] == pytest.approx(0.070, abs=0.002)
    assert whole["memory_seconds"] == pytest.approx(0.34) and whole["host_seconds"] == pytest.approx(0.05)
    assert whole["method"] == "profiler" and whole["micro_batch_size"] == 4 and whole["slice_depths"] == [2, 4, 6]
    # nothing split twice: the whole fit's FLOP-count split stands
    assert derive_step_split({2: [split(2)], 6: [alone]}, 32) == []


@pytest.mark.slow  # three simulated benches of an 8B shape on slices: ≈15 s
def test_a_slice_calibration_stores_the_split_derived_in_depth(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    """The same split at each depth of a simulated 8B bench on 2, 4 and 6 layers: the calibration of
    the whole model holds its line at 32 layers, not the 6-layer split it used to copy."""
    from simulated_slices import simulate_slices

    import benchtrain.bench.layer_slices as layer_slices

    layer, head = 4096 * (2 * 4096 + 2 * 1024 + 3 * 14336) / 1e9, 4096 * 128256 / 1e9
    combine = layer_slices.combine_slices

    def with_splits(records: dict[int, dict[str, Any]], whole: Any) -> dict[str, Any]:
        for depth, record in records.items():
            row = next(row for row in record["measurements"] if row["status"] == "ok")
            config = {
                name: int(row.get(name, 0))
                for name in ("micro_batch_size", "seq_len", "grad_accum", "num_workers", "gradient_checkpointing")
            }
            parts = {"compute_seconds": head + depth * layer, "memory_seconds": 0.1 * depth, "host_seconds": 0.05}
            record["step_split"] = [{**config, **parts, "method": "profiler"}]
        return combine(records, whole)

    monkeypatch.setattr(layer_slices, "combine_slices", with_splits)  # where the bench looks it up
    record, _, _ = simulate_slices("llama-3.1-8b", False, 300.0, (2, 4, 6))
    (split,) = record["step_split"]
    assert split["compute_seconds"] == pytest.approx(head + 32 * layer) and split["memory_seconds"] == pytest.approx(
        3.2
    )


# -- FSDP loading a folder left the other ranks in a collective while rank 0 read the weights -------


@pytest.mark.slow
def test_a_slow_rank_0_load_does_not_outlast_the_process_groups_timeout(fork_server: Any, tmp_path: Path) -> None:
    """Two gloo ranks whose collectives give up after 5 s; rank 0 takes 8 s more to read a bf16
    folder (a 70B checkpoint on a slow disk against NCCL's 10-minute watchdog). Rank 1 used to wait
    in broadcast_object_list and fail; now it waits on the job's store, and both keep the folder's
    weights, read in the checkpoint's bf16 and kept in fp32 shards."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchtrain.train.workload.model import make_config, resolve_model

    folder = tmp_path / "bf16"
    torch.manual_seed(3)
    config = make_config(resolve_model("tiny"))
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    checks = Path(__file__).with_name("distributed_checks.py")
    report = fork_server.group_report(checks, ["slow-load", str(folder), "5", "8"], timeout=120)
    assert report == {"same": True, "saved_dtype": "torch.bfloat16", "shard_dtype": "torch.float32"}


def test_an_fsdp_row_of_a_comparison_with_8bit_adamw_says_why_it_has_no_plan() -> None:
    """`train --dry-run --consider h100:4 --sharding fsdp --optimizer adamw-8bit` from one process:
    the 4-process row is sharded even though this command is not, and says why it has no plan."""
    import copy

    from helpers import FIXTURE, heavy_tailed, tokenized

    from benchtrain.calibration.model import Calibration
    from benchtrain.calibration.schema import read_calibration_file
    from benchtrain.train.recipes.config import TrainConfig
    from benchtrain.train.recipes.machines import consider, parse_machines
    from benchtrain.train.recipes.run_plan import PlanContext
    from benchtrain.train.step.engine import StepOptions
    from benchtrain.train.step.hardware import detect_hardware
    from benchtrain.train.workload.data import length_profile
    from benchtrain.train.workload.method import MethodConfig
    from benchtrain.train.workload.model import resolve_model

    config = TrainConfig.of(data="test", dry_run=True, deadline="12h", step_options=StepOptions(sharding="fsdp"))
    data = tokenized(heavy_tailed(400))
    context = PlanContext(config, resolve_model("llama-3.2-1b"), data, None, 0.0)
    measured = copy.deepcopy(read_calibration_file(FIXTURE))
    measured["training"]["optimizer"] = "adamw-8bit"  # one process measured 8-bit AdamW
    calibrations = [Calibration(measured)]
    method = MethodConfig(optimizer="adamw-8bit")
    comparison = consider(
        context,
        method,
        calibrations,
        Hardware.from_record(detect_hardware()),
        length_profile(data.lengths),
        parse_machines("h100:4:nvlink"),
    )
    (row,) = comparison.rows
    assert (
        row.run_plan is None
        and row.problem is not None
        and row.problem.startswith("--optimizer adamw-8bit cannot step FSDP's sharded parameters")
    )
