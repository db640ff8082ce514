"""Memory a GPU plan can bet on (issue 39, faults 4 and 12), on CPU by construction.

Fault 4: plans came from the CUDA allocator's *allocated* peak, without its fragmentation (reserved
above allocated) or what lies outside it (CUDA context, kernels, NCCL). A probe now records the
reserved peak and the device's used bytes beside the allocated peak (faked `torch.cuda` bookkeeping
here), the memory fit plans from reserved + the bytes outside the allocator, and an older,
allocated-only calibration plans as before and says so.

Fault 12: under DDP the gradients of the probe's first step (no collective in it) and of every
accumulating micro-step were allocated by autograd beside DDP's buckets: two fp32 copies of the
gradients. Two gloo processes (tests/ddp_gradient_checks.py, as ranks forked by tests/forkserver.py
with torchrun's variables) hold that one copy is held at every step.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import GIB, heavy_tailed, synthetic_calibration, synthetic_rows, tokenized

from benchtrain.calibration.fit import fit_measurements
from benchtrain.calibration.memory_fit import device_peak_bytes, fit_memory_section, memory_model_from_json
from benchtrain.calibration.model import Calibration
from benchtrain.calibration.schema import SCHEMA_VERSION, migrate, read_calibration_file, validate
from benchtrain.calibration.step_config import StepConfig
from benchtrain.common.errors import CalibrationFileError
from benchtrain.train.planning.deadline import Deadline
from benchtrain.train.planning.memory_check import memory_basis_note
from benchtrain.train.planning.planner import make_plan
from benchtrain.train.planning.types import PlanRequest

# What a long GPU run holds beyond the allocated peak: fragmentation kept by the caching allocator
# (8% + 0.25 GiB here) and 0.6 GiB outside it (CUDA context, kernels, NCCL).
FRAGMENTATION, FRAGMENTATION_BYTES, OUTSIDE_BYTES = 0.08, 0.25 * GIB, 0.6 * GIB


def with_cuda_fields(rows: list[dict[str, Any]], outside: float = OUTSIDE_BYTES) -> list[dict[str, Any]]:
    """The rows as a GPU probe now records them: reserved and the device's used bytes beside allocated."""
    rows = copy.deepcopy(rows)
    for index, row in enumerate(rows):
        if row["status"] == "ok":
            reserved = row["peak_memory_bytes"] * (1 + FRAGMENTATION) + FRAGMENTATION_BYTES
            row_outside = outside * (1 - 0.01 * (index % 3))  # the context varies a little: the most seen counts
            row.update(
                peak_reserved_bytes=reserved, device_used_bytes=reserved + row_outside, non_torch_bytes=row_outside
            )
    return rows


def gpu_calibration(rows: list[dict[str, Any]], memory_bytes: float) -> dict[str, Any]:
    hardware = {"device_type": "cuda", "name": "NVIDIA H100 80GB HBM3", "count": 1, "memory_bytes": memory_bytes}
    return synthetic_calibration(rows, memory_bytes=memory_bytes, hardware=hardware)


def test_a_probe_records_reserved_and_the_devices_used_bytes_beside_allocated(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real probe of the tiny model, its memory bookkeeping faked as a GPU's: 10 GiB allocated at
    the peak, 12 GiB reserved, 13 GiB used on the device while the allocator holds 11.5 GiB."""
    from benchtrain.bench.probe import Workload, run_probe
    from benchtrain.bench.timing import ProbeSettings
    from benchtrain.train.step.engine import StepOptions
    from benchtrain.train.workload.model import resolve_model

    workload = Workload(resolve_model("tiny"), options=StepOptions(compile="off", loss="plain"))
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(Workload, "device", property(lambda self: gpu))  # what PeakMemory measures on
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda where=None: calls.append(f"reset {where}"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda where=None: 10 * GIB)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda where=None: 12 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda where=None: int(11.5 * GIB))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda where=None: (80 * GIB - 13 * GIB, 80 * GIB))
    settings = ProbeSettings(warmup_steps=1, min_steps=2, max_steps=2, max_seconds=5.0)
    row = run_probe(workload, StepConfig(micro_batch_size=2, num_workers=0, grad_accum=1, seq_len=16), settings)
    assert row["status"] == "ok", row
    assert calls == ["empty_cache", "reset cuda:0"]
    assert row["peak_memory_bytes"] == 10 * GIB and row["peak_reserved_bytes"] == 12 * GIB
    # used − reserved, read together
    assert row["device_used_bytes"] == 13 * GIB and row["non_torch_bytes"] == 1.5 * GIB
    assert device_peak_bytes(row) == 13.5 * GIB  # the reserved peak + what lies outside the allocator


def test_the_fit_plans_from_reserved_plus_the_bytes_outside_the_allocator() -> None:
    rows = synthetic_rows()
    gpu = Calibration(gpu_calibration(with_cuda_fields(rows), 80 * GIB))
    memory = gpu.fit["memory"]
    # the most any probe saw
    assert memory["basis"] == "reserved" and memory["non_torch_bytes"] == pytest.approx(OUTSIDE_BYTES)
    for config in (StepConfig(8, 0, 2, 512), StepConfig(1, 0, 1, 128)):
        allocated = Calibration(synthetic_calibration(rows)).predict(config).peak_memory_bytes
        expected = allocated * (1 + FRAGMENTATION) + FRAGMENTATION_BYTES + OUTSIDE_BYTES
        assert gpu.predict(config).peak_memory_bytes == pytest.approx(expected, rel=0.02)
    # The same rows without the new fields (a version-3 GPU calibration, or a CPU one): the allocated
    # peak with nothing added, exactly the fit before.
    old = fit_measurements(rows)["memory"]
    assert old["basis"] == "allocated" and old["non_torch_bytes"] == 0.0
    configs = [StepConfig.from_row(row) for row in rows if row["status"] == "ok"]
    before = fit_memory_section(configs, np.array([row["peak_memory_bytes"] for row in rows if row["status"] == "ok"]))
    assert old["parameters"] == before["parameters"]


def test_a_plan_near_the_limit_leaves_room_for_fragmentation_and_the_context() -> None:
    """A device just big enough for the fastest configuration's allocated peak (plus margin): the
    allocated-only calibration chooses it, the one with reserved and context bytes does not, and
    what it chooses fits with them. The plans say what their memory stands on."""
    rows = synthetic_rows()
    data = tokenized(heavy_tailed())
    request = PlanRequest(epochs=1, deadline=Deadline.with_margin_share(1e6, 0.05), priority="fast", effective_batch=16)
    roomy = make_plan(Calibration(gpu_calibration(rows, 80 * GIB)), data, request).chosen
    limit = roomy.peak_memory_bytes_high * 1.01
    old, new = Calibration(gpu_calibration(rows, limit)), Calibration(gpu_calibration(with_cuda_fields(rows), limit))
    old_plan, new_plan = make_plan(old, data, request), make_plan(new, data, request)
    assert old_plan.chosen.config == roomy.config  # planned as before
    chosen = new_plan.chosen
    assert chosen.config != roomy.config and chosen.peak_memory_bytes_high <= limit
    assert not new.predict(roomy.config).fits_in_memory
    assert any("allocated peak only" in note and "re-run `bench run`" in note for note in old_plan.notes)
    assert any("reserved peak" in note and "0.60 GiB measured outside it" in note for note in new_plan.notes)
    assert memory_basis_note(Calibration(synthetic_calibration(rows))) is None  # CPU: the peak RSS is the process


def test_old_calibrations_load_and_new_fields_are_checked(tmp_path: Path) -> None:
    """schema_version 3 (no memory basis) migrates to 4 as an allocated fit with nothing outside the
    allocator; the new optional fields are validated where present, in one line."""
    rows = synthetic_rows()
    v3 = gpu_calibration(rows, 80 * GIB)
    v3["schema_version"] = 3
    for key in ("basis", "non_torch_bytes"):
        del v3["fit"]["memory"][key]
    path = tmp_path / "v3.json"
    path.write_text(json.dumps(v3))
    loaded = read_calibration_file(path)
    assert SCHEMA_VERSION == 4 and loaded["schema_version"] == 4
    assert loaded["fit"]["memory"]["basis"] == "allocated" and loaded["fit"]["memory"]["non_torch_bytes"] == 0.0
    model = memory_model_from_json(loaded["fit"]["memory"])
    assert model.basis == "allocated" and model.non_torch_bytes == 0.0
    new = gpu_calibration(with_cuda_fields(rows), 80 * GIB)
    validate(migrate(copy.deepcopy(new), "new"), "new")
    bad_row = copy.deepcopy(new)
    bad_row["measurements"][0]["peak_reserved_bytes"] = "12 GiB"
    with pytest.raises(CalibrationFileError, match=r"measurements\[0\]\.peak_reserved_bytes should be a number"):
        validate(bad_row, "x")
    bad_basis = copy.deepcopy(new)
    bad_basis["fit"]["memory"]["basis"] = "guessed"
    with pytest.raises(CalibrationFileError, match=r"memory\.basis is 'guessed'"):
        validate(bad_basis, "x")
    newer = {**new, "schema_version": 5}
    with pytest.raises(CalibrationFileError, match="newer than this benchtrain"):
        migrate(newer, "x")


def test_a_runs_peak_is_compared_as_the_plan_predicted_it() -> None:
    """A GPU run's actual figures carry the same fields: the device's peak (reserved + outside the
    allocator) is what the plan's predicted peak is compared with; older records keep their peak."""
    from benchtrain.train.planning.plan_text import describe_peak_memory

    actual = {
        "peak_memory_bytes": 10 * GIB,
        "peak_reserved_bytes": 12 * GIB,
        "device_used_bytes": 13 * GIB,
        "non_torch_bytes": GIB,
    }
    assert device_peak_bytes(actual) == 13 * GIB
    assert device_peak_bytes({"peak_memory_bytes": 10 * GIB}) == 10 * GIB and device_peak_bytes({}) is None
    assert (
        describe_peak_memory(12.5 * GIB, device_peak_bytes(actual))
        == "peak memory: 13.00 GiB actual vs 12.50 GiB predicted (+4.0%)"
    )


def test_fragmentation_is_said_with_the_option_to_measure(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench says when reserved lay well above allocated, and names expandable segments as something
    to measure, not to assume; the allocator settings a calibration was measured with are recorded,
    and a plan from it says when the run's differ."""
    from benchtrain.bench.record import fragmentation_warning
    from benchtrain.train.step.hardware import allocator_conf, detect_software

    rows = with_cuda_fields(synthetic_rows())
    warning = fragmentation_warning(rows)
    assert warning is not None and "expandable_segments:True" in warning and "measure it" in warning
    assert fragmentation_warning(synthetic_rows()) is None  # nothing recorded (CPU, older GPU rows)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert allocator_conf() == "expandable_segments:True" and detect_software()["allocator_conf"] == allocator_conf()
    calibration = Calibration(gpu_calibration(rows, 80 * GIB))  # measured with the defaults (software: none recorded)
    note = memory_basis_note(calibration) or ""
    assert "default" in note and "expandable_segments:True" in note
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert "allocator settings" not in (memory_basis_note(calibration) or "")


CHECKS = Path(__file__).with_name("ddp_gradient_checks.py")


@pytest.mark.slow
def test_ddp_holds_one_copy_of_the_gradients_at_every_step(fork_server) -> None:
    """Two gloo processes, the tiny model under DDP (gradient_as_bucket_view): at every step — the
    probe's first, with no collective in it; accumulating ones; the first after a failed probe —
    the gradients held are DDP's buckets and nothing beside them. Before: 2.0 copies in the first
    step and in every step with accumulation (a fresh gradient per parameter under no_sync)."""
    found = fork_server.group_report(CHECKS, [], timeout=150)
    assert found["processes"] == 2
    assert found["steps"] == {
        "first step, no sync, accum 2": 1.0,
        "accum 2": 1.0,
        "accum 1": 1.0,
        "first step after a failed probe": 1.0,
        "accum 2 after it": 1.0,
    }


def test_a_cpu_plan_counts_what_the_train_process_holds_beyond_the_bench_process(
    home: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CPU a peak is the process's resident set: the train process holds libraries and records
    the bench process never loaded (datasets and pyarrow alone ≈ 95 MiB; the demo ran +35% over
    its plan). bench records its resident set before the model build; the plan adds what this
    process holds beyond it, measured at plan time. Not on a GPU, nor for older calibrations."""
    import json

    from helpers import run_main, synthetic_calibration

    from benchtrain.calibration.store import save_calibration
    from benchtrain.train.step import peak_memory
    from benchtrain.train.step.hardware import detect_hardware
    from benchtrain.train.workload.model import resolve_model

    monkeypatch.setattr(peak_memory, "process_resident_bytes", lambda: 900 * 2**20)
    hardware = detect_hardware()
    assert peak_memory.host_excess_bytes({**hardware, peak_memory.HOST_BASELINE_KEY: 700 * 2**20}, "cpu") == 200 * 2**20
    assert peak_memory.host_excess_bytes({**hardware, peak_memory.HOST_BASELINE_KEY: 700 * 2**20}, "cuda") == 0.0
    assert peak_memory.host_excess_bytes({**hardware, peak_memory.HOST_BASELINE_KEY: 950 * 2**20}, "cpu") == 0.0
    assert peak_memory.host_excess_bytes(hardware, "cpu") == 0.0

    def planned_peak(baseline: int | None) -> float:
        recorded = {**hardware, **({peak_memory.HOST_BASELINE_KEY: baseline} if baseline else {})}
        model = {"name": "tiny", "parameter_count": 1, "fingerprint": resolve_model("tiny").fingerprint}
        path = save_calibration(synthetic_calibration(hardware=recorded, model=model))
        code, out, err = run_main(
            "train",
            ["--use-calibration", str(path), "--data", "sample", "--deadline", "1h", "--dry-run", "--json"],
            capsys,
        )
        assert code == 0, err
        return float(json.loads(out)["plan"]["chosen"]["peak_memory_bytes"])

    assert planned_peak(700 * 2**20) - planned_peak(None) == pytest.approx(200 * 2**20, rel=1e-6)
