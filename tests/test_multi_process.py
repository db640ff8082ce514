"""Several processes: data sharded without duplicates, the all-reduce and FSDP communication models,
FSDP's memory per shard, which calibration a multi-process run plans from, LR scaling, and how
bench combines the ranks' probes; as a process group (tests/distributed_checks.py, ranks forked by
tests/forkserver.py with torchrun's variables): the learning-rate schedule and a probe that runs out
of memory on one rank. The commands under torchrun are in
tests/test_cli.py (test_two_processes_under_torchrun, test_fsdp_under_torchrun)."""

from __future__ import annotations

import numpy as np
import pytest
from forkserver import ForkServer
from helpers import DISTRIBUTED_CHECKS as CHECKS
from helpers import heavy_tailed, synthetic_calibration

from benchtrain.bench.probe_tasks import combine_rows
from benchtrain.calibration.comm import BUCKET_BYTES, CommModel, fit_comm, fsdp_micro_step_seconds, gradient_bytes
from benchtrain.calibration.hardware import Hardware
from benchtrain.calibration.model import Calibration
from benchtrain.calibration.step_config import StepConfig
from benchtrain.common.errors import BenchtrainError
from benchtrain.train.planning.comm import Traffic, plan_communication, traffic_of
from benchtrain.train.planning.memory_check import check_fits, memory_need
from benchtrain.train.step.hyperparameters import scaled_learning_rate
from benchtrain.train.workload.batching import packed_row_count, plan_packed_batches, plan_padded_batches, shard
from benchtrain.train.workload.method import MethodConfig
from benchtrain.train.workload.model import resolve_model


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("packing", [False, True])
def test_every_sample_is_seen_once_per_epoch_and_every_rank_runs_the_same_steps(world_size: int, packing: bool) -> None:
    lengths = heavy_tailed(203)
    if packing:
        rows = packed_row_count(sum(lengths), 64)
        batches, samples = plan_packed_batches(rows, 4, seed=0, epoch=1), rows
    else:
        batches, samples = plan_padded_batches(lengths, 4, 256, seed=0, epoch=1), len(lengths)
    shares = [shard(batches, rank, world_size) for rank in range(world_size)]
    seen = [int(sample) for share in shares for batch in share for sample in batch]
    assert sorted(seen) == list(range(samples))  # each once, none dropped
    assert len({len(share) for share in shares}) == 1  # the same number of steps everywhere
    assert list(shard(batches, 0, 1)) == list(batches)


def test_a_few_leftover_samples_are_dealt_out_with_the_last_round() -> None:
    batches = [[0, 1], [2, 3], [4]]  # one sample left over for two processes
    shares = [shard(batches, rank, 2) for rank in range(2)]
    assert shares == [[[0, 4], [2]], [[1], [3]]]
    assert all(len(batch) <= 2 for share in shares for batch in share)  # never bigger than planned
    # micro-batch 1: dropped, not duplicated
    assert [shard([[0], [1], [2]], rank, 2) for rank in range(2)] == [
        [[0]],
        [[1]],
    ]


def test_all_reduce_model_fits_latency_and_bandwidth() -> None:
    latency, per_byte = 0.002, 1 / 5e9
    rows = [{"bytes": size, "seconds": latency + size * per_byte} for size in (2**16, 2**20, 2**22, 2**24)]
    model = fit_comm(rows, 4, "nccl")
    assert model.latency_seconds == pytest.approx(latency, rel=1e-6)
    assert model.bandwidth_bytes_per_second == pytest.approx(5e9, rel=1e-6)
    gradients = gradient_bytes(1_000_000_000)  # a 1B model: 4 GB of fp32 gradients
    buckets = -(-gradients // BUCKET_BYTES)
    assert model.all_reduce_seconds(gradients) == pytest.approx(buckets * latency + gradients * per_byte)
    assert CommModel(1, "none", latency, per_byte).all_reduce_seconds(gradients) == 0.0
    assert CommModel.from_json(model.to_json()) == model


def test_which_calibration_a_multi_process_run_plans_from() -> None:
    single = Calibration(synthetic_calibration())
    ddp = Traffic("ddp", 10**6)
    alone = {"source": "single process", "world_size": 1, "sharding": "none", "seconds_per_step": 0.0}
    assert plan_communication(single, 1, ddp, force=False) == (0.0, 0.0, alone)
    comm = {"world_size": 2, "backend": "gloo", "latency_seconds": 0.001, "seconds_per_byte": 1e-9}
    two = Calibration(
        synthetic_calibration(distributed={"world_size": 2, "backend": "gloo", "sharding": "ddp", "comm": comm})
    )
    assert two.world_size == 2 and two.sharding == "ddp"
    per_step, per_micro_step, record = plan_communication(two, 2, ddp, force=False)
    assert per_step == per_micro_step == 0.0 and record["source"] == "calibration"  # its step times hold the all-reduce
    with pytest.raises(BenchtrainError, match="measured with 2 processes, this run has 4"):
        plan_communication(two, 4, ddp, force=False)
    # The same world size but another sharding: its step times hold other collectives.
    with pytest.raises(BenchtrainError, match="measured with --sharding ddp, this run uses fsdp"):
        plan_communication(two, 2, Traffic("fsdp", 10**6, 10**6, 3), force=False)
    assert plan_communication(two, 2, Traffic("fsdp", 10**6, 10**6, 3), force=True)[2]["source"] == "calibration"


def test_fsdp_traffic_per_micro_step() -> None:
    """Every unit gathered for forward and again for backward, its gradients reduce-scattered."""
    gather = CommModel(4, "nccl", 50e-6, 1 / 100e9)
    scatter = CommModel(4, "nccl", 80e-6, 1 / 50e9)
    need = memory_need(resolve_model("llama-3.1-8b"), MethodConfig(), "cuda")
    traffic = traffic_of("fsdp", need, "cuda")
    assert traffic.units == 32 + 1 and traffic.parameter_bytes == 2 * need.total_parameters  # bf16 gathers on CUDA
    assert traffic.gradient_bytes == 4 * need.trainable_parameters
    seconds = fsdp_micro_step_seconds(gather, scatter, traffic.parameter_bytes, traffic.gradient_bytes, traffic.units)
    expected = 2 * (33 * 50e-6 + traffic.parameter_bytes / 100e9) + 33 * 80e-6 + traffic.gradient_bytes / 50e9
    assert seconds == pytest.approx(expected)
    assert traffic_of("ddp", need, "cuda") == Traffic("ddp", traffic.gradient_bytes)
    assert traffic_of("fsdp", need, "cpu").parameter_bytes == 4 * need.total_parameters


def test_fsdp_holds_a_shard_of_what_one_device_cannot() -> None:
    """Full fine-tuning of an 8B model needs ≈120 GiB before activations: refused on one H100 with
    the FSDP advice; four FSDP processes hold a quarter each plus two gathered blocks."""
    h100 = Hardware.from_record({"device_type": "cuda", "name": "NVIDIA H100 80GB HBM3", "memory_bytes": 79 * 2**30})
    spec = resolve_model("llama-3.1-8b")
    with pytest.raises(BenchtrainError, match="sharding fsdp"):
        check_fits(spec, MethodConfig(), h100.with_memory(20 * 2**30))
    need = check_fits(spec, MethodConfig(), h100, "fsdp", 4)
    assert need.blocks == 32 and 200e6 < need.largest_block_parameters < 220e6
    per_process = need.per_process_bytes("fsdp", 4, "cuda")
    assert per_process == need.total_bytes / 4 + 2 * need.largest_block_parameters * 2
    assert need.per_process_bytes("ddp", 4, "cuda") == need.total_bytes == need.per_process_bytes("fsdp", 1, "cuda")
    with pytest.raises(BenchtrainError, match=r"needs ≈1\d\d GiB"):
        check_fits(spec, MethodConfig(), h100, "ddp", 4)


def test_a_sharded_plan_predicts_less_memory_than_the_probes_held() -> None:
    calibration = Calibration(synthetic_calibration())
    whole = calibration.predict(StepConfig(2, 0, 1, 64))
    sharded = calibration.predict(StepConfig(2, 0, 1, 64), memory_offset_bytes=-(whole.peak_memory_bytes / 2))
    assert sharded.peak_memory_bytes == pytest.approx(whole.peak_memory_bytes / 2)
    assert sharded.peak_memory_bytes_high < whole.peak_memory_bytes_high


def test_learning_rate_scaling() -> None:
    assert scaled_learning_rate(1e-4, "none", 8, 32) == 1e-4
    assert scaled_learning_rate(1e-4, "linear", 8, 32) == pytest.approx(4e-4)
    assert scaled_learning_rate(1e-4, "sqrt", 8, 32) == pytest.approx(2e-4)
    assert scaled_learning_rate(1e-4, "sqrt", None, 32) == 1e-4  # no base batch: nothing to scale from


def test_bench_combines_the_ranks_probes() -> None:
    ok = {"status": "ok", "step_seconds": 1.0, "peak_memory_bytes": 10, "tokens_per_second": 100.0}
    slow = {**ok, "step_seconds": 1.2, "peak_memory_bytes": 8, "tokens_per_second": 83.0}
    combined = combine_rows([ok, slow])
    assert combined["step_seconds"] == 1.2 and combined["tokens_per_second"] == 83.0  # the slowest rank sets the pace
    assert combined["peak_memory_bytes"] == 10 and combined["ranks"] == 2
    # an OOM anywhere is an OOM
    assert combine_rows([ok, {"status": "oom", "error": "OutOfMemoryError"}])["status"] == "oom"
    assert np.isclose(combine_rows([ok])["step_seconds"], 1.0)


def test_latest_is_the_newest_calibration_that_suits_the_run(home: object) -> None:
    """`train` picks the newest calibration of its model and method measured with its processes
    and sharding, else the newest of one process, else the newest; an explicit id is kept."""
    import benchtrain.calibration as calibration_api
    from benchtrain.calibration.store import save_calibration
    from benchtrain.train.recipes.choice import calibration_preferences

    ddp2 = {
        "world_size": 2,
        "backend": "gloo",
        "sharding": "ddp",
        "comm": {"world_size": 2, "backend": "gloo", "latency_seconds": 0, "seconds_per_byte": 1e-9},
    }
    stored = {
        "one-full": synthetic_calibration(
            id="one-full", created_at="2026-01-01T00:00:00+00:00", training={"method": "full"}
        ),
        "two-ddp": synthetic_calibration(
            id="two-ddp", created_at="2026-01-02T00:00:00+00:00", training={"method": "full"}, distributed=ddp2
        ),
        "one-lora": synthetic_calibration(
            id="one-lora", created_at="2026-01-03T00:00:00+00:00", training={"method": "lora"}
        ),
        "other-model": synthetic_calibration(
            id="other-model",
            created_at="2026-01-04T00:00:00+00:00",
            model={"name": "x", "parameter_count": 1, "fingerprint": "zzz"},
        ),
    }
    for data in stored.values():
        save_calibration(data)

    class Spec:
        fingerprint = "abc"

    def latest(method: str, processes: tuple[int, str]) -> str:
        return calibration_api.load(
            "latest", preferences=calibration_preferences(Spec(), MethodConfig(method=method), processes)
        ).id

    assert latest("full", (2, "ddp")) == "two-ddp"  # measured with this run's processes
    assert latest("full", (1, "none")) == "one-full"  # not the newer 2-process or LoRA ones
    assert latest("full", (4, "ddp")) == "one-full"  # none of 4: one process, communication predicted
    assert latest("lora", (2, "ddp")) == "one-lora"
    assert calibration_api.load("latest").id == "other-model"  # without preferences: the newest


def test_the_communication_line_reads_old_and_new_records() -> None:
    """run.json records from before FSDP (DDP only, `comm`) and after (`collectives`) give the
    same kind of line in the plan and the run report."""
    from benchtrain.calibration.comm import describe_communication
    from benchtrain.reports.run_report import _plan_value

    fit = CommModel(2, "gloo", 0.001, 1e-9).to_json()
    old = {
        "source": "predicted",
        "world_size": 2,
        "calibration_world_size": 1,
        "gradient_bytes": 2**22,
        "seconds_per_step": 0.005,
        "comm": fit,
    }
    assert describe_communication(old) == (
        "communication: predicted — 1-process calibration + ddp collectives measured now among 2 processes "
        "(all-reduce 1.00 GB/s, 1.00 ms latency): 4 MiB of gradients, +5.0 ms per optimizer step"
    )
    new = {
        **old,
        "sharding": "fsdp",
        "parameter_bytes": 2**21,
        "seconds_per_micro_step": 0.002,
        "collectives": {"all_gather": {"fit": fit}},
    }
    text = describe_communication(new)
    assert "2 MiB of parameters" in text and "4 MiB of gradients" in text and text.endswith("+2.0 ms per micro-step")
    assert _plan_value("communication", {"source": "single process", "world_size": 1}) == "one process: none"
    assert _plan_value("world_size", 2) == 2


@pytest.mark.slow
def test_the_learning_rate_schedule_is_the_same_under_two_and_three_processes(fork_server: ForkServer) -> None:
    """accelerate's prepared scheduler would step once per process per optimizer step: under N
    processes the cosine reached zero after 1/N of the run and climbed back. The schedule now warms
    up, decays once and ends at its floor, step for step as in one process."""
    from distributed_checks import learning_rate_curve

    steps = 40  # 2 warm-up steps (5%)
    alone = learning_rate_curve(steps)
    rates = alone["rates"]
    peak = rates.index(max(rates))
    assert alone["processes"] == 1 and peak == 2 and rates[:3] == sorted(rates[:3])  # warm-up
    # one decay, no rise
    assert all(later <= earlier for earlier, later in zip(rates[peak:], rates[peak + 1 :], strict=False))
    assert alone["final"] == 0.0 and rates[-1] < 0.01 * rates[peak]  # the floor after the last step
    for processes in (2, 3):
        shared = fork_server.group_report(CHECKS, ["lr-curve", str(steps)], processes)
        assert shared["processes"] == processes
        assert shared["rates"] == pytest.approx(rates, rel=1e-12) and shared["final"] == alone["final"]


@pytest.mark.slow
def test_a_probe_out_of_memory_on_one_rank_ends_on_every_rank(fork_server: ForkServer) -> None:
    """Rank 0 alone runs out of memory in the probe's first step: every rank learns it before any
    collective, so none is left in DDP's all-reduce; the probe is an OOM, and the next one runs."""
    assert fork_server.group_report(CHECKS, ["one-rank-oom"], timeout=120)["statuses"] == ["oom", "ok"]
