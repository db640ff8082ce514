"""A calibration translated to a device nobody measured (issue 41): datasheet figures with their
sources, the same-device identity, brackets within the datasheet ratios, memory kept and checked,
refusals across vendors and between CPU and GPU, and a plan judged at the bracket's upper end."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import tokenized_from_samples

from benchtrain.calibration.datasheets import SHEETS, sheet_for
from benchtrain.calibration.model import Calibration
from benchtrain.calibration.schema import read_calibration_file, validate
from benchtrain.calibration.split import step_splits
from benchtrain.calibration.step_config import StepConfig
from benchtrain.calibration.store import bundled_calibrations
from benchtrain.calibration.translate import bracket_for, translate
from benchtrain.common.errors import BenchtrainError, DoesNotFitError
from benchtrain.train.planning.deadline import Deadline
from benchtrain.train.planning.plan_text import describe_error, describe_plan
from benchtrain.train.planning.planner import make_plan
from benchtrain.train.planning.types import PlanRequest
from benchtrain.train.step.hardware import peak_flops
from benchtrain.train.workload.tokens import TokenizedData

GIB = 2**30
# Published independently of the table, by NVIDIA's announcements: the H200 has "1.4X more memory
# bandwidth" than the H100 (nvidianews.nvidia.com, 2023-11-13), and the H100 SXM "3x" the A100's
# dense FP16/BF16 tensor throughput (H100 Tensor Core GPU architecture whitepaper, 2022).
PUBLISHED_H200_BANDWIDTH_GAIN = 1.4
PUBLISHED_H100_OVER_A100_FLOPS = 3.0


def time_ratios(source: str, target: str) -> tuple[float, float]:
    """A step's time factor from `source` to `target` when all of it is memory-bound and when all of
    it is compute-bound: the two datasheet rows' bandwidth and dense-bf16 ratios."""
    a, b = sheet_for(source), sheet_for(target)
    assert a is not None and b is not None
    return a.memory_bandwidth / b.memory_bandwidth, a.bf16_dense_flops / b.bf16_dense_flops


def h100() -> dict[str, Any]:
    """The real H100 calibration that ships, as read."""
    return read_calibration_file(bundled_calibrations()["h100-llama-3.2-1b"])


def compute_bound(data: dict[str, Any], compute: float = 0.9, memory: float = 0.1) -> dict[str, Any]:
    """`data` with a step that has no host part: a fit without its fixed and data terms, and a
    profiler split of `compute` and `memory` seconds."""
    data = copy.deepcopy(data)
    for term in ("fixed", "serial_data", "worker_supply", "per_worker"):
        data["fit"]["parameters"][term] = 0.0
    data["step_split"] = [
        {"micro_batch_size": 8, "seq_len": 1024, "grad_accum": 1, "num_workers": 0, "gradient_checkpointing": 0,
         "compute_seconds": compute, "memory_seconds": memory, "host_seconds": 0.0, "method": "profiler"}
    ]  # fmt: skip
    return data


def chats(count: int = 400, length: int = 500) -> TokenizedData:
    rng = np.random.default_rng(0)
    samples = [
        rng.integers(3, 200, size=int(n)).astype(np.int32)
        for n in rng.integers(length // 2, length * 3 // 2, size=count)
    ]
    return tokenized_from_samples(samples, [0] * count, "messages", "test")


def plan_with(data: dict[str, Any]) -> Any:
    return make_plan(
        Calibration(data),
        chats(),
        PlanRequest(epochs=1, deadline=Deadline.with_margin_share(1e6, 0.05), effective_batch=16),
    )


# -- the datasheet table ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("h100", "h100"), ("h100-pcie", "h100-pcie"), ("h200", "h200"), ("a100-40gb", "a100-40gb"), ("a100-80gb-pcie", "a100-80gb-pcie"),
        ("l40s", "l40s"), ("4090", "4090"), ("rtx-4090", "4090"), ("b200", "b200"), ("a100", "a100-40gb"),
        ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H100 NVL", "h100-nvl"), ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"), ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("NVIDIA A100-PCIE-40GB", "a100-40gb-pcie"),
        ("NVIDIA A100 80GB PCIe", "a100-80gb-pcie"), ("NVIDIA L4", "l4"), ("NVIDIA L40", "l40"), ("NVIDIA A10G", "a10g"),
        ("NVIDIA GeForce RTX 4090", "4090"), ("AMD Instinct MI300X", "mi300x"), ("NVIDIA GH200 480GB", "gh200"),
    ],
)  # fmt: skip
def test_keys_and_device_names_find_their_datasheet_row(text: str, key: str) -> None:
    sheet = sheet_for(text)
    assert sheet is not None and sheet.key == key


def test_every_row_has_its_sources_and_round_trips_by_its_device_name() -> None:
    assert sheet_for("NVIDIA RTX A6000") is None and sheet_for("AMD EPYC 7B13") is None and sheet_for("cpu") is None
    for sheet in SHEETS:
        assert sheet_for(sheet.device_name) is sheet and sheet_for(sheet.key) is sheet
        assert sheet.sources and all("http" in source for source in sheet.sources)
        # Dense bf16, not the sparse figure: no GPU here reaches 10 FLOP per byte of its own memory per second × 1000.
        assert 0 < sheet.bf16_dense_flops < 2.5e15 and sheet.memory_bandwidth > 0 and sheet.memory_bytes >= 24e9
        assert (sheet.nvlink_bandwidth is None) == (sheet.peer_link is None or not sheet.peer_link.startswith("NVLink"))
    assert sheet_for("h200").memory_bandwidth / sheet_for("h100").memory_bandwidth == pytest.approx(
        PUBLISHED_H200_BANDWIDTH_GAIN, rel=0.03
    )  # type: ignore[union-attr]
    assert sheet_for("h100").bf16_dense_flops / sheet_for("a100-40gb").bf16_dense_flops == pytest.approx(
        PUBLISHED_H100_OVER_A100_FLOPS, rel=0.06
    )  # type: ignore[union-attr]
    assert sheet_for("mi300x").vendor == "amd" and sheet_for("h100").nvlink_bandwidth == 900e9  # type: ignore[union-attr]
    assert sheet_for("l40s").nvlink_bandwidth is None and sheet_for("l40s").pcie_generation == 4  # type: ignore[union-attr]


def test_the_peak_flops_lookup_reads_the_datasheet_table() -> None:
    """One fact in one place: MFU's peak is the table's figure, for every row."""
    import benchtrain.train.step.hardware as hardware

    assert not hasattr(hardware, "PEAK_BF16_DENSE_FLOPS")
    for sheet in SHEETS:
        assert peak_flops(sheet.device_name) == (sheet.peak_entry, sheet.bf16_dense_flops)
    assert peak_flops("NVIDIA A100-SXM4-40GB", 54) == ("A100 MIG 54/108 SMs", 156e12)


# -- the translation ---------------------------------------------------------------------------------
def test_the_same_device_is_the_identity() -> None:
    data = h100()
    same = translate(data, sheet_for("NVIDIA H100 80GB HBM3"))  # type: ignore[arg-type]
    record = same["translation"]
    assert record["identity"] and record["central_factor"] == 1.0 and record["bracket"] == [1.0, 1.0]
    assert same["id"] == data["id"] and same["hardware"] == data["hardware"] and same["fit"] == data["fit"]
    original, identity = Calibration(data), Calibration(same)
    assert identity.translation is None
    config = StepConfig(micro_batch_size=8, num_workers=0, grad_accum=2, seq_len=1024)
    assert identity.predict(config) == original.predict(config)


def test_h200_on_a_compute_bound_step_lies_within_the_datasheet_ratios() -> None:
    data = compute_bound(h100())
    h200 = translate(data, sheet_for("h200"))  # type: ignore[arg-type]
    record = h200["translation"]
    memory_bound, compute_bound_ratio = time_ratios("h100", "h200")
    assert record["flops_ratio"] == pytest.approx(1 / compute_bound_ratio) and record[
        "bandwidth_ratio"
    ] == pytest.approx(1 / memory_bound)
    low, high = record["bracket"]
    assert memory_bound - 1e-9 <= low < record["central_factor"] < high <= compute_bound_ratio + 1e-9
    # The central estimate follows the split: all compute keeps the H100's time (the same FLOP/s),
    # all memory takes the bandwidth ratio, and more memory-bound time is never slower.
    centrals = [
        translate(compute_bound(h100(), 1.0 - share, share), sheet_for("h200"))["translation"]["central_factor"]
        for share in (0.0, 0.1, 0.5, 1.0)
    ]  # type: ignore[arg-type]
    assert centrals[0] == pytest.approx(1.0) and centrals[-1] == pytest.approx(memory_bound)
    assert centrals == sorted(centrals, reverse=True) and centrals[1] == pytest.approx(record["central_factor"])
    assert (
        h200["id"] == f"{data['id']}~h200"
        and h200["hardware"]["translated"]
        and h200["hardware"]["name"] == "NVIDIA H200"
    )
    config = StepConfig(micro_batch_size=8, num_workers=0, grad_accum=1, seq_len=1024)
    assert Calibration(h200).predict(config).step_seconds == pytest.approx(
        Calibration(data).predict(config).step_seconds * record["central_factor"]
    )


def test_a100_40gb_from_the_h100_is_slower_within_its_ratios() -> None:
    fast, slow = time_ratios("h100", "a100-40gb")
    compute = translate(compute_bound(h100()), sheet_for("a100-40gb"))["translation"]  # type: ignore[arg-type]
    assert fast - 1e-9 <= compute["bracket"][0] < compute["bracket"][1] <= slow + 1e-9
    # The real calibration (no profiler record: the FLOP count and the fit's terms) has a host part,
    # not scaled: the bracket reaches below the bandwidth ratio by its widening, never above the FLOP ratio.
    data = h100()
    a100 = translate(data, sheet_for("a100-40gb"))  # type: ignore[arg-type]
    record = a100["translation"]
    assert record["split_method"] == "flops" and 0 < record["host_share"] < 0.5
    assert 1.0 < record["bracket"][0] < record["central_factor"] < record["bracket"][1] <= slow
    # The host part, not scaled (and widened), keeps the low end below the bandwidth ratio.
    assert record["bracket"][0] < fast
    config = StepConfig(micro_batch_size=8, num_workers=0, grad_accum=2, seq_len=1024)
    before, after = Calibration(data).predict(config), Calibration(a100).predict(config)
    assert 1.0 < after.step_seconds / before.step_seconds < slow
    # The measurements are the central estimate's too: each row's step × the fit's factor at its configuration.
    index = next(
        i for i, row in enumerate(data["measurements"]) if row["status"] == "ok" and row["micro_batch_size"] == 8
    )
    row, translated_row = data["measurements"][index], a100["measurements"][index]
    assert translated_row["step_seconds"] == pytest.approx(row["step_seconds"] * translated_row["translated_factor"])
    # The same FLOPs per step: MFU × peak × step time is what the step computes, on either device.
    h100_peak, a100_peak = sheet_for("h100").bf16_dense_flops, sheet_for("a100-40gb").bf16_dense_flops  # type: ignore[union-attr]
    assert translated_row["mfu"] * a100_peak * translated_row["step_seconds"] == pytest.approx(
        row["mfu"] * h100_peak * row["step_seconds"]
    )


def test_memory_is_kept_and_judged_against_the_target() -> None:
    data = h100()
    a100 = translate(data, sheet_for("a100-40gb"))  # type: ignore[arg-type]
    config = StepConfig(micro_batch_size=4, num_workers=0, grad_accum=1, seq_len=1024)
    source, target = Calibration(data), Calibration(a100)
    assert target.memory.peak_bytes(config) == source.memory.peak_bytes(config)  # type: ignore[union-attr]
    assert target.memory_limit_bytes == 40e9 and source.memory_limit_bytes == data["hardware"]["memory_bytes"] > 80e9
    assert target.memory_margin == source.memory_margin
    # Out-of-memory probes still bound a smaller device; a larger one is judged by the memory model.
    assert (
        sum(row["status"] == "oom" for row in a100["measurements"])
        == sum(row["status"] == "oom" for row in data["measurements"])
        > 0
    )
    h200 = translate(data, sheet_for("h200"))  # type: ignore[arg-type]
    assert not any(row["status"] == "oom" for row in h200["measurements"])
    validate(h200, "h200")  # still a valid calibration


def test_a_target_too_small_is_refused_when_translated_or_planned() -> None:
    data = h100()
    # Its fixed part alone does not fit: refused at once (one process; several may shard it).
    big = copy.deepcopy(data)
    big["fit"]["memory"]["parameters"]["static"] = 25 * GIB
    with pytest.raises(DoesNotFitError, match="does not fit the L4's 22 GiB") as refused:
        translate(big, sheet_for("l4"))  # type: ignore[arg-type]
    assert "\n" not in str(refused.value)
    assert translate(big, sheet_for("l4"), world_size=2)["hardware"]["count"] == 2  # type: ignore[arg-type]
    # The fixed part fits but no configuration with its activations does: the plan says so.
    tight = copy.deepcopy(data)
    tight["fit"]["memory"]["parameters"]["static"] = 34 * GIB
    plan_with(translate(tight, sheet_for("a100-80gb")))  # type: ignore[arg-type]
    with pytest.raises(DoesNotFitError, match="no configuration fits in memory"):
        plan_with(translate(tight, sheet_for("a100-40gb")))  # type: ignore[arg-type]


def test_across_vendors_or_between_cpu_and_gpu_is_refused_in_one_line() -> None:
    from helpers import synthetic_calibration

    def refusal(data: dict[str, Any], key: str) -> str:
        with pytest.raises(BenchtrainError) as error:
            translate(data, sheet_for(key))  # type: ignore[arg-type]
        assert "\n" not in str(error.value)
        return str(error.value)

    assert "another vendor" in refusal(h100(), "mi300x")
    assert "a CPU calibration is never translated" in refusal(synthetic_calibration(), "h100")
    unknown = h100()
    unknown["hardware"]["name"] = "NVIDIA RTX A6000"
    assert "the datasheet table lacks" in refusal(unknown, "h100")
    mig = h100()
    mig["hardware"]["peak_flops_entry"] = "H100 SXM MIG 16/132 SMs"
    assert "MIG slice" in refusal(mig, "h200")
    assert "is itself translated" in refusal(translate(h100(), sheet_for("h200")), "a100-40gb")  # type: ignore[arg-type]


def test_a_translated_plan_is_judged_at_the_brackets_upper_end_and_says_translated() -> None:
    data = h100()
    a100 = translate(data, sheet_for("a100-40gb"))  # type: ignore[arg-type]
    calibration = Calibration(a100)
    plan = plan_with(a100)
    chosen = plan.chosen
    low, high = bracket_for(a100["fit"]["parameters"], chosen.config, a100["translation"])
    assert high > 1.05 and low < 0.95  # a real bracket, not the fit's error alone
    measured = calibration.measured_bound_for(chosen.config)
    steps = chosen.step_seconds
    # The upper bound and what the deadline is checked against: at the bracket's upper end (× the fit's error).
    assert chosen.total_seconds_high - chosen.overheads.total_seconds >= steps * high * (1 + measured) * (1 - 1e-9)
    assert chosen.total_seconds_promised - chosen.overheads.total_seconds >= steps * high * (1 - 1e-9)
    # …and at least as high as the record's bracket says at the split's probes (the sizes plans choose).
    record = a100["translation"]
    assert (chosen.total_seconds_high - chosen.overheads.total_seconds) / steps >= record["bracket"][1] / record[
        "central_factor"
    ] - 0.02
    prediction = calibration.predict(chosen.config)
    # the bracket's lower end
    assert prediction.step_seconds_low == pytest.approx(prediction.step_seconds * low / (1 + measured))
    # Measured here, the same plan's bound is the fit's alone.
    assert Calibration(data).relative_bound_for(chosen.config) == pytest.approx(measured)
    assert "translated from NVIDIA H100 80GB HBM3 to the A100 40GB SXM" in describe_error(calibration, chosen)
    profile = {
        "count": 400,
        "total_tokens": 200_000,
        "mean": 500.0,
        "p50": 500.0,
        "p99": 740.0,
        "p99.5": 745.0,
        "max": 749,
    }
    text = "\n".join(describe_plan(plan, profile, calibration))
    assert "translated estimate" in text and "A100-SXM4-40GB" in text and "bracket ×" in text


def test_a_recorded_split_is_used_and_a_damaged_one_ignored(tmp_path: Path) -> None:
    data = compute_bound(h100(), compute=0.0, memory=1.0)
    assert [entry["method"] for entry in step_splits(data)] == ["profiler"]
    record = translate(data, sheet_for("h200"))["translation"]  # type: ignore[arg-type]
    assert record["split_method"] == "profiler" and record["device_factor"] == pytest.approx(
        time_ratios("h100", "h200")[0]
    )
    data["step_split"] = [{"compute_seconds": "a lot", "method": "profiler"}]
    assert [entry["method"] for entry in step_splits(data)] == ["flops", "flops"]


# -- the bracket against published cross-GPU runs (calibration.datasheets.PUBLISHED_COMPARISONS) --------


def as_a100_80gb(data: dict[str, Any]) -> dict[str, Any]:
    """`data` as if measured on an A100-SXM4-80GB: what a translation reads of its device."""
    data = copy.deepcopy(data)
    data["hardware"] = {
        **data["hardware"],
        "name": "NVIDIA A100-SXM4-80GB",
        "peak_flops_entry": "A100",
        "memory_bytes": 85_100_000_000,
    }
    return data


@pytest.mark.parametrize("compute", [1.0, 0.9, 0.5, 0.0])
def test_the_bracket_holds_every_published_a100_h100_pair_both_ways(compute: float) -> None:
    """llm-foundry's 34 pairs of the same MPT step on 8 A100-80GB and 8 H100-80GB (speed-ups 1.81x
    to 2.84x) all lie within the translated bracket, from the A100 to the H100 and back, whatever
    the step's split: its ends are the datasheets' FLOP/s (3.17x) and bandwidth (1.64x) ratios."""
    from benchtrain.calibration.datasheets import PUBLISHED_COMPARISONS

    (comparison,) = PUBLISHED_COMPARISONS
    speedups = [pair.speedup for pair in comparison.pairs]
    assert (
        len(speedups) == 34
        and min(speedups) == pytest.approx(1.809, abs=1e-3)
        and max(speedups) == pytest.approx(2.844, abs=1e-3)
    )
    measured_on_h100 = compute_bound(h100(), compute, 1.0 - compute)
    low, high = translate(measured_on_h100, sheet_for("a100-80gb"))["translation"]["bracket"]  # type: ignore[arg-type]
    assert all(low <= speedup <= high for speedup in speedups), (low, high)  # time on the A100 ÷ time on the H100
    low, high = translate(as_a100_80gb(measured_on_h100), sheet_for("h100"))["translation"]["bracket"]  # type: ignore[arg-type]
    assert all(low <= 1 / speedup <= high for speedup in speedups), (low, high)


def test_the_central_estimate_is_shifted_to_what_hopper_attained_over_ampere() -> None:
    """A compute-bound step (90% matmuls) translated from an A100-80GB to an H100 by the datasheets
    alone would run 2.90x faster: more than any of the 34 published pairs (at most 2.84x; median
    2.16x). The central estimate scales compute by the FLOP/s ratio they attained (3.17 × 0.68 =
    2.16: 2.09x for this step) and lands among them; the bracket's ends stay the datasheets'."""
    from benchtrain.calibration.datasheets import PUBLISHED_COMPARISONS, generation_shift

    speedups = sorted(pair.speedup for pair in PUBLISHED_COMPARISONS[0].pairs)
    record = translate(as_a100_80gb(compute_bound(h100())), sheet_for("h100"))["translation"]  # type: ignore[arg-type]
    datasheets_only = 1 / (0.9 / record["flops_ratio"] + 0.1 / record["bandwidth_ratio"])
    assert datasheets_only > speedups[-1]
    shift = generation_shift("ampere", "hopper")
    assert (
        shift is not None
        and shift.attained_share == pytest.approx(0.681, abs=1e-3)
        and "llm-foundry" in record["attained_from"]
    )
    # What Hopper attained over Ampere is the published pairs' own median, not the datasheets' ratio.
    assert record["attained_flops_ratio"] == pytest.approx(float(np.median(speedups)), rel=0.02)
    assert record["attained_flops_ratio"] < record["flops_ratio"]
    assert speedups[0] < 1 / record["central_factor"] < speedups[-1]
    assert record["bracket"] == pytest.approx([1 / record["flops_ratio"], 1 / record["bandwidth_ratio"]])
    # Within a generation, or between generations nobody published, the datasheets stand.
    h200 = translate(compute_bound(h100()), sheet_for("h200"))["translation"]  # type: ignore[arg-type]
    assert h200["attained_flops_ratio"] == h200["flops_ratio"] and h200["attained_from"] is None
