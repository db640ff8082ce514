"""LoRA under FSDP2 (train/step/sharding.py): the frozen base sharded with its adapters, two gloo
ranks on CPU. This file is also the ranks' script (`python -m torch.distributed.run
--nproc_per_node 2 tests/test_fsdp_lora.py ranks`); the tests fork the ranks from
tests/forkserver.py with the variables torchrun sets.

What one rank holds is measured, not assumed: the bytes of its local shards of the frozen base
and of the adapters (`DTensor.to_local()`), against one process's whole model."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from benchtrain.calibration.hardware import Hardware

SPEC: dict[str, Any] = {  # a small llama from a config: grouped-query attention, untied head
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
STEPS = 4
LORA_RANK = 4


def spec_of() -> Any:
    from benchtrain.train.workload.model import ModelSpec

    return ModelSpec(name="small-llama", config_dict=SPEC)


def train_steps(sharding: str, quantize: str = "none") -> dict[str, Any]:
    """Build the LoRA engine (`sharding`), measure what this process holds of the base and the
    adapters, gather the adapters whole, and train STEPS steps on the same batches every rank sees."""
    import torch
    from torch.distributed.tensor import DTensor

    from benchtrain.train.step.engine import StepOptions, engine_from_options
    from benchtrain.train.step.runtime import make_accelerator
    from benchtrain.train.step.sharding import gather_full_state, is_sharded
    from benchtrain.train.workload.batching import SyntheticBatches
    from benchtrain.train.workload.method import MethodConfig, unwrap

    def local_bytes(parameter: Any) -> int:
        local = parameter.to_local() if isinstance(parameter, DTensor) else parameter
        return int(local.numel() * local.element_size())

    options = StepOptions(compile="off", loss="plain", sharding=sharding)
    engine = engine_from_options(
        spec_of(), MethodConfig(method="lora", lora_rank=LORA_RANK, quantize=quantize), make_accelerator(), options
    )
    lm = unwrap(engine.model)
    base = sum(local_bytes(parameter) for parameter in lm.parameters() if not parameter.requires_grad)
    adapters = sum(local_bytes(parameter) for parameter in lm.parameters() if parameter.requires_grad)
    if is_sharded(engine.model):
        weights = gather_full_state(engine.model, None).weights
    else:
        from benchtrain.train.running.checkpoint import model_state

        weights = model_state(engine.model)
    initial = {name: tensor.tolist() for name, tensor in weights.items()}  # before training changes them
    batches = iter(SyntheticBatches(STEPS, 2, 16, SPEC["vocab_size"]))
    losses = [engine.step.run(batches, 1).loss for _ in range(STEPS)]
    states = engine.optimizer.state_dict()["state"]
    moments = sum(
        local_bytes(value)
        for state in states.values()
        for key, value in state.items()
        if key in ("exp_avg", "exp_avg_sq")
    )
    return {
        "sharding": engine.setup.sharding,
        "base_bytes": base,
        "adapter_bytes": adapters,
        "optimizer_bytes": moments,
        "losses": losses,
        "adapters": initial,
        "trainable_dtype": str(next(parameter.dtype for parameter in lm.parameters() if parameter.requires_grad)),
        "finite": all(bool(torch.isfinite(torch.tensor(loss))) for loss in losses),
    }


def ranks_worker(quantize: str) -> None:
    import torch.distributed as dist

    from benchtrain.common.errors import BenchtrainError
    from benchtrain.train.step.runtime import finish_together, leave

    try:
        report = train_steps("fsdp", quantize)  # accelerate starts the process group
    except BenchtrainError as error:
        report = {"refused": str(error)}
    report["rank"] = dist.get_rank()
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, report)
    if dist.get_rank() == 0:
        print(json.dumps(ranks), flush=True)
    finish_together()
    leave(0)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_lora_under_fsdp_trains_as_one_process_and_each_rank_holds_half_the_base(fork_server: Any) -> None:
    """Two ranks: each holds half of the frozen base (and of the adapters and their AdamW moments),
    the adapters start as one process's do (bit for bit), and the losses are one process's."""
    alone = train_steps("ddp")  # one process: no sharding
    assert alone["sharding"] == "none" and alone["finite"]
    ranks = fork_server.group_report(Path(__file__), ["ranks", "none"], timeout=200)
    assert sorted(rank["rank"] for rank in ranks) == [0, 1]
    for rank in ranks:
        assert rank["sharding"] == "fsdp"
        # Half each, within a row of each tensor where a dimension does not split evenly.
        assert rank["base_bytes"] == pytest.approx(alone["base_bytes"] / 2, rel=0.02)
        assert rank["adapter_bytes"] == pytest.approx(alone["adapter_bytes"] / 2, rel=0.1)
        assert rank["optimizer_bytes"] == pytest.approx(alone["optimizer_bytes"] / 2, rel=0.1)
        assert rank["trainable_dtype"] == "torch.float32"
        assert rank["losses"] == pytest.approx(alone["losses"], rel=1e-5)
    # The memory check's share of a process (train.planning.memory_check): what each rank holds.
    from benchtrain.train.planning.memory_check import memory_need
    from benchtrain.train.workload.method import MethodConfig

    need = memory_need(spec_of(), MethodConfig(method="lora", lora_rank=LORA_RANK), "cpu")
    assert (
        alone["base_bytes"] + alone["adapter_bytes"] == need.weights_bytes
        and alone["optimizer_bytes"] == need.optimizer_bytes
    )
    for rank in ranks:
        held = rank["base_bytes"] + rank["adapter_bytes"] + rank["optimizer_bytes"]
        assert held == pytest.approx((need.weights_bytes + need.optimizer_bytes) / 2, rel=0.02)
        assert held < need.per_process_bytes("fsdp", 2, "cpu") < need.total_bytes
    rank0 = next(rank for rank in ranks if rank["rank"] == 0)
    assert set(rank0["adapters"]) == set(alone["adapters"]) and all("lora_" in name for name in rank0["adapters"])
    assert rank0["adapters"] == alone["adapters"]  # gathered adapters: the one-process build's initial values


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "ranks":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    ranks_worker(sys.argv[2] if len(sys.argv) > 2 else "none")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("quantize", ["none", "4bit"])
def test_a_lora_run_under_fsdp_checkpoints_resumes_and_exports_an_adapter(
    quantize: str, home: Path, heavy_tailed_jsonl: Path, fork_server: Any
) -> None:
    """`train --lora [--quantize 4bit] --sharding fsdp` under two processes: the losses of DDP's run;
    a checkpoint of the adapters alone (gathered from the shards), a resume that continues from it,
    and a final/ that peft loads with the last checkpoint's adapters onto the preset's base
    (quantized again as it trained)."""
    if quantize != "none":
        pytest.importorskip("bitsandbytes")
    import torch
    from helpers import pretend_interrupted, synthetic_calibration
    from safetensors.torch import load_file

    from benchtrain.calibration.store import save_calibration
    from benchtrain.train.export import load_final
    from benchtrain.train.step.hardware import detect_hardware
    from benchtrain.train.workload.model import resolve_model

    tiny = {"name": "tiny", "parameter_count": 1, "fingerprint": resolve_model("tiny").fingerprint}
    save_calibration(synthetic_calibration(hardware=detect_hardware(), model=tiny))
    # --force: a full fine-tuning calibration plans the LoRA run.
    method = ["--lora", "--lora-rank", "4", "--quantize", quantize]
    train = [
        "--data",
        str(heavy_tailed_jsonl),
        "--deadline",
        "30m",
        "--effective-batch",
        "4",
        "--no-report",
        *method,
        "--force",
    ]

    def launch(arguments: list[str]) -> Any:
        result = fork_server.run_group("train", arguments, home / "ranks", env={"BENCHTRAIN_HOME": str(home)})
        assert result.returncode == 0, result.stderr[-3000:]
        return result

    ddp, fsdp = home / "ddp", home / "fsdp"
    for out, sharding in ((ddp, "ddp"), (fsdp, "fsdp")):
        launch([*train, "--out", str(out), "--sharding", sharding, "--max-steps", "3"])
    sharded, replicated = (json.loads((out / "run.json").read_text()) for out in (fsdp, ddp))
    assert sharded["plan"]["sharding"] == "fsdp" and sharded["plan"]["method"] == "lora"
    assert [entry["loss"] for entry in sharded["losses"]] == pytest.approx(
        [entry["loss"] for entry in replicated["losses"]], rel=1e-4
    )
    saved = load_file(str(fsdp / "checkpoints" / "step-0000003" / "model.safetensors"))
    assert saved and all("lora_" in name for name in saved)  # the adapters alone, whole

    pretend_interrupted(fsdp, 5)
    launch([*train, "--out", str(fsdp), "--sharding", "fsdp", "--max-steps", "5", "--resume"])
    resumed = json.loads((fsdp / "run.json").read_text())
    assert [entry["step"] for entry in resumed["losses"]] == list(range(1, 6)) and resumed["losses"][:3] == sharded[
        "losses"
    ]
    last = load_file(str(fsdp / "checkpoints" / "step-0000005" / "model.safetensors"))
    assert any(not torch.equal(last[name], saved[name]) for name in saved)  # trained on from step 3
    final = load_final(fsdp / "final")
    loaded = final.state_dict()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in last.items())


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_qlora_under_fsdp_is_checked_by_measurement_then_trains_as_one_process(fork_server: Any) -> None:
    """A 4-bit base (NF4, stored in the compute dtype) under FSDP2 on two ranks: bitsandbytes
    0.50 on CPU computes the same logits sharded as whole (train.step.sharding measures it before
    training), each rank keeps half of the packed base, and the losses are one process's (whose base
    is stored as uint8: the same bytes)."""
    pytest.importorskip("bitsandbytes")
    alone = train_steps("ddp", "4bit")
    assert alone["sharding"] == "none" and alone["finite"]
    ranks = fork_server.group_report(Path(__file__), ["ranks", "4bit"], timeout=200)
    for rank in ranks:
        assert rank["sharding"] == "fsdp"
        assert rank["base_bytes"] == pytest.approx(alone["base_bytes"] / 2, rel=0.02)
        assert rank["losses"] == pytest.approx(alone["losses"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_4bit_base_that_sharding_would_change_is_refused_in_one_line(fork_server: Any) -> None:
    """Under bf16 mixed precision on CPU (BENCHTRAIN_CPU_BF16=1) the 4-bit base is stored as fp32,
    its CPU compute dtype, and FSDP would cast the packed values to bf16 as it gathers them: the
    sharded layers no longer compute (bitsandbytes reads the bf16 tensor as half the bytes), and
    every rank refuses in one line naming the cause, before any step."""
    pytest.importorskip("bitsandbytes")
    ranks = fork_server.group_report(Path(__file__), ["ranks", "4bit"], timeout=200, env={"BENCHTRAIN_CPU_BF16": "1"})
    assert len(ranks) == 2
    for rank in ranks:
        refusal = rank.get("refused", "")
        assert "\n" not in refusal and refusal.startswith(
            "--sharding fsdp with --quantize 4bit: it fails after sharding"
        )
        assert (
            "casts the packed 4-bit values, stored as torch.float32, to torch.bfloat16" in refusal
            and "--sharding ddp" in refusal
        )


def seventy_b_slices() -> dict[str, Any]:
    """A LoRA calibration of llama-3.1-70b measured on slices (2, 4, 6 of its 80 layers) of the
    simulated H100, gradient checkpointing on, one process (tests/simulated_slices.py)."""
    from simulated_slices import simulate_slices

    record, _, _ = simulate_slices("llama-3.1-70b", True, 300.0, (2, 4, 6), checkpointing=(1,))
    return record


def as_4bit(record: dict[str, Any]) -> dict[str, Any]:
    """Test data: the bf16-base calibration with its fixed bytes exchanged for the 4-bit base's
    (the simulated H100 measures no 4-bit base; its speed is left as the bf16 base's)."""
    import copy

    from benchtrain.calibration.model import Calibration
    from benchtrain.train.planning.memory_check import memory_need
    from benchtrain.train.workload.method import MethodConfig
    from benchtrain.train.workload.model import resolve_model

    spec = resolve_model("llama-3.1-70b")
    saved = (
        memory_need(spec, MethodConfig(method="lora"), "cuda").total_bytes
        - memory_need(spec, MethodConfig(method="lora", quantize="4bit"), "cuda").total_bytes
    )
    quantized = copy.deepcopy(record)
    quantized["training"] = {**quantized["training"], "quantization": "4bit"}
    quantized["fit"]["memory"]["parameters"]["static"] -= saved
    for row in quantized["measurements"]:
        if isinstance(row.get("peak_memory_bytes"), (int, float)):
            row["peak_memory_bytes"] -= saved
    assert Calibration(quantized).variant.quantize == "4bit"
    return quantized


def consider_70b(record: dict[str, Any], quantize: str) -> list[Any]:
    """`train --dry-run --model llama-3.1-70b --lora [--quantize 4bit] --sharding fsdp --consider
    h100:2,h100:4,h100:8` from `record`: the rows by machine size."""
    from helpers import heavy_tailed, tokenized

    from benchtrain.calibration.model import Calibration
    from benchtrain.train.recipes.config import TrainConfig
    from benchtrain.train.recipes.machines import consider, parse_machines
    from benchtrain.train.recipes.run_plan import PlanContext
    from benchtrain.train.step.engine import StepOptions
    from benchtrain.train.step.hardware import detect_hardware
    from benchtrain.train.workload.data import length_profile
    from benchtrain.train.workload.method import MethodConfig
    from benchtrain.train.workload.model import resolve_model

    config = TrainConfig.of(
        data="test", dry_run=True, deadline="24h", quantize=quantize, step_options=StepOptions(sharding="fsdp")
    )
    data = tokenized(heavy_tailed(400))
    context = PlanContext(config, resolve_model("llama-3.1-70b"), data, None, 0.0)
    method = MethodConfig(method="lora", quantize=quantize)
    machines = parse_machines("h100:2,h100:4,h100:8")
    comparison = consider(
        context,
        method,
        [Calibration(record)],
        Hardware.from_record(detect_hardware()),
        length_profile(data.lengths),
        machines,
    )
    return sorted(comparison.rows, key=lambda row: row.processes)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_70b_lora_and_qlora_are_planned_for_2_4_and_8_h100s_with_their_memory_per_rank() -> None:
    """A 70B LoRA (141 GB of bf16 base) and QLoRA (≈38 GB of 4-bit base) planned under FSDP for 2, 4
    and 8 H100s from a 1-process slice calibration: each process holds its 1/N of the base, the
    adapters and their state (the plan's memory offset) plus activations; LoRA's 70 GiB of shards
    leave no room for activations on two H100s; QLoRA fits on two."""
    from benchtrain.calibration.comm import communicator_bytes
    from benchtrain.train.planning.memory_check import memory_need
    from benchtrain.train.workload.method import MethodConfig
    from benchtrain.train.workload.model import resolve_model

    spec = resolve_model("llama-3.1-70b")
    assert (
        spec.config_dict["hidden_size"],
        spec.config_dict["num_hidden_layers"],
        spec.config_dict["intermediate_size"],
    ) == (8192, 80, 28672)
    record = seventy_b_slices()
    for quantize, planned in (("none", (4, 8)), ("4bit", (2, 4, 8))):
        rows = consider_70b(record if quantize == "none" else as_4bit(record), quantize)
        assert [row.processes for row in rows] == [2, 4, 8]
        need = memory_need(spec, MethodConfig(method="lora", quantize=quantize), "cuda")
        peaks = {}
        for row in rows:
            processes = row.processes
            if processes not in planned:
                assert row.run_plan is None and "fits in memory" in (row.problem or ""), row.problem
                # its shards alone nearly fill it
                assert need.per_process_bytes("fsdp", processes, "cuda") > 0.85 * row.device.memory_bytes
                continue
            assert row.run_plan is not None, row.problem
            assert row.run_plan.fitted.step.sharding == "fsdp" and row.run_plan.fitted.step.world_size == processes
            peak = row.run_plan.plan.chosen.peak_memory_bytes
            held = need.per_process_bytes("fsdp", processes, "cuda") + communicator_bytes(
                row.run_plan.fitted.hardware, processes
            )
            # its share, the gathered blocks and NCCL's buffers, then activations
            assert held < peak <= 0.95 * row.device.memory_bytes
            peaks[processes] = peak
        assert list(peaks.values()) == sorted(peaks.values(), reverse=True)  # more GPUs, less on each


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("quantize", ["none", "4bit"])
def test_bench_calibrates_lora_under_fsdp_and_train_plans_from_it(
    quantize: str, home: Path, heavy_tailed_jsonl: Path, fork_server: Any
) -> None:
    """`bench run --gpu cpu --lora [--quantize 4bit] --sharding fsdp` under two processes stores a
    2-process FSDP calibration (a 4-bit base checked as sharded before its probes), and
    `train --dry-run` plans the same run from it, its collectives measured by that bench."""
    if quantize != "none":
        pytest.importorskip("bitsandbytes")
    env = {"BENCHTRAIN_HOME": str(home)}
    grid = [
        "--gpu",
        "cpu",
        "--batch-sizes",
        "1,2",
        "--seq-lens",
        "32,64",
        "--workers",
        "0",
        "--accum",
        "1",
        "--no-report",
        "--quiet",
    ]
    method = ["--lora", "--lora-rank", "4", "--quantize", quantize, "--sharding", "fsdp"]
    result = fork_server.run_group("bench", ["run", *grid, *method, "--budget", "60s"], home / "ranks", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    (path,) = (home / "calibrations").glob("*.json")
    calibration = json.loads(path.read_text())
    training = calibration["training"]
    assert (
        training["method"] == "lora"
        and training["sharding"] == "fsdp"
        and (training.get("quantization") or "none") == quantize
    )
    assert calibration["distributed"]["world_size"] == 2 and calibration["distributed"]["sharding"] == "fsdp"
    assert sum(row["status"] == "ok" for row in calibration["measurements"]) >= 2
    planned = [
        "--data",
        str(heavy_tailed_jsonl),
        "--deadline",
        "30m",
        *method,
        "--use-calibration",
        calibration["id"],
        "--dry-run",
    ]
    result = fork_server.run_group("train", planned, home / "ranks", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "measured in the calibration's 2-process fsdp step times" in result.stdout


def test_a_70b_plan_per_rank_counts_what_fsdp_shards_and_what_a_4bit_base_builds_whole() -> None:
    """llama-3.1-70b's fixed memory per GPU under FSDP: LoRA's bf16 base (134.5 GiB in all) in eighths
    on 8 H100s; QLoRA's 4-bit base (≈44 GiB) in quarters on 4 GPUs of 24 GiB, which it does not fit
    while each process first builds the whole 4-bit base: one line saying so."""
    from benchtrain.common.errors import DoesNotFitError
    from benchtrain.train.planning.memory_check import GIB, check_fits, gpus_needed, memory_need
    from benchtrain.train.workload.method import MethodConfig
    from benchtrain.train.workload.model import resolve_model

    spec = resolve_model("llama-3.1-70b")
    h100 = Hardware.from_record({"name": "NVIDIA H100 80GB HBM3", "device_type": "cuda", "memory_bytes": 79.2 * GIB})
    lora = check_fits(spec, MethodConfig(method="lora"), h100, "fsdp", 8)
    assert 134 * GIB < lora.total_bytes < 135 * GIB and lora.building_bytes("fsdp") == 0
    assert lora.per_process_bytes("fsdp", 8, "cuda") == pytest.approx(
        lora.total_bytes / 8 + 2 * lora.largest_block_parameters * 2
    )
    assert gpus_needed(lora, h100) == 2
    qlora = memory_need(spec, MethodConfig(method="lora", quantize="4bit"), "cuda")
    assert (
        40 * GIB < qlora.total_bytes < 48 * GIB
        and qlora.building_bytes("fsdp") == qlora.weights_bytes
        and qlora.building_bytes("ddp") == 0
    )
    small = Hardware.from_record({"name": "NVIDIA L4", "device_type": "cuda", "memory_bytes": 22 * GIB})
    assert qlora.per_process_bytes("fsdp", 4, "cuda") < small.memory_bytes  # its shards would fit
    with pytest.raises(
        DoesNotFitError, match="under FSDP builds the whole 4-bit base on each process before sharding it"
    ) as refused:
        check_fits(spec, MethodConfig(method="lora", quantize="4bit"), small, "fsdp", 4)
    assert "\n" not in str(refused.value) and gpus_needed(qlora, small) is None
    assert (
        check_fits(spec, MethodConfig(method="lora", quantize="4bit"), h100, "fsdp", 2).building_bytes("fsdp")
        < h100.memory_bytes
    )


def test_a_lora_model_built_on_meta_for_a_gpu_has_its_bf16_base_and_fp32_adapters() -> None:
    """FSDP builds on `meta` for the device the shards will live on: a LoRA base for CUDA is bf16
    there (as the memory plan counts it), its adapters fp32 (FSDP2 takes both in one unit, the
    adapters gathered in bf16 under mixed precision); for a CPU the base is fp32."""
    import torch

    from benchtrain.train.workload.method import MethodConfig
    from benchtrain.train.workload.model import build_model

    for target, base_dtype in (("cuda", torch.bfloat16), ("cpu", torch.float32)):
        model = build_model(
            spec_of(), "meta", MethodConfig(method="lora", lora_rank=LORA_RANK), shardable=True, weights_on=target
        )
        assert {parameter.dtype for parameter in model.parameters() if not parameter.requires_grad} == {base_dtype}
        assert {parameter.dtype for parameter in model.parameters() if parameter.requires_grad} == {torch.float32}


def test_which_bases_fsdp_shards_is_settled_with_the_processes() -> None:
    """Under FSDP a bf16 or 4-bit LoRA base is sharded; an 8-bit one (int8 weights) is one line; one
    process shards nothing, so nothing is refused there."""
    pytest.importorskip("bitsandbytes")
    from benchtrain.common.errors import BenchtrainError
    from benchtrain.train.step.engine import StepOptions, process_layout
    from benchtrain.train.workload.method import MethodConfig

    fsdp = StepOptions(sharding="fsdp")
    for quantize in ("none", "4bit"):
        assert process_layout(fsdp, MethodConfig(method="lora", quantize=quantize), processes=4).sharding == "fsdp"
    with pytest.raises(
        BenchtrainError,
        match=r"--sharding fsdp with --quantize 8bit: an 8-bit base cannot be sharded .*--quantize 4bit, or --sharding ddp",
    ):
        process_layout(fsdp, MethodConfig(method="lora", quantize="8bit"), processes=4)
    assert process_layout(fsdp, MethodConfig(method="lora", quantize="8bit"), processes=1).sharding == "none"
