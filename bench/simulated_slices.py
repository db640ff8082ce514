"""`bench run --gpu h100 --model MODEL --layers K1,K2,…` on the simulated H100 (bench.simulated):
each depth benched on the virtual clock within its share of the budget (bench.layer_slices), the
depths combined into the whole model's calibration, as a real run combines them."""

from __future__ import annotations

from typing import Any


def simulate_slices(model: str, lora: bool, budget: float, depths: tuple[int, ...], seed: int = 0) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    """(the whole model's calibration, each depth's) from slices of `model` on the simulated H100."""
    from bench.layer_slices import depth_prices, slice_spec, whole_model_record
    from bench.simulated import simulate_bench
    from train.workload.method import MethodConfig
    from train.workload.model import resolve_model

    spec = resolve_model(model)
    method = MethodConfig(method="lora") if lora else MethodConfig()
    prices = depth_prices(spec, method, depths)
    records = {}
    for depth in depths:
        share = budget * prices[depth] / sum(prices.values())
        records[depth], _ = simulate_bench(slice_spec(spec, depth), lora, share, seed=seed)
    return whole_model_record(records, spec, method, f"simulated: {','.join(map(str, depths))}"), records
