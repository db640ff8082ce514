"""The max lengths a plan weighs, from the data's real token profile and the calibrated lengths;
the lengths `bench run --data` measures for it; and the refusal of a length that leaves (nearly)
nothing to train on.
"""

from __future__ import annotations

import math

from calibration.model import Calibration
from common.errors import BenchtrainError
from train.planning.types import PlanRequest
from train.workload.batching import DataView
from train.workload.data import covering_length, truncation

# Share of samples each priority keeps whole (1 - the share it may truncate).
COVERAGE = {"quality": 1.0}
DEFAULT_COVERAGE = 0.995
# A length chosen beyond the calibrated ones is rounded up to a multiple of this.
LENGTH_GRANULE = 64
MIN_MEASURED_LENGTH = 16  # bench's shortest length when halving towards short data
# A max length that leaves less than this share of the trainable tokens is refused, not planned.
MIN_TRAINABLE_SHARE = 0.01


def choose_lengths(calibration: Calibration, data: DataView, request: PlanRequest) -> tuple[list[int], list[str], list[str]]:
    """Candidate max lengths, notes, and warnings. Padded data honours the priority's truncation
    limit on the real token profile: the smallest calibrated length that covers it, else a longer
    one (extrapolated, and said so); only the model's position table can stop that, loudly."""
    calibrated = calibration.measured_values("seq_len")
    notes: list[str] = []
    warnings: list[str] = []
    coverage = COVERAGE.get(request.priority, DEFAULT_COVERAGE)
    if isinstance(request.max_length, int):
        if request.max_length < 1:
            raise BenchtrainError(f"--max-length must be positive or auto, got {request.max_length}")
        if not calibrated or request.max_length > calibrated[-1] or request.max_length < calibrated[0]:
            measure = f"`bench run --seq-lens {calibrated[-1]},{request.max_length}` measures it" if calibrated else "`bench run` measures it"
            notes.append(f"max length {request.max_length} is outside the calibrated lengths {calibrated}: the estimate extrapolates; {measure}")
        if not data.packing:
            cut = truncation(data.lengths, request.max_length)
            if cut["share_truncated"] > 1 - coverage + 1e-12:
                warnings.append(
                    f"--max-length {request.max_length} truncates {cut['share_truncated']:.1%} of samples, more than {request.priority} allows "
                    f"({1 - coverage:.1%}); --max-length auto keeps them"
                )
        return [request.max_length], notes, warnings
    if data.packing:
        # Packing truncates nothing: every calibrated length is a candidate; quality takes the longest.
        return ([calibrated[-1]] if request.priority == "quality" else calibrated), notes, warnings
    needed = covering_length(data.lengths, coverage)
    covering = [length for length in calibrated if length >= needed]
    if covering:
        return [covering[0]], notes, warnings
    limit = request.max_positions or math.inf
    length = min(-(-needed // LENGTH_GRANULE) * LENGTH_GRANULE, limit)
    if length >= needed:
        notes.append(
            f"max length {length} covers {coverage:.1%} of samples ({needed} tokens) but is longer than any calibrated length "
            f"({calibrated[-1]}): the estimate extrapolates; `bench run --seq-lens {calibrated[-1]},{length}` measures it"
        )
        return [int(length)], notes, warnings
    cut = truncation(data.lengths, int(length))
    warnings.append(
        f"the model accepts at most {int(limit)} tokens, so {cut['share_truncated']:.1%} of samples are truncated "
        f"({request.priority} allows {1 - coverage:.1%}; {coverage:.1%} of samples need {needed})"
    )
    return [int(length)], notes, warnings


def lengths_to_measure(data: DataView, defaults: tuple[int, ...], max_positions: int) -> tuple[int, ...]:
    """The sequence lengths `bench run --data` measures. Padded data: the lengths the planner will
    choose for it (what covers each priority's share of samples, rounded up to LENGTH_GRANULE: a
    longest sample of 1481 tokens gives 1536) and, below them, the longest default lengths (halves
    of the shortest for short data), as many lengths in all as the default grid has, so that the
    fit still sees a spread. Packed data fills any length, so it keeps the defaults."""
    if data.packing:
        return defaults
    coverages = {*COVERAGE.values(), DEFAULT_COVERAGE}
    needed = sorted({min(-(-covering_length(data.lengths, share) // LENGTH_GRANULE) * LENGTH_GRANULE, max_positions) for share in coverages})
    room = max(0, len(defaults) - len(needed))
    shorter = [length for length in defaults if length < needed[0]][-room:] if room else []
    while len(shorter) < room and (shorter or needed)[0] // 2 >= MIN_MEASURED_LENGTH:
        shorter.insert(0, (shorter or needed)[0] // 2)
    return tuple(sorted({*shorter, *needed}))


def check_trainable_tokens(data: DataView, max_length: int, request: PlanRequest) -> None:
    """Refuse a max length that truncates (nearly) every trainable token away: a run that computes
    loss on nothing would train nothing and still exit 0."""
    if data.packing:
        return  # packing truncates nothing
    whole = data.real_tokens(max(data.lengths))
    kept = data.real_tokens(max_length)
    if whole and kept >= MIN_TRAINABLE_SHARE * whole:
        return
    what = f"--max-length {max_length}" if isinstance(request.max_length, int) else f"max length {max_length} (the model's limit)"
    cut = truncation(data.lengths, max_length)
    needed = min(covering_length(data.lengths, DEFAULT_COVERAGE), request.max_positions or math.inf)
    keeps = data.real_tokens(int(needed)) / whole if whole else 0.0
    raise BenchtrainError(
        f"{what} leaves {kept:,} of {whole:,} trainable tokens ({kept / whole if whole else 0:.1%}; the loss is on {data.loss_on}): "
        f"{cut['share_truncated']:.1%} of samples are truncated; --max-length {int(needed)} keeps {keeps:.1%} of them"
    )
