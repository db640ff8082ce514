"""How wrong an estimate was: one convention, computed here and nowhere else.

    estimate error = (actual − estimated) / estimated

Positive: the run took longer than estimated (the estimate was optimistic). Negative: it finished
sooner. Relative to the estimate, because the estimate is what the user planned with.
"""

from __future__ import annotations

import math


def estimate_error_pct(estimated_seconds: float | None, actual_seconds: float | None) -> float | None:
    """Percent by which the actual time exceeded the estimate (None when either is missing)."""
    if not estimated_seconds or actual_seconds is None or not math.isfinite(estimated_seconds):
        return None
    return (actual_seconds - estimated_seconds) / estimated_seconds * 100


def describe_estimate_error(pct: float | None) -> str:
    """`+12.3% (took longer than estimated)`, `-4.0% (took less time than estimated)`."""
    if pct is None:
        return "n/a"
    if abs(pct) < 0.05:
        return "+0.0% (as estimated)"
    return f"{pct:+.1f}% (took {'longer' if pct > 0 else 'less time'} than estimated)"


ERROR_LABEL = "estimate error % (+ = took longer than estimated)"
