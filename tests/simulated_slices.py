"""`bench run --gpu h100 --model MODEL --layers auto|K1,K2,…` on the simulated H100 (tests/simulated.py):
the depths benched one after the other on one virtual clock, as one process runs them: the budget
split by the planner's prices, shapes compiled at one depth compiled for the next, the one-off
timings made once (bench.layer_slices); the depths combined into the whole model's calibration, as
a real run combines them (bench.layer_slices)."""

from __future__ import annotations

from typing import Any

from benchtrain.common.errors import BenchtrainError


def simulate_slices(
    model: str,
    lora: bool,
    budget: float,
    depths: tuple[int, ...] | str = "auto",
    seed: int = 0,
    checkpointing: tuple[int, ...] = (0,),
) -> tuple[dict[str, Any], dict[int, dict[str, Any]], float]:
    """(the whole model's calibration, each depth's, the seconds all took on the virtual clock)
    from slices of `model` on the simulated H100.
    `depths="auto"`: --layers auto's ladders (the whole model is not benched here: the caller
    compares with `simulate_bench`)."""
    from simulated import H100Measurements, VirtualClock, run_simulated

    from benchtrain.bench.layer_slices import (
        AUTO_LADDERS,
        auto_depths,
        depth_share,
        refuse_if_unaffordable,
        whole_model_record,
    )
    from benchtrain.bench.variant_measurement import Carry
    from benchtrain.train.workload.method import MethodConfig
    from benchtrain.train.workload.model import resolve_model

    spec = resolve_model(model)
    method = MethodConfig(method="lora") if lora else MethodConfig()
    priced: dict[tuple[int, ...], Any] = {}

    def priced_ladder(ladder: tuple[int, ...]) -> Any:
        if ladder not in priced:  # planned once: auto's choice and the run share it
            priced[ladder] = price_ladder(spec, lora, ladder, budget, seed, checkpointing)
        return priced[ladder]

    if depths == "auto":
        hardware = H100Measurements.load().hardware
        fitting = auto_depths(
            spec, method, hardware, (1, "none"), lambda ladder: sum(priced_ladder(ladder)[1].values()) <= budget
        )
        if fitting is None:
            raise BenchtrainError(f"--layers auto: no ladder of {AUTO_LADDERS} fits")
        depths = fitting
    assert isinstance(depths, tuple)
    benches, prices = priced_ladder(depths)
    refuse_if_unaffordable(prices, budget, spec.name)
    clock, carry = VirtualClock(), Carry()
    records = {}
    for index, depth in enumerate(depths):
        bench = benches[depth]
        bench.device.clock = clock
        carry.one_off = index == len(depths) - 1
        carry.seed(bench.device.compiled_shapes)
        bench.task = carry.prepare(bench.task, bench.planner)
        records[depth] = run_simulated(bench, depth_share(budget - clock(), prices, depths[index:]))
        carry.done(bench.planner)
    return whole_model_record(records, spec, method, f"simulated: {','.join(map(str, depths))}"), records, clock()


def price_ladder(
    spec: Any, lora: bool, depths: tuple[int, ...], budget: float, seed: int = 0, checkpointing: tuple[int, ...] = (0,)
) -> tuple[dict[int, Any], dict[int, Any]]:
    """Each depth's simulated bench, planned (not run), and its prices (bench.layer_slices)."""
    from dataclasses import replace

    from simulated import simulated_setup

    from benchtrain.bench.calibrate import after_probes_seconds
    from benchtrain.bench.layer_slices import price_depths, slice_spec

    benches = {}
    for index, depth in enumerate(depths):
        bench = simulated_setup(slice_spec(spec, depth), lora, budget, checkpointing, seed=seed)
        bench.task = replace(bench.task, one_off_timings=index == len(depths) - 1)
        benches[depth] = bench
    before = {depth: 1.0 + bench.device.build_seconds for depth, bench in benches.items()}
    return benches, price_depths(
        {depth: (b.planner, before[depth], after_probes_seconds(b.task, b.planner)) for depth, b in benches.items()}
    )
