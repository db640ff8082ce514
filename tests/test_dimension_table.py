"""Adding a dimension of the training step is one entry in calibration/dimensions.py's DIMENSIONS:
an entry registered there alone (activation offloading, here: a switch that costs time per token
and keeps fewer activations) is an option of `bench run`, an axis of the search space the probes
cover, a column of the measurement rows, terms of the throughput and memory fits, a coordinate of
the residual smoother, an option of `train` and a choice of the planner, a key of run.json's step
configuration and of its command's configuration; and
a calibration or run.json written before it reads it as off. What a switch does to the step is its
applier (train/step/switches.py's APPLIERS, named by the entry): a switch that slows the model's
forward, registered in the two tables alone, reaches the real step the probes time and train runs,
and the planner plans on the calibration those probes make."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import GIB, synthetic_calibration, tokenized_from_samples

from benchtrain.bench.probe import ProbeSettings, Workload, run_probe
from benchtrain.bench.runner import Budget, run_grid
from benchtrain.bench.space import SearchSpace
from benchtrain.calibration.dimensions import DIMENSIONS, Dimension, Term, switches
from benchtrain.calibration.fit import residual_coordinates, throughput_model_from_json
from benchtrain.calibration.model import Calibration
from benchtrain.calibration.run_file import RunFile
from benchtrain.calibration.schema import read_calibration_file
from benchtrain.calibration.step_config import StepConfig
from benchtrain.common.errors import BenchtrainError, DoesNotFitError
from benchtrain.train.planning.deadline import Deadline
from benchtrain.train.planning.planner import make_plan
from benchtrain.train.planning.types import PlanRequest
from benchtrain.train.step import step as step_module
from benchtrain.train.step.engine import StepOptions, engine_from_options
from benchtrain.train.step.runtime import make_accelerator
from benchtrain.train.step.switches import APPLIERS
from benchtrain.train.workload.method import MethodConfig, unwrap
from benchtrain.train.workload.model import resolve_model

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


# A switch that changes the step itself, as recomputing activations or copying them to the host does: its applier
# puts a pause before the model's forward for each token it is given. The step runs for real (forward, backward,
# optimizer); its clock is a fake device's, so that the time a forward costs is what the hooks say, whatever else
# the machine runs.
SLOW_FORWARD = Dimension(
    "slow_forward",
    "slow",
    "--slow",
    "slow forward modes to measure, e.g. off,on",
    switch=True,
    label="/slow",
    phrase=", slow forward",
    plan_flag="--slow-forward",
    plan_help="pause in every forward: auto (default) picks whichever measured mode finishes sooner",
    applier="pause_in_forward",
    throughput=(Term("pause_per_token", "tokens", device=False),),
)
FORWARD_FIXED, FORWARD_PER_TOKEN, PAUSE_PER_TOKEN = 1e-3, 2e-5, 1e-4  # the fake device's seconds
QUICK = ProbeSettings(warmup_steps=1, min_steps=2, max_steps=2, max_seconds=60.0)


class DeviceClock:
    """What train.step.step reads as `time`: seconds spent by the forwards' hooks alone."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def perf_counter(self) -> float:
        return self.seconds

    def forward_costs(self, fixed: float, per_token: float) -> Any:
        """A forward pre-hook that spends this on the clock for the tokens the forward is given."""

        def spend(_module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
            self.seconds += fixed + per_token * kwargs["input_ids"].numel()

        return spend


CLOCK = DeviceClock()


def pause_in_forward(model: Any, on: bool) -> None:
    """The applier: a pause before every forward of the model (under its wrappers), its hook kept on the model."""
    base = unwrap(model)
    if on:
        base.pause_hook = base.register_forward_pre_hook(CLOCK.forward_costs(0.0, PAUSE_PER_TOKEN), with_kwargs=True)
    else:
        base.pause_hook.remove()
        del base.pause_hook


@pytest.fixture()
def with_slow_forward(monkeypatch: pytest.MonkeyPatch) -> Dimension:
    """The whole change: one entry in the dimension table and its applier in the step's (and the fake device's clock)."""
    monkeypatch.setitem(DIMENSIONS, SLOW_FORWARD.name, SLOW_FORWARD)
    monkeypatch.setitem(APPLIERS, SLOW_FORWARD.applier, pause_in_forward)
    monkeypatch.setattr(step_module, "time", CLOCK)
    return SLOW_FORWARD


def timed_workload() -> Workload:
    """The tiny model's workload, each forward costing the fake device its own time."""
    workload = Workload(resolve_model("tiny"), options=StepOptions(compile="off", loss="plain"))
    unwrap(workload.engine.model).register_forward_pre_hook(
        CLOCK.forward_costs(FORWARD_FIXED, FORWARD_PER_TOKEN), with_kwargs=True
    )
    return workload


def test_every_switch_of_the_table_names_an_applier_of_the_step() -> None:
    assert all(dimension.applier in APPLIERS for dimension in switches())


def test_the_engine_builds_the_step_with_a_switch_on_and_a_probe_switches_it(with_slow_forward: Dimension) -> None:
    options = StepOptions(compile="off", loss="plain")
    engine = engine_from_options(resolve_model("tiny"), MethodConfig(), make_accelerator(), options, ("slow_forward",))
    assert engine.switches == ("slow_forward",) and hasattr(unwrap(engine.model), "pause_hook")
    engine.switch(())
    assert engine.switches == () and not hasattr(unwrap(engine.model), "pause_hook")

    workload = timed_workload()
    off, on = StepConfig(2, 0, 1, 32), StepConfig(2, 0, 1, 32, ("slow_forward",))
    slow = run_probe(workload, on, QUICK)
    assert workload.engine.switches == ("slow_forward",) and slow["slow_forward"] == 1
    fast = run_probe(workload, off, QUICK)
    assert not hasattr(unwrap(workload.engine.model), "pause_hook") and fast["slow_forward"] == 0
    assert fast["step_seconds"] == pytest.approx(FORWARD_FIXED + FORWARD_PER_TOKEN * 64)
    assert slow["step_seconds"] - fast["step_seconds"] == pytest.approx(PAUSE_PER_TOKEN * 64)


def test_the_planner_plans_on_a_calibration_whose_probes_ran_the_switch(with_slow_forward: Dimension) -> None:
    workload = timed_workload()
    space = SearchSpace(batch_sizes=(1, 2), workers=(0,), accums=(1,), seq_lens=(16, 32), slow=(0, 1))
    rows = run_grid(space, lambda config, _remaining: run_probe(workload, config, QUICK), Budget(None)).rows
    assert sorted(row["slow_forward"] for row in rows) == [0] * 4 + [1] * 4
    calibration = Calibration(synthetic_calibration(rows))
    assert calibration.fit["parameters"]["pause_per_token"] == pytest.approx(PAUSE_PER_TOKEN, rel=0.1)
    request = PlanRequest(
        epochs=1, deadline=Deadline.with_margin_share(1e6, 0.05), effective_batch=4, max_length=32, priority="fast"
    )
    plan = make_plan(calibration, packed_data(), request)
    assert not plan.chosen.config.on("slow_forward")  # it only costs time
    slowed = make_plan(
        calibration, packed_data(), PlanRequest(**{**request.__dict__, "switches": {"slow_forward": "on"}})
    )
    assert slowed.chosen.config.on("slow_forward") and slowed.chosen.config.phrase.endswith(", slow forward")
    assert slowed.chosen.step_seconds > plan.chosen.step_seconds
