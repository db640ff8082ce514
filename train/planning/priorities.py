"""The order each priority a plan may be made for (train.planning.types.PRIORITIES) puts the
candidates in: fast and quality by time alone, balanced keeping the predicted peak memory clear of
the limit first, memory_efficient taking the smallest peak among those nearly as fast as the fastest.
"""

from __future__ import annotations

from train.planning.types import Candidate

BALANCED_MEMORY_HEADROOM = 0.80  # balanced keeps predicted peak under 80% of device memory
MEMORY_EFFICIENT_SLACK = 0.10  # memory_efficient accepts up to 10% more time than the fastest


def rank(candidates: list[Candidate], priority: str, memory_limit: float) -> list[Candidate]:
    by_time = sorted(candidates, key=lambda c: (c.total_seconds, c.extrapolated, c.config.micro_batch_size))
    if priority in ("fast", "quality"):
        return by_time
    if priority == "balanced":
        roomy = [c for c in by_time if (c.peak_memory_bytes_high or 0) <= BALANCED_MEMORY_HEADROOM * memory_limit]
        return roomy + [c for c in by_time if c not in roomy]
    fastest = by_time[0].total_seconds
    near = [c for c in by_time if c.total_seconds <= fastest * (1 + MEMORY_EFFICIENT_SLACK)]
    near.sort(key=lambda c: (c.peak_memory_bytes or 0, c.total_seconds))
    return near + [c for c in by_time if c not in near]
