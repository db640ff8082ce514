"""Memory sizes as people write them: `24GiB`, `24G`, `80GB`, `512MiB`, or plain GiB (`24`)."""

from __future__ import annotations

import math
import re

from common.errors import BenchtrainError

_UNITS = {
    **{"": 2**30, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12},
    **{"k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30, "t": 2**40, "tib": 2**40},
}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([a-z]*)")


def parse_memory_size(text: str, what: str = "size") -> int:
    """Bytes in `text` (a bare number is GiB, as device memory is quoted; G and GiB are 2^30, GB
    10^9); a one-line error for anything else, zero and negatives included."""
    match = _SIZE.fullmatch(str(text).strip().lower())
    if not match or match.group(2) not in _UNITS:
        raise BenchtrainError(f"{what} {text!r} is not a memory size: write e.g. 24GiB, 80GB, 512MiB or plain GiB (24)")
    size = float(match.group(1)) * _UNITS[match.group(2)]
    if not math.isfinite(size) or size <= 0:
        raise BenchtrainError(f"{what} must be positive, got {text!r}")
    return int(size)
