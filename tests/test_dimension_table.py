"""Adding a dimension of the training step is one entry in calibration/dimensions.py's DIMENSIONS:
an entry registered there alone (activation offloading, here: a switch that costs time per token
and keeps fewer activations) is an option of `bench run`, an axis of the search space the probes
cover, a column of the measurement rows, terms of the throughput and memory fits, a coordinate of
the residual smoother, an option of `train` and a choice of the planner, a key of run.json's step
configuration and of its command's configuration; and
a calibration or run.json written before it reads it as off."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import GIB, synthetic_calibration, tokenized_from_samples

from benchtrain.bench.runner import Budget, run_grid
from benchtrain.bench.space import SearchSpace
from benchtrain.calibration.dimensions import DIMENSIONS, Dimension, Term
from benchtrain.calibration.fit import residual_coordinates, throughput_model_from_json
from benchtrain.calibration.model import Calibration
from benchtrain.calibration.run_file import RunFile
from benchtrain.calibration.schema import read_calibration_file
from benchtrain.calibration.step_config import StepConfig
from benchtrain.common.errors import BenchtrainError, DoesNotFitError
from benchtrain.train.planning.deadline import Deadline
from benchtrain.train.planning.planner import make_plan
from benchtrain.train.planning.types import PlanRequest

FIXTURES = Path(__file__).parent / "fixtures"
OFFLOADING = Dimension(
    "activation_offloading",
    "offloading",
    "--offloading",
    "activation offloading modes to measure, e.g. off,on",
    switch=True,
    label="/offload",
    phrase=", activation offloading",
    plan_flag="--activation-offloading",
    plan_help="keep activations on the host: auto (default) picks whichever measured mode finishes sooner and fits in memory",
    throughput=(Term("offload_per_token", "tokens", device=False),),  # the copies to the host, beside the compute
    activations=("per_token_offloaded", "attention_offloaded"),
    leaner=True,
    smoother_spread=2.0,
)
# The truth the fake device runs (not the fit's own features): seconds per micro-step and peak bytes.
FIXED, PER_TOKEN, OFFLOAD_PER_TOKEN = 2e-3, 4e-6, 3e-6
STATIC, ACTIVATIONS, OFFLOADED = 1e8, 2e5, 2e4


@pytest.fixture()
def with_offloading(monkeypatch: pytest.MonkeyPatch) -> Dimension:
    """The whole change: one entry in the table, nothing else touched."""
    monkeypatch.setitem(DIMENSIONS, OFFLOADING.name, OFFLOADING)
    return OFFLOADING


def device(config: StepConfig, _remaining: float | None = None) -> dict[str, Any]:
    """A fake device's probe: offloading adds its copies' time per token and keeps a tenth of the activations."""
    tokens = config.micro_batch_size * config.seq_len
    offloading = config.on("activation_offloading")
    micro = FIXED + PER_TOKEN * tokens + (OFFLOAD_PER_TOKEN * tokens if offloading else 0.0)
    step = micro * config.grad_accum
    peak = STATIC + (OFFLOADED if offloading else ACTIVATIONS) * tokens
    row = {**config.to_row(), "status": "ok", "probe_seconds": 0.01, "step_seconds": step, "data_wait_share": 0.0}
    return {**row, "tokens_per_second": tokens * config.grad_accum / step, "peak_memory_bytes": peak}


def measured(memory_bytes: float = 80 * GIB) -> Calibration:
    space = SearchSpace(
        batch_sizes=(1, 2, 4, 8), workers=(0,), accums=(1, 2), seq_lens=(64, 128, 256), offloading=(0, 1)
    )
    rows = run_grid(space, device, Budget(None)).rows
    return Calibration(synthetic_calibration(rows, memory_bytes=memory_bytes))


def packed_data() -> Any:
    rng = np.random.default_rng(0)
    samples = [rng.integers(3, 200, size=int(n)).astype(np.int32) for n in rng.integers(20, 250, size=300)]
    return tokenized_from_samples(samples, [0] * len(samples), "text", "test")


def test_bench_run_offers_it_and_the_search_covers_both_modes(with_offloading: Dimension) -> None:
    from benchtrain.bench.cli import asked_space, build_parser

    parser = build_parser()
    args = parser.parse_args(["run", "--offloading", "off,on"])
    assert asked_space(args) == {"offloading": (0, 1)}
    space = SearchSpace((1, 2), (0,), (1,), (64,), offloading=(0, 1))
    assert space.modes() == [(), ("activation_offloading",)] and space.size == 4
    assert space.as_dict()["offloading"] == [0, 1]
    rows = run_grid(space, device, Budget(None)).rows
    assert sorted(row["activation_offloading"] for row in rows) == [0, 0, 1, 1]
    assert StepConfig(8, 0, 1, 64, ("activation_offloading",)).label == "B8/W0/A1/S64/offload"


def test_train_offers_it_and_hands_it_to_the_planner(with_offloading: Dimension) -> None:
    from benchtrain.train.cli import build_parser
    from benchtrain.train.recipes.config import TrainConfig

    parser = build_parser()
    assert "keep activations on the host" in parser.format_help()
    config = TrainConfig.from_args(
        parser.parse_args(["--data", "sample", "--deadline", "1h", "--activation-offloading", "on"])
    )
    assert config.plan.switches == {"gradient_checkpointing": "auto", "activation_offloading": "on"}
    written = config.to_json()
    assert written["activation_offloading"] == "on" and written["gradient_checkpointing"] == "auto"
    assert list(written).index("activation_offloading") == list(written).index("gradient_checkpointing") + 1
    with pytest.raises(BenchtrainError, match="--activation-offloading: invalid choice"):
        parser.parse_args(["--data", "sample", "--deadline", "1h", "--activation-offloading", "sometimes"])


def test_the_fits_learn_its_terms_from_the_probes(with_offloading: Dimension) -> None:
    calibration = measured()
    assert calibration.fit["parameters"]["offload_per_token"] == pytest.approx(OFFLOAD_PER_TOKEN, rel=0.1)
    memory = calibration.fit["memory"]["parameters"]
    assert memory["per_token_offloaded"] == pytest.approx(OFFLOADED, rel=0.1) and memory["per_token"] == pytest.approx(
        ACTIVATIONS, rel=0.1
    )
    off, on = StepConfig(8, 0, 1, 256), StepConfig(8, 0, 1, 256, ("activation_offloading",))
    assert calibration.predict(on).step_seconds == pytest.approx(device(on)["step_seconds"], rel=0.1)
    assert calibration.predict(on).peak_memory_bytes < calibration.predict(off).peak_memory_bytes
    assert calibration.predict(on).within_measured_range
    assert len(residual_coordinates(on)) == 6 and residual_coordinates(on)[-1] == 2.0  # the smoother's own coordinate


def test_the_planner_chooses_it_where_only_it_fits_and_run_json_records_it(
    with_offloading: Dimension, tmp_path: Path
) -> None:
    # Not even one sequence of 256 tokens fits with every activation kept; several do offloaded.
    calibration = measured(memory_bytes=STATIC + ACTIVATIONS * 256 * 0.99)
    request = PlanRequest(
        epochs=1, deadline=Deadline.with_margin_share(1e6, 0.05), effective_batch=8, max_length=256, priority="fast"
    )
    plan = make_plan(calibration, packed_data(), request)
    assert plan.chosen.config.on("activation_offloading")
    assert plan.chosen.config.phrase.endswith(", activation offloading")
    with pytest.raises(DoesNotFitError):
        make_plan(
            calibration,
            packed_data(),
            PlanRequest(**{**request.__dict__, "switches": {"activation_offloading": "off"}}),
        )
    run_file = RunFile.read(FIXTURES / "run-json-before-42.json")
    assert run_file.configuration.switches == ()  # a run.json from before the dimension: off
    run_file.configuration = plan.chosen.config
    written = json.loads(run_file.write(tmp_path).read_text())
    assert written["plan"]["configuration"]["activation_offloading"] == 1
    assert RunFile.read(tmp_path / "run.json").configuration == plan.chosen.config


def test_a_calibration_from_before_it_reads_it_as_off(with_offloading: Dimension) -> None:
    data = read_calibration_file(FIXTURES / "cpu-tiny-fullgrid.json")
    calibration = Calibration(data)
    assert throughput_model_from_json(data["fit"]).coefficients["offload_per_token"] == 0.0
    assert calibration.measured_values("activation_offloading") == [0]
    request = PlanRequest(epochs=1, deadline=Deadline.with_margin_share(1e6, 0.05), effective_batch=8)
    assert not make_plan(calibration, packed_data(), request).chosen.config.on("activation_offloading")
    with pytest.raises(
        BenchtrainError,
        match=r"^--activation-offloading on: calibration .* did not measure it; run `bench run --offloading off,on`",
    ):
        make_plan(
            calibration, packed_data(), PlanRequest(**{**request.__dict__, "switches": {"activation_offloading": "on"}})
        )
