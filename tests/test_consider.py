"""Which machine to rent, before renting any (issue 41): `train --dry-run --consider …` plans one row
per machine from the best source there is — measured here, measured by someone (hub), predicted
(a 1-process calibration plus collectives), translated (datasheet ratios), or not plannable — each
with its time and cost bracket, the cheapest that meets the deadline at its upper end, the rows
that could overtake it, and the `bench run` that would settle each row not measured.

Calibrations: the real H100 one (tests/fixtures/h100-llama-3.2-1b-fullgrid.json, the bundled one's
bytes). Nothing here was measured on an H200, an A100 or across GPUs: those rows are translated or
predicted, and the tests say so."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from helpers import FIXTURE, MACHINES, PRICES, assert_one_line_error, dry_run, run_consider, run_main

from benchtrain.calibration.model import Calibration
from benchtrain.calibration.schema import read_calibration_file
from benchtrain.common.errors import BenchtrainError
from benchtrain.train.recipes.machines import parse_machines
from benchtrain.train.workload.method import MethodConfig
from benchtrain.train.workload.model import resolve_model


def test_machines_are_parsed_with_their_links() -> None:
    machines = parse_machines(" h100:1, h100:2:nvlink,h200 ,a100-40gb:4:pcie,h100:8:2x4:nvlink+ib")
    assert [(m.sheet.key, m.processes, m.interconnect, m.interconnect_assumed) for m in machines] == [
        ("h100", 1, None, False),
        ("h100", 2, "nvlink", False),
        ("h200", 1, None, False),
        ("a100-40gb-pcie", 4, "pcie", False),  # linked by PCIe: the PCIe card
        ("h100", 8, "2x4:nvlink+infiniband", False),
    ]
    assumed = parse_machines("h100:2,a10g:2")
    assert [(m.interconnect, m.interconnect_assumed) for m in assumed] == [("nvlink", True), ("pcie", True)]
    assert "(assumed)" in assumed[0].label


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("x100:1", "--consider 'x100:1': no datasheet for 'x100'; one of"),
        ("h100:0", "--consider 'h100:0': at least one GPU"),
        ("h100:two", "the number of GPUs must be a whole number"),
        ("h100:2:warp", "not an interconnect"),
        (" , ", "--consider names no machine"),
    ],
)
def test_bad_machines_are_one_line(text: str, fragment: str) -> None:
    with pytest.raises(BenchtrainError, match=None) as caught:
        parse_machines(text)
    assert fragment in str(caught.value) and "\n" not in str(caught.value)


def test_each_kind_of_row_from_the_h100_calibration() -> None:
    comparison = run_consider(MACHINES, [read_calibration_file(FIXTURE)])
    kinds = {row.source.machine.label.split(" ")[0]: row.kind for row in comparison.rows}
    assert kinds == {
        "1×H100": "measured here",
        "2×H100": "predicted",
        "1×H200": "translated",
        "4×A100": "translated",
        "1×MI300X": "not plannable",
    }
    assert (
        next(row for row in comparison.rows if row.source.machine.label.startswith("4×A100")).source.machine.label
        == "4×A100 40GB PCIe over pcie"
    )
    mi300x = next(row for row in comparison.rows if row.kind == "not plannable")
    assert mi300x.run_plan is None and "no calibration of any AMD GPU" in mi300x.problem
    measured = next(row for row in comparison.rows if row.kind == "measured here")
    assert measured.settle is None  # nothing to settle: it was measured
    for row in comparison.rows:
        if row.kind in ("predicted", "translated"):
            low, high = row.run_plan.plan.chosen.total_seconds_low, row.run_plan.plan.chosen.total_seconds_promised
            assert low < row.run_plan.plan.chosen.total_seconds < high
            assert row.settle.startswith(("bench run --gpu", "accelerate launch --num_processes"))
    a100 = next(row for row in comparison.rows if row.source.machine.label.startswith("4×A100"))
    assert "translated from" in a100.rests_on and "collectives: pcie link figures (not measured)" in a100.rests_on
    assert a100.settle.startswith(
        "accelerate launch --num_processes 4 -m benchtrain.bench run --gpu a100-40gb-pcie --model llama-3.2-1b --interconnect pcie"
    )


def test_the_translated_h200_is_bracketed_by_the_datasheet_ratios() -> None:
    comparison = run_consider("h100:1,h200:1", [read_calibration_file(FIXTURE)])
    h100, h200 = (
        next(row for row in comparison.rows if row.source.machine.label.startswith(prefix))
        for prefix in ("1×H100", "1×H200")
    )
    # Same FLOP/s, 4.8 / 3.35 TB/s: the H200's steps take between 1/1.43 and 1× the H100's.
    ratio = (
        h200.run_plan.plan.chosen.step_seconds / h100.run_plan.plan.chosen.step_seconds
        if h200.run_plan.plan.chosen.config.phrase == h100.run_plan.plan.chosen.config.phrase
        else None
    )
    if ratio is not None:
        assert 3.35 / 4.8 - 0.01 <= ratio <= 1.01
    assert h200.run_plan.plan.chosen.total_seconds_promised >= h100.run_plan.plan.chosen.total_seconds_low * 3.35 / 4.8


def test_the_cheapest_at_its_upper_end_is_recommended_and_rivals_are_named() -> None:
    comparison = run_consider("h100:1,h200:1,a100-40gb:4:pcie", [read_calibration_file(FIXTURE)])
    best = comparison.recommended
    assert best is not None and best.run_plan.plan.meets_deadline
    meeting = [row for row in comparison.rows if row.run_plan is not None and row.run_plan.plan.meets_deadline]
    assert all(best.cost_bracket[1] <= row.cost_bracket[1] for row in meeting)
    for row in comparison.rows:
        if row.could_overtake:
            assert row.cost_bracket[0] < best.cost_bracket[1]


def test_a_cpu_calibration_translates_to_no_gpu(home: Path) -> None:
    from helpers import cpu_calibration

    comparison = run_consider("h100:1", [cpu_calibration("cpu-one")])
    (row,) = comparison.rows
    assert row.kind == "not plannable" and "only CPU calibrations" in row.problem


def test_the_table_in_words(home: Path, chats: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out_dir = tmp_path / "which"
    argv = [
        "--model",
        "llama-3.2-1b",
        "--use-calibration",
        "h100-llama-3.2-1b",
        "--consider",
        MACHINES,
        "--price-per-hour",
        PRICES,
    ]
    code, out, err = dry_run(capsys, *argv, "--data", str(chats), "--out", str(out_dir))
    assert code == 0, err
    for word in (
        "measured by someone",
        "predicted",
        "translated",
        "not plannable",
        "settle with:",
        "bundled h100-llama-3.2-1b",
    ):
        assert word in out, (word, out)
    assert "recommended: " in out
    html = (out_dir / "report.html").read_text()
    assert "translated" in html and "data:image/png;base64" in html
    code, _, err = dry_run(capsys, *argv[:4], "--consider", "x100:1", "--data", str(chats))
    assert_one_line_error(code, err, "--consider 'x100:1': no datasheet for 'x100'")
    code, _, err = run_main("train", [*argv, "--data", str(chats), "--deadline", "1h"], capsys)  # not a dry run
    assert_one_line_error(code, err, "plans machines you have not rented, which is a dry run: add --dry-run")


def test_a_measurement_shared_on_the_hub_beats_a_translation_and_says_whose() -> None:
    """TEST DOUBLE: the H100 calibration relabelled as an H200 and marked as read from the hub
    (calibration.hub writes `source` so); nothing was measured on an H200."""
    h100 = read_calibration_file(FIXTURE)
    shared = copy.deepcopy(h100)
    shared["id"] = "h200-shared-double"
    shared["hardware"].update(name="NVIDIA H200", memory_bytes=150_000_000_000, peak_flops_entry="H200")
    shared["source"] = {
        "kind": "hub",
        "repo": "our-lab/gpu-calibrations",
        "file": "calibrations/h200-shared-double.json",
        "measured_by": "alice",
    }
    comparison = run_consider("h200:1", [h100, shared])
    (row,) = comparison.rows
    assert row.kind == "measured by someone" and row.settle is None
    assert row.rests_on == "hub:our-lab/gpu-calibrations (by alice) (h200-shared-double)"
    without = run_consider("h200:1", [h100])
    assert without.rows[0].kind == "translated"


class _Plan:
    def __init__(self, low: float, upper: float, meets: bool) -> None:
        self.chosen = SimpleNamespace(total_seconds_low=low, total_seconds_promised=upper)
        self.meets_deadline = meets


def _row(low: float, upper: float, price: float, meets: bool = True) -> Any:
    """A row of one GPU at `price` per hour whose plan runs from `low` to `upper` seconds."""
    from benchtrain.train.recipes.machines import Row, Source

    return Row(Source(None, "translated"), {}, price, run_plan=SimpleNamespace(plan=_Plan(low, upper, meets)))  # type: ignore[arg-type]


def test_the_rows_that_could_overtake_the_recommended_one_within_their_brackets() -> None:
    from benchtrain.train.recipes.machines import could_overtake, rank

    measured = _row(3600, 3700, 2.5)  # $2.50 – $2.57
    translated_wide = _row(1800, 5400, 2.0)  # $1.00 – $3.00: dearer at its upper end, cheaper at its low end
    translated_dear = _row(3600, 4000, 3.8)  # $3.80 – $4.22: never cheaper
    late = _row(9000, 9500, 0.5, meets=False)  # cheap, but its low end misses the deadline
    assert translated_wide.cost_bracket == pytest.approx((1.0, 3.0))
    ranked = rank([translated_wide, translated_dear, measured, late], by_cost=True, at_upper_end=True)
    assert ranked[0] is measured and measured.recommended
    assert could_overtake(ranked, available_seconds=7200, by_cost=True) == [translated_wide]
    assert ranked[-1] is late


def test_fsdp_processes_planned_from_one_process_accumulate_their_shard_of_the_gradients() -> None:
    """A 1-process calibration's accumulation holds every gradient; an FSDP process of N holds 1/N
    (calibration.memory_fit.MemoryModel.with_gradient_shards): the real H100 grid, refitted (its
    accumulation then holds at least the 4.9 GB of fp32 gradients), planned for 4 H100s over NVLink
    at accumulation > 1: each process's peak is the 1-process prediction, less the sharded state
    (the plan's memory offset, with NCCL's own buffers), less 3/4 of what accumulation holds."""
    from benchtrain.bench.record import refit_record
    from benchtrain.calibration.comm import communicator_bytes
    from benchtrain.train.planning.memory_check import memory_need
    from benchtrain.train.step.engine import StepOptions

    data = refit_record(read_calibration_file(FIXTURE))
    comparison = run_consider("h100:4:nvlink", [data], step_options=StepOptions(sharding="fsdp"), effective_batch=64)
    (row,) = comparison.rows
    chosen = row.run_plan.plan.chosen
    assert row.kind == "predicted" and chosen.config.grad_accum > 1, row.problem
    memory = Calibration(data).memory
    held = memory.coefficients["accumulated_gradients"]
    assert held >= 1_235_814_400 * 4  # Llama-3.2-1B's fp32 gradients
    need = memory_need(resolve_model("llama-3.2-1b"), MethodConfig(), "cuda")
    # NCCL's buffers too
    offset = (
        need.per_process_bytes("fsdp", 4, "cuda")
        - need.total_bytes
        + communicator_bytes(row.run_plan.fitted.hardware, 4)
    )
    config = chosen.config
    assert chosen.peak_memory_bytes == pytest.approx(memory.peak_bytes(config) + offset - 0.75 * held, rel=1e-6)
