"""Training metrics for bench, the live log, trackers and run.json: tokens/s, TFLOP/s, MFU, data-wait
share. Design: docs/design.md#metrics"""

from __future__ import annotations

from collections.abc import Callable, Iterable


def tokens_per_second(tokens: float, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def mfu(tokens_per_second_computed: float, flops_per_token: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation, or None where the device has no peak-FLOPs entry (CPUs)."""
    if not peak_flops:
        return None
    return tokens_per_second_computed * flops_per_token / peak_flops


def batch_flops(shapes: Iterable[tuple[int, ...]], flops_per_token: Callable[[int], float]) -> float:
    """FLOPs of micro-batches of these (rows, length) shapes, each at its own length: a padded batch
    is as long as its longest row, usually far shorter than max_length."""
    return float(sum(rows * length * flops_per_token(length) for rows, length in shapes))


def data_wait_share(wait_seconds: float, step_seconds: float) -> float:
    return min(1.0, wait_seconds / step_seconds) if step_seconds > 0 else 0.0


def step_figures(
    tokens_computed: float, seconds: float, wait_seconds: float, flops_per_token: float, peak_flops: float | None
) -> dict[str, float | None]:
    """The figures of `seconds` of training that computed `tokens_computed` positions (padding included, on one process) and waited `wait_seconds` for data."""
    rate = tokens_per_second(tokens_computed, seconds)
    return {
        "computed_tokens_per_second": rate,
        "tflops": rate * flops_per_token / 1e12,
        "mfu": mfu(rate, flops_per_token, peak_flops),
        "data_wait_share": data_wait_share(wait_seconds, seconds),
    }


def planned_figures(
    computed_tokens: float, step_seconds: float, world_size: int, flops_per_token: float, peak_flops: float | None
) -> dict[str, float | None]:
    """A plan's predicted TFLOP/s and MFU per process: `computed_tokens` positions (padding
    included, every process together) in `step_seconds` of predicted training."""
    return step_figures(computed_tokens / max(1, world_size), step_seconds, 0.0, flops_per_token, peak_flops)
