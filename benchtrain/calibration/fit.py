"""Fit the throughput model (a sum of physical terms per micro-step, and its competing forms) to
benchmark measurements, and say how wrong it is on held-out probes. Memory: calibration/memory_fit.py.
The model and why: docs/design.md#throughput-fit"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import numpy as np
from scipy.optimize import least_squares

from benchtrain.calibration.dimensions import Dimension, scaled, switches
from benchtrain.calibration.extrapolation import held_out_by_dimension
from benchtrain.calibration.fit_tools import (
    UNCERTAINTY_FLOOR,
    ErrorSummary,
    fit_nonnegative,
    folds,
    held_out_predictions,
)
from benchtrain.calibration.memory_fit import fit_memory_rows
from benchtrain.calibration.step_config import StepConfig
from benchtrain.common.json_types import JsonDict


@dataclass(frozen=True)
class SizeTerm:
    """One of the physical model's own terms over the four sizes (B rows, S length, A accumulation,
    W workers; T = B·S tokens): its name in the fit, the one-line formula of its feature, and the
    feature itself. Why each term is there: docs/design.md#throughput-fit."""

    name: str
    formula: str
    feature: Callable[[StepConfig], float]


def _tokens(config: StepConfig) -> int:
    return config.micro_batch_size * config.seq_len


# The physical model's own terms; each switch of calibration.dimensions adds its own after them.
SIZE_TERM_TABLE = (
    SizeTerm("fixed", "1", lambda config: 1.0),
    SizeTerm("per_token", "T", _tokens),
    SizeTerm("attention", "T·S", lambda config: _tokens(config) * config.seq_len),
    SizeTerm("optimizer_step", "1/A", lambda config: 1.0 / config.grad_accum),
    SizeTerm("serial_data", "T when W = 0, else 0", lambda config: _tokens(config) if config.num_workers == 0 else 0.0),
    SizeTerm(
        "worker_supply",
        "T/W when W > 0, else 0",
        lambda config: _tokens(config) / config.num_workers if config.num_workers > 0 else 0.0,
    ),
    SizeTerm("per_worker", "W", lambda config: float(config.num_workers)),
)
SIZE_TERMS = tuple(term.name for term in SIZE_TERM_TABLE)
SIZE_DEVICE_TERMS = ("per_token", "attention")


def throughput_terms() -> tuple[str, ...]:
    """Every term, in the features' order: the sizes', then each switch's (the table's order)."""
    return (*SIZE_TERMS, *(term.name for dimension in switches() for term in dimension.throughput))


def device_terms() -> tuple[str, ...]:
    """The device part of a micro-step (overlapping with the host's fixed cost in the `overlap` form)."""
    return (
        *SIZE_DEVICE_TERMS,
        *(term.name for dimension in switches() for term in dimension.throughput if term.device),
    )


def throughput_features(config: StepConfig) -> np.ndarray:
    """One row of the fit's features: SIZE_TERM_TABLE's, then each switch's terms (zero when it is off)."""
    tokens, length = _tokens(config), config.seq_len
    sizes = [term.feature(config) for term in SIZE_TERM_TABLE]
    switched = [
        scaled(term.scale, tokens, length) if config.on(dimension.name) else 0.0
        for dimension in switches()
        for term in dimension.throughput
    ]
    return np.array([*sizes, *switched])


def probe_uncertainty(rows: Sequence[JsonDict]) -> np.ndarray:
    """Relative standard error of each probe's median step (its spread over the steps it timed), with UNCERTAINTY_FLOOR."""
    values = []
    for row in rows:
        spread, steps = row.get("step_seconds_spread"), row.get("timed_steps")
        if isinstance(spread, (int, float)) and isinstance(steps, (int, float)) and steps > 0:
            # IQR / 1.349 estimates sigma; the median's standard error is about 1.25 sigma / sqrt(n).
            standard_error = 0.93 * float(spread) / math.sqrt(float(steps))
        else:
            standard_error = 0.0
        values.append(math.hypot(standard_error, UNCERTAINTY_FLOOR))
    return np.array(values)


@dataclass
class ResidualSmoother:
    """Kernel-weighted mean of log-residuals in (log2 B, log2 S, log2 A, W) space, shrunk to 0."""

    points: np.ndarray
    log_residuals: np.ndarray
    bandwidth: float
    prior_weight: float = 0.5

    def __call__(self, config: StepConfig) -> float:
        if len(self.points) == 0:
            return 0.0
        distance2 = ((self.points - residual_coordinates(config)) ** 2).sum(axis=1)
        weights = np.exp(-0.5 * distance2 / self.bandwidth**2)
        return float((weights * self.log_residuals).sum() / (weights.sum() + self.prior_weight))

    def to_json(self) -> JsonDict:
        return {
            "points": self.points.tolist(),
            "log_residuals": self.log_residuals.tolist(),
            "bandwidth": self.bandwidth,
            "prior_weight": self.prior_weight,
        }

    @classmethod
    def from_json(cls, data: JsonDict) -> ResidualSmoother:
        """Stored points each padded with 0 (off) for a switch coordinate the file predates."""
        points = np.array(data["points"], dtype=float).reshape(len(data["points"]), -1)
        padded = np.pad(points, ((0, 0), (0, max(0, 4 + len(smoother_switches()) - points.shape[1]))))
        return cls(
            padded,
            np.array(data["log_residuals"], dtype=float),
            float(data["bandwidth"]),
            float(data.get("prior_weight", 0.5)),
        )


def smoother_switches() -> list[Dimension]:
    """The switches the residual smoother names as coordinates, after the four sizes'."""
    return [dimension for dimension in switches() if dimension.smoother_spread is not None]


def residual_coordinates(config: StepConfig) -> np.ndarray:
    sizes = [
        math.log2(config.micro_batch_size),
        math.log2(config.seq_len),
        math.log2(config.grad_accum),
        math.log2(1 + config.num_workers),
    ]
    return np.array(
        [
            *sizes,
            *((dimension.smoother_spread or 0.0) * config.value(dimension.name) for dimension in smoother_switches()),
        ]
    )


HOST_TERM = "fixed"
MAX_OVERLAP_POWER = 32.0


def overlapped(host: np.ndarray | float, device: np.ndarray | float, power: float) -> np.ndarray | float:
    """Smooth maximum of host and device time: their sum at power 1, their maximum as power grows."""
    if power == 1.0:
        return host + device
    high = np.maximum(host, device)
    safe = np.where(high > 0, high, 1.0)
    return safe * ((host / safe) ** power + (device / safe) ** power) ** (1.0 / power) * (high > 0)


@dataclass
class ThroughputModel:
    coefficients: dict[str, float]
    smoother: ResidualSmoother | None = None
    overlap_power: float = 1.0

    def micro_step_seconds(self, config: StepConfig) -> float:
        features = throughput_features(config)
        parts: dict[str, float] = {
            term: features[index] * self.coefficients.get(term, 0.0) for index, term in enumerate(throughput_terms())
        }
        device_part = device_terms()
        device = sum(parts[term] for term in device_part)
        rest = sum(value for term, value in parts.items() if term not in device_part and term != HOST_TERM)
        base = float(overlapped(parts[HOST_TERM], device, self.overlap_power)) + rest
        if self.smoother is not None:
            base *= math.exp(self.smoother(config))
        return max(base, 1e-9)

    def tokens_per_second(self, config: StepConfig) -> float:
        return config.micro_batch_size * config.seq_len / self.micro_step_seconds(config)


# Which terms describe the training step itself and which the wait for the next batch.
DATA_TERMS = ("serial_data", "worker_supply")


def compute_index() -> list[int]:
    return [i for i, term in enumerate(throughput_terms()) if term not in DATA_TERMS]


def fit_overlap(
    features: np.ndarray, targets: np.ndarray, scale: np.ndarray, uncertainty: np.ndarray | None, start: np.ndarray
) -> tuple[np.ndarray, float]:
    """The compute terms and the overlap power, by robust non-negative nonlinear least squares on
    relative error, started from the additive (power 1) solution."""
    terms = throughput_terms()
    columns = compute_index()
    device = [columns.index(terms.index(term)) for term in device_terms()]
    host = columns.index(terms.index(HOST_TERM))
    additive = [position for position in range(len(columns)) if position not in device and position != host]
    weight = 1.0 / (scale * (uncertainty if uncertainty is not None else 1.0))
    magnitude = np.abs(features).max(axis=0)
    # Terms no probe exercises (e.g. recompute without checkpointed probes) stay at zero.
    free = magnitude > 0
    magnitude = np.where(free, magnitude, 1.0)
    unit = targets.mean()

    def predict(x: np.ndarray) -> np.ndarray:
        theta = np.where(free, x[:-1], 0.0) * unit / magnitude
        host_part = features[:, host] * theta[host]
        device_part = features[:, device] @ theta[device]
        seconds: np.ndarray = (
            overlapped(host_part, device_part, float(np.exp(x[-1]))) + features[:, additive] @ theta[additive]
        )
        return seconds

    x0 = np.concatenate([start * magnitude / unit, [np.log(2.0)]])
    solution = least_squares(
        lambda x: (predict(x) - targets) * weight,
        np.clip(x0, 0, None),
        bounds=(np.zeros(len(x0)), np.concatenate([np.full(len(x0) - 1, np.inf), [np.log(MAX_OVERLAP_POWER)]])),
        loss="soft_l1",
        f_scale=2.0,
    )
    return np.where(free, solution.x[:-1], 0.0) * unit / magnitude, float(np.exp(solution.x[-1]))


def fit_terms(
    features: np.ndarray, terms: Sequence[str], targets: np.ndarray, flops: dict[str, float] | None, **options: Any
) -> np.ndarray:
    """Non-negative coefficients of `terms`. With `flops` (FLOPs per token of each device term, from the model's shape: calibration.flops_terms), the device
    terms are tied to one cost per FLOP: one unknown instead of four, which few probes can pin down."""
    device = [index for index, term in enumerate(terms) if term in device_terms()]
    if flops is None or not device:
        return fit_nonnegative(features, targets, **options)
    other = [index for index in range(len(terms)) if index not in device]
    weights = np.array([float(flops.get(terms[index], 0.0)) for index in device])
    reduced = np.column_stack([features[:, other], features[:, device] @ weights])
    solution = fit_nonnegative(reduced, targets, **options)
    coefficients = np.zeros(len(terms))
    coefficients[other] = solution[:-1]
    coefficients[device] = solution[-1] * weights
    return coefficients


class Form(NamedTuple):
    """One competing form of the throughput fit: residual smoother, host/device overlap, device terms tied to FLOPs."""

    smooth: bool = False
    overlap: bool = False
    flops: dict[str, float] | None = None


PHYSICAL = Form()


def fit_throughput(
    configs: Sequence[StepConfig],
    micro_seconds: np.ndarray,
    form: Form = PHYSICAL,
    waits: np.ndarray | None = None,
    uncertainty: np.ndarray | None = None,
) -> ThroughputModel:
    """Fit the terms of `form`; with the measured DataLoader wait, the data terms to the wait and the others to the rest."""
    flops = form.flops
    features = np.stack([throughput_features(c) for c in configs])
    terms, computed = throughput_terms(), compute_index()
    power = 1.0
    if waits is None:
        solution = fit_terms(features, terms, micro_seconds, flops, uncertainty=uncertainty)
    else:
        wait = np.clip(waits, 0.0, 0.95 * micro_seconds)
        data = [i for i, term in enumerate(terms) if term in DATA_TERMS]
        solution = np.zeros(len(terms))
        compute_terms = tuple(terms[index] for index in computed)
        solution[computed] = fit_terms(
            features[:, computed],
            compute_terms,
            micro_seconds - wait,
            flops,
            scale=micro_seconds,
            uncertainty=uncertainty,
        )
        solution[data] = fit_nonnegative(features[:, data], wait, scale=micro_seconds, uncertainty=uncertainty)
        if form.overlap:  # only with the data terms fitted apart (to the wait)
            solution[computed], power = fit_overlap(
                features[:, computed], micro_seconds - wait, micro_seconds, uncertainty, solution[computed]
            )
    model = ThroughputModel(dict(zip(terms, map(float, solution), strict=True)), overlap_power=power)
    if form.smooth:
        residuals = np.log(micro_seconds / np.array([model.micro_step_seconds(c) for c in configs]))
        points = np.stack([residual_coordinates(c) for c in configs])
        model.smoother = ResidualSmoother(points, residuals, bandwidth=1.0)
    return model


def extrapolated_rows(configs: Sequence[StepConfig]) -> np.ndarray:
    """Which held-out rows lay beyond the rest of their fold's smallest or largest micro-batch, length or accumulation."""
    sizes = np.array([[config.micro_batch_size, config.seq_len, config.grad_accum] for config in configs]).reshape(
        len(configs), 3
    )
    outside = np.zeros(len(configs), dtype=bool)
    for test in folds(len(configs)):
        train = np.delete(sizes, test, axis=0)
        if len(train):
            outside[test] = ((sizes[test] < train.min(axis=0)) | (sizes[test] > train.max(axis=0))).any(axis=1)
    return outside


MIN_ROWS_FOR_FIT = 3
MIN_ROWS_FOR_OVERLAP = 8  # a nonlinear form needs more probes than terms
MIN_OVERLAP_POWER = 1.1


def choose_model(errors: dict[str, ErrorSummary], rows: int) -> tuple[str, str]:
    """The form kept (docs/design.md#throughput-fit: physical or FLOPs-tied unless another is clearly better), and why in words."""
    physical = errors["physical"].median_abs_pct
    baseline = "flops" if "flops" in errors and errors["flops"].median_abs_pct <= physical else "physical"
    base_error = errors[baseline].median_abs_pct
    best, best_error = baseline, base_error
    for kind in ("overlap", "physical+residual"):
        if kind not in errors or rows < 6:
            continue
        gain = base_error - errors[kind].median_abs_pct
        if gain > max(0.5, 0.1 * base_error) and errors[kind].median_abs_pct < best_error:
            best, best_error = kind, errors[kind].median_abs_pct
    others = ", ".join(f"{kind} {summary.median_abs_pct:.1f}%" for kind, summary in errors.items() if kind != best)
    if best == "physical":
        return best, f"the physical model's held-out median error ({physical:.1f}%) was not clearly beaten ({others})"
    if best == "flops":
        return (
            best,
            f"tying the compute terms to the model's FLOPs held out as well or better ({base_error:.1f}%) with fewer terms ({others})",
        )
    return (
        best,
        f"the {best} model cut the held-out median error from {base_error:.1f}% ({baseline}) to {best_error:.1f}% ({others})",
    )


def fit_measurements(
    rows: Sequence[JsonDict], flops: dict[str, float] | None = None, gradient_bytes: float = 0.0
) -> JsonDict:
    """The `fit` section of a calibration from its `ok` rows. With `flops` (FLOPs per token of each compute term) a
    FLOPs-tied form competes too; the memory fit holds at least `gradient_bytes` while accumulating."""
    ok_rows = [row for row in rows if row.get("status") == "ok" and row.get("step_seconds")]
    if len(ok_rows) < MIN_ROWS_FOR_FIT:
        raise ValueError(f"need at least {MIN_ROWS_FOR_FIT} successful probes to fit, got {len(ok_rows)}")
    configs = [StepConfig.from_row(row) for row in ok_rows]
    micro_seconds = np.array([row["step_seconds"] / row["grad_accum"] for row in ok_rows])
    # The measured DataLoader wait separates data supply from compute (when every row has it).
    shares = [row.get("data_wait_share") for row in ok_rows]
    wait_seconds = (
        micro_seconds * np.array(shares, dtype=float) if all(isinstance(v, (int, float)) for v in shares) else None
    )
    uncertainty = probe_uncertainty(ok_rows)

    def fit_on(form: Form, train: np.ndarray) -> Callable[[StepConfig], float]:
        """`form` fitted on the rows `train`, as a prediction of micro-step seconds."""
        waits = None if wait_seconds is None else wait_seconds[train]
        return fit_throughput(
            [configs[i] for i in train], micro_seconds[train], form, waits, uncertainty[train]
        ).micro_step_seconds

    # The overlap form competes only where host and device really overlap: at power 1 it is the physical model again.
    overlapping = (
        wait_seconds is not None
        and len(configs) >= MIN_ROWS_FOR_OVERLAP
        and fit_throughput(configs, micro_seconds, Form(overlap=True), wait_seconds, uncertainty).overlap_power
        > MIN_OVERLAP_POWER
    )
    forms = {
        "physical": PHYSICAL,
        "physical+residual": Form(smooth=True),
        "overlap": Form(overlap=True),
        "flops": Form(flops=flops),
    }
    usable = [
        kind
        for kind, form in forms.items()
        if (overlapping or not form.overlap) and (kind != "flops" or flops is not None)
    ]
    held_out_by_form = {kind: held_out_predictions(configs, partial(fit_on, forms[kind])) for kind in usable}
    # tokens/s error: actual/predicted on the same token count.
    errors = {
        kind: ErrorSummary.from_pairs(1.0 / held_out, 1.0 / micro_seconds)
        for kind, held_out in held_out_by_form.items()
    }
    kind, reason = choose_model(errors, len(configs))
    error, held_out, form = errors[kind], held_out_by_form[kind], forms[kind]
    model = fit_throughput(configs, micro_seconds, form, wait_seconds, uncertainty)

    memory_rows = [row for row in ok_rows if row.get("peak_memory_bytes")]
    memory_section: JsonDict | None = None
    if len(memory_rows) >= MIN_ROWS_FOR_FIT:
        memory_section = fit_memory_rows(memory_rows, gradient_bytes)  # reserved + outside the allocator where recorded

    outside = extrapolated_rows(configs)
    extrapolated = ErrorSummary.from_pairs(1.0 / held_out[outside], 1.0 / micro_seconds[outside])
    return {
        "kind": kind,
        "reason": reason,
        "terms": list(throughput_terms()),
        "parameters": {**model.coefficients, "overlap_power": model.overlap_power},
        "smoother": model.smoother.to_json() if model.smoother else None,
        "held_out_error": error.to_json(),
        # The held-out rows that lay beyond the others' range: what an extrapolating plan can expect.
        "extrapolated_error": extrapolated.to_json(),
        # Per dimension, the probes at its largest value predicted from the rest (calibration.extrapolation).
        "extrapolation_by_dimension": held_out_by_dimension(
            configs, micro_seconds, partial(fit_on, form), held_out, MIN_ROWS_FOR_FIT
        ),
        "held_out_relative_errors": error.signed_relative,
        "held_out_predicted_tokens_per_second": [
            config.micro_batch_size * config.seq_len / seconds
            for config, seconds in zip(configs, held_out, strict=True)
        ],
        "alternatives": {name: summary.to_json() for name, summary in errors.items()},
        "rows_used": len(ok_rows),
        "step_tail_factor": step_tail_factor(ok_rows),
        "memory": memory_section,
    }


EVAL_TERMS = ("fixed", "per_token", "attention")


def eval_features(micro_batch_size: int, seq_len: int) -> np.ndarray:
    tokens = micro_batch_size * seq_len
    return np.array([1.0, tokens, tokens * seq_len])


def fit_eval(rows: Sequence[JsonDict]) -> JsonDict | None:
    """Seconds of one forward-only eval batch = fixed + per_token·B·S + attention·B·S²; None with fewer than two probes."""
    ok = [row for row in rows if row.get("status") == "ok" and row.get("batch_seconds")]
    if len(ok) < 2:
        return None
    features = np.stack([eval_features(row["micro_batch_size"], row["seq_len"]) for row in ok])
    solution = fit_nonnegative(features, np.array([row["batch_seconds"] for row in ok]))
    return {"terms": list(EVAL_TERMS), "parameters": dict(zip(EVAL_TERMS, map(float, solution), strict=True))}


def step_tail_factor(rows: Sequence[JsonDict]) -> float:
    """The median over probes of mean / median step, at least 1: probes are fitted to their median step, but a run
    lasts the sum of its steps, slow ones included, so predictions are scaled by it."""
    ratios = [
        row["step_seconds_mean"] / row["step_seconds"]
        for row in rows
        if isinstance(row.get("step_seconds_mean"), (int, float))
        and row.get("step_seconds")
        and row["step_seconds"] > 0
    ]
    return max(1.0, float(np.median(ratios))) if ratios else 1.0


def throughput_model_from_json(fit: JsonDict) -> ThroughputModel:
    smoother = ResidualSmoother.from_json(fit["smoother"]) if fit.get("smoother") else None
    power = float(fit["parameters"].get("overlap_power", 1.0))
    # A term of a switch the file predates is zero: the step it measured had the switch off.
    return ThroughputModel(
        {term: float(fit["parameters"].get(term, 0.0)) for term in throughput_terms()}, smoother, power
    )
