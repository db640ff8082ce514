"""A loaded calibration: predictions with bounds, memory feasibility, the fit in words.
The bounds and why: docs/design.md#the-bound-a-plan-promises"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import cast

import numpy as np

from benchtrain.calibration.dimensions import switches
from benchtrain.calibration.distributed import Distributed
from benchtrain.calibration.extrapolation import extrapolation_widening, stretch_by_dimension
from benchtrain.calibration.fit import EVAL_TERMS, ThroughputModel, eval_features, throughput_model_from_json
from benchtrain.calibration.hardware import Hardware
from benchtrain.calibration.hub import hub_provenance
from benchtrain.calibration.memory_fit import MemoryModel, memory_model_from_json
from benchtrain.calibration.schema import variant_data
from benchtrain.calibration.setup import Variant, measured_setup
from benchtrain.calibration.slices import slice_widening
from benchtrain.calibration.step_config import StepConfig, holds_as_much
from benchtrain.calibration.store import calibrations_dir, is_bundled
from benchtrain.calibration.training import Training
from benchtrain.calibration.translate import BoundWidths, widened_bounds
from benchtrain.common.errors import BenchtrainError
from benchtrain.common.json_types import JsonDict

# The smallest relative bound we claim even when cross-validation saw less error.
MIN_RELATIVE_BOUND = 0.02
MIN_MEMORY_MARGIN = 0.10
HISTORY_WINDOW = 5
# Past this bound the calibration cannot promise a finish time: plans use the central estimate and say so.
NOISY_BOUND = 0.50
# The bound per doubling beyond the measured sizes when no held-out probe tested extrapolation.
UNTESTED_EXTRAPOLATION = NOISY_BOUND
# A held-out median error above this is said out loud (bench run, bench show, train --dry-run).
NOISY_MEDIAN_PCT = 15.0


@dataclass(frozen=True)
class BoundParts:
    """A plan's relative bound in its two parts: the fit's error and the machine's spread between
    processes, with where the latter was measured ("fresh processes", "past runs", "not measured")."""

    fit: float
    machine: float
    machine_source: str


@dataclass(frozen=True)
class Prediction:
    tokens_per_second: float
    tokens_per_second_low: float
    tokens_per_second_high: float
    step_seconds: float
    step_seconds_low: float
    step_seconds_high: float
    peak_memory_bytes: float | None
    peak_memory_bytes_high: float | None
    fits_in_memory: bool
    within_measured_range: bool


class Calibration:
    """The data of one calibration file plus the models fitted to it."""

    def __init__(self, data: JsonDict, path: Path | None = None, variant_index: int | None = None) -> None:
        self.file_data = data
        self.data = variant_data(data, variant_index) if variant_index is not None else data
        self.path = path
        self.variant_index = (
            variant_index  # which of the file's variants (calibration.schema.variant_data); None: the first
        )
        fit = self.data.get("fit")
        if not fit:
            raise BenchtrainError(f"calibration {data.get('id')} has no fitted model: re-run `bench run`")
        self.throughput: ThroughputModel = throughput_model_from_json(fit)
        self.memory: MemoryModel | None = memory_model_from_json(fit["memory"]) if fit.get("memory") else None
        # Sections calibration.schema.validate checked on load, as read.
        self.id: str = self.data["id"]
        # When bench wrote it (ISO 8601, so that text order is time order); "" where a hand-made record does not say.
        self.created_at: str = str(self.data.get("created_at", ""))
        self.fit: JsonDict = fit
        self.hardware = Hardware.from_record(self.data["hardware"])
        self.model: JsonDict = self.data["model"]
        self.measurements: list[JsonDict] = self.data["measurements"]
        # measured one-off costs (model build, warm-up, checkpoint save), seconds
        self.overheads: dict[str, float] = self.data.get("overheads", {})
        # The step measured again in fresh processes by bench (calibration.process_check); {} without.
        self.process_check: JsonDict = self.data.get("process_check") or {}
        # What the probes trained: method (full or lora), adapter settings, the base, optimizer, precision, compile, loss.
        self.training = Training.from_record(self.data.get("training"))
        # What was measured: the model, the processes the probes ran with (`accelerate launch --num_processes N`), the
        # model spread over them (none, ddp or fsdp), the checkpointing modes and the link between the devices.
        self.setup = measured_setup(self.data)
        self.world_size, self.sharding = self.setup.world_size, self.setup.sharding
        # The processes' record: their backend and the collectives they timed ({} for one process).
        self.distributed = Distributed.from_record(self.data.get("distributed"))
        # bench compared the losses and chose one (`loss_choice`): the loss `auto` takes, on any device.
        self.compared_losses = bool(self.data.get("loss_choice"))
        # What bench said of its own error while measuring (calibration.fit's noise check); None: nothing to say.
        self.noise_message: str | None = (self.data.get("noise") or {}).get("message") or None
        # The CUDA allocator settings (PYTORCH_CUDA_ALLOC_CONF) the probes ran with; None: the default.
        self.allocator_conf: str | None = (self.data.get("software") or {}).get("allocator_conf")
        # The seconds `bench run --budget` gave the search; None: not recorded.
        self.budget_seconds: float | None = _positive((self.data.get("search") or {}).get("budget_seconds"))

    # -- identity -------------------------------------------------------------------------
    @property
    def provenance(self) -> str:
        """Whose measurement a plan rests on: "measured here" (this store), "hub:ORG/NAME (by USER)" (shared on the hub: calibration.hub), "bundled NAME" (ships
        with benchtrain), "from FILE", or "translated from DEVICE …" (calibration.translate: nobody measured this device)."""
        if self.translation is not None:  # a measurement of another device, not of this one
            return f"translated from {self.translation['from_device']} by datasheet ratios"
        shared = hub_provenance(self.data)
        if shared is not None:
            return shared
        if self.path is None or Path(self.path).resolve().parent == calibrations_dir().resolve():
            return "measured here"
        return f"bundled {Path(self.path).stem}" if is_bundled(self.path) else f"from {Path(self.path).name}"

    def variants(self) -> list[Calibration]:
        """Every variant the file measured (its base's quantization, its optimizer), the first first."""
        count = len(self.file_data.get("variants") or [])
        return [Calibration(self.file_data, self.path, index) for index in (None, *range(count))]

    def with_device_memory(self, memory_bytes: int) -> Calibration:
        """This calibration planned for a device of `memory_bytes` (`train --device-memory`): its
        memory model's predictions judged against that limit instead of the measured device's."""
        data = copy.deepcopy(self.file_data)
        for entry in (data, *(data.get("variants") or [])):
            if "hardware" in entry:
                entry["hardware"] = {**entry["hardware"], "memory_bytes": memory_bytes}
        return Calibration(data, self.path, self.variant_index)

    @property
    def variant(self) -> Variant:
        """(quantize, optimizer) as train's --quantize/--optimizer name them."""
        return Variant(self.training.quantization, self.training.optimizer)

    def ok_rows(self) -> list[JsonDict]:
        return [row for row in self.measurements if row["status"] == "ok"]

    def measured_values(self, name: str) -> list[int]:
        return sorted({int(row.get(name, 0)) for row in self.ok_rows()})

    def eval_batch_seconds(self, micro_batch_size: int, seq_len: int) -> float | None:
        """Seconds of one forward-only eval batch, or None when bench did not measure evaluation."""
        fit = (self.data.get("eval") or {}).get("fit")
        if not fit:
            return None
        coefficients = [float(fit["parameters"][term]) for term in EVAL_TERMS]
        return (
            float(np.dot(eval_features(micro_batch_size, seq_len), coefficients))
            * self.step_tail_factor
            / self.history_factor
        )

    # -- error and history ----------------------------------------------------------------
    @property
    def relative_bound(self) -> float:
        """How far a prediction may be off: the fit's part and the machine's, added (bound_parts)."""
        parts = self.bound_parts
        # Measured on layer slices: widened by how far their extrapolation in depth was measured to miss.
        return slice_widening(self.data, parts.fit + parts.machine, "time")

    @property
    def bound_parts(self) -> BoundParts:
        """The fit's part of the bound (held-out p90, at least MIN_RELATIVE_BOUND) and the machine's (fresh processes or past runs)."""
        p90 = (self.fit.get("held_out_error") or {}).get("p90_abs_pct")
        fresh = float(self.process_check.get("time_spread") or 0.0)
        ratios = self._history_ratios()
        runs = max(abs(ratio / self.history_factor - 1) for ratio in ratios) if len(ratios) >= 2 else 0.0
        source = "past runs" if runs > fresh else "fresh processes" if fresh else "not measured"
        return BoundParts(max(MIN_RELATIVE_BOUND, (p90 or 0.0) / 100.0), max(fresh, runs), source)

    @property
    def from_hub(self) -> bool:
        """Read from the hub (calibration.hub), not measured here or bundled."""
        return hub_provenance(self.data) is not None

    @property
    def translation(self) -> JsonDict | None:
        """How this calibration was translated from the device it measured (calibration.translate); None: measured here."""
        record = self.data.get("translation")
        return record if isinstance(record, dict) and not record.get("identity") else None

    def bounds_for(self, config: StepConfig, measured: float | None = None) -> BoundWidths:
        """(lower, upper) widths around the central step time at `config`: the measured bound, out to a translation's bracket."""
        measured = self.measured_bound_for(config) if measured is None else measured
        return widened_bounds(measured, self.translation, self.fit["parameters"], config)

    def relative_bound_for(self, config: StepConfig) -> float:
        """The upper bound for one configuration (bounds_for): a translation's at its bracket's upper end."""
        return self.bounds_for(config)[1]

    def measured_bound_for(self, config: StepConfig) -> float:
        """The bound for one configuration: the relative bound, widened past the measured range by what each dimension was
        measured to miss there (docs/design.md#extrapolation-bounds; a fit without that record by the older rule)."""
        bound = self.relative_bound
        stretches = stretch_by_dimension(config, self.ok_rows())
        stretch = max(stretches.values())
        if stretch <= 1.0:
            return bound
        by_dimension = self.fit.get("extrapolation_by_dimension")
        if by_dimension is not None:
            return bound + extrapolation_widening(by_dimension, stretches, UNTESTED_EXTRAPOLATION, bound)
        record = self.fit.get("extrapolated_error")
        if record is not None and not record.get("count"):
            # No held-out probe lay beyond the others: nothing measured how this fit extrapolates.
            base = max(bound, UNTESTED_EXTRAPOLATION)
        else:
            base = max(bound, ((record or {}).get("p90_abs_pct") or 0.0) / 100.0)
        return base * (1 + math.log2(stretch))

    def promised_bound_for(self, config: StepConfig) -> float:
        """The bound a plan promises the deadline: the measured one, or none when too noisy to bound; at a translation's upper end."""
        return self.bounds_for(config, 0.0 if self.too_noisy_to_bound else None)[1]

    def extrapolation_ratio(self, config: StepConfig) -> float:
        """How far `config` lies beyond the measured sizes and tokens per micro-step: the largest ratio past them (1 inside)."""
        return max(stretch_by_dimension(config, self.ok_rows()).values())

    @property
    def too_noisy_to_bound(self) -> bool:
        """The measurements scatter so much that the upper bound means nothing."""
        return self.relative_bound > NOISY_BOUND

    @property
    def step_tail_factor(self) -> float:
        """Mean step / median step over the probes (probes are fitted to their median)."""
        return float(self.fit.get("step_tail_factor") or 1.0)

    def _history_ratios(self) -> list[float]:
        return [
            entry["actual_tokens_per_second"] / entry["predicted_tokens_per_second"]
            for entry in self.history[-HISTORY_WINDOW:]
            if (entry.get("predicted_tokens_per_second") or 0) > 0 and (entry.get("actual_tokens_per_second") or 0) > 0
        ]

    @property
    def history(self) -> list[JsonDict]:
        return cast(list[JsonDict], self.data.get("history", []))

    @property
    def history_factor(self) -> float:
        """Actual/predicted tokens/s of the last runs that used this calibration: their median, shrunk towards 1 by n/(n+1)."""
        ratios = self._history_ratios()
        if not ratios:
            return 1.0
        weight = len(ratios) / (len(ratios) + 1)
        return float(math.exp(weight * median(math.log(r) for r in ratios)))

    # -- predictions ----------------------------------------------------------------------
    def micro_step_seconds(self, config: StepConfig) -> float:
        """Seconds of one micro-step: the fitted median step, scaled to a mean by the tail factor, corrected by past runs."""
        return self.throughput.micro_step_seconds(config) * self.step_tail_factor / self.history_factor

    def predict(self, config: StepConfig, memory_offset_bytes: float = 0.0) -> Prediction:
        """Tokens/second, step seconds and peak memory of one configuration, with their bounds. `memory_offset_bytes`: what the planned run holds beyond
        (negative: short of) the probes, e.g. FSDP shards planned from a 1-process calibration (train.planning.memory_check)."""
        if min(config.micro_batch_size, config.seq_len, config.grad_accum) < 1 or config.num_workers < 0:
            raise BenchtrainError(f"cannot predict for {config.label}: sizes must be positive")
        step = self.micro_step_seconds(config) * config.grad_accum
        tokens_per_second = config.micro_batch_size * config.seq_len * config.grad_accum / step
        lower, bound = self.bounds_for(config)
        peak = peak_high = None
        if self.memory is not None:
            peak = self.memory.peak_bytes(config) + memory_offset_bytes
            peak_high = peak * (1 + self.memory_margin)
        return Prediction(
            tokens_per_second=tokens_per_second,
            tokens_per_second_low=tokens_per_second / (1 + bound),
            tokens_per_second_high=tokens_per_second * (1 + lower),
            step_seconds=step,
            step_seconds_low=step / (1 + lower),
            step_seconds_high=step * (1 + bound),
            peak_memory_bytes=peak,
            peak_memory_bytes_high=peak_high,
            fits_in_memory=self.fits_in_memory(config, memory_offset_bytes),
            within_measured_range=self.within_measured_range(config),
        )

    @property
    def memory_limit_bytes(self) -> float:
        return float(self.hardware.memory_bytes)

    @property
    def memory_margin(self) -> float:
        memory = self.fit.get("memory") or {}
        p90 = (memory.get("held_out_error") or {}).get("p90_abs_pct")
        # Fresh processes peaked this far from the fit (their own baseline counted): the machine's part.
        between_processes = float(self.process_check.get("memory_spread") or 0.0)
        return slice_widening(self.data, max(MIN_MEMORY_MARGIN, (p90 or 0.0) / 100.0) + between_processes, "memory")

    def fits_in_memory(self, config: StepConfig, memory_offset_bytes: float = 0.0) -> bool:
        """No OOM at or below this size (in this or a leaner mode) was seen, and the predicted peak plus margin fits; a run
        that holds less than the probes did (FSDP shards from a 1-process calibration) is judged on the prediction alone."""
        for row in self.measurements if memory_offset_bytes >= 0 else ():
            if row["status"] == "oom" and holds_as_much(config, StepConfig.from_row(row)):
                return False
        if self.memory is None:
            return True
        return (self.memory.peak_bytes(config) + memory_offset_bytes) * (
            1 + self.memory_margin
        ) <= self.memory_limit_bytes

    def within_measured_range(self, config: StepConfig) -> bool:
        ranges = {
            name: self.measured_values(name) for name in ("micro_batch_size", "seq_len", "grad_accum", "num_workers")
        }
        inside = all(values and values[0] <= getattr(config, name) <= values[-1] for name, values in ranges.items())
        return inside and all(
            config.value(dimension.name) in self.measured_values(dimension.name) for dimension in switches()
        )

    # -- words ----------------------------------------------------------------------------
    def explain(self) -> list[str]:
        """The fit in words, one sentence a line."""
        p = self.fit["parameters"]
        error = self.fit.get("held_out_error", {})
        checkpointed = 1 in self.measured_values("gradient_checkpointing")
        lines = [
            f"{_seconds(p['fixed'])} fixed per micro-step, {_seconds(p['per_token'])} per token, "
            f"{_seconds(p['attention'] * 1000)} per 1000 tokens of attention context per token, "
            f"{_seconds(p['optimizer_step'])} per optimizer step.",
            f"Data: {_seconds(p['serial_data'])} per token when the training process builds batches itself "
            f"(0 workers), {_seconds(p['worker_supply'])} per token divided by the workers otherwise, "
            f"{_seconds(p['per_worker'])} per micro-step per worker process (data terms fitted to the measured DataLoader wait).",
        ]
        if checkpointed:
            lines.append(
                f"Gradient checkpointing recomputes for {_seconds(p['recompute_per_token'])} per token and "
                f"{_seconds(p['recompute_attention'] * 1000)} per 1000 tokens of attention context per token."
            )
        if p.get("overlap_power", 1.0) > 1.0:
            lines.append(
                f"Host and device overlap: a micro-step takes about the longer of the fixed {_seconds(p['fixed'])} and the compute "
                f"terms (a smooth maximum of power {p['overlap_power']:.1f}), not their sum."
            )
        lines += [
            f"Model used: {self.fit['kind']} ({self.fit.get('reason', 'no reason recorded')}).",
            f"Held-out tokens/s error over {error.get('count', 0)} probes: median "
            f"{_pct(error.get('median_abs_pct'))}, 90th percentile {_pct(error.get('p90_abs_pct'))}.",
        ]
        memory = self.fit.get("memory")
        if memory:
            m = memory["parameters"]
            memory_error = memory.get("held_out_error", {})
            lines.append(
                f"Memory: {_bytes(m['static'])} static + {_bytes(m['per_token'])} per token "
                f"+ {_bytes(m['attention'] * 1000)} per token per 1000 tokens of length"
                + (
                    f" ({_bytes(m['per_token_checkpointed'])} per token with gradient checkpointing)"
                    if checkpointed
                    else ""
                )
                + (
                    f" + {_bytes(m['accumulated_gradients'])} of gradients held while accumulating"
                    if m.get("accumulated_gradients")
                    else ""
                )
                + (
                    f", and at least {_bytes(m['optimizer_floor'])} (the optimizer step)"
                    if m.get("optimizer_floor")
                    else ""
                )
                + "; held-out error median "
                f"{_pct(memory_error.get('median_abs_pct'))}, 90th percentile {_pct(memory_error.get('p90_abs_pct'))}; "
                f"limit {_bytes(self.memory_limit_bytes)} with a {self.memory_margin:.0%} margin."
            )
        check = self.process_check
        if check.get("speed_ratios"):
            lines.append(
                f"Fresh processes: {check['processes']} measured {len(check['speed_ratios'])} of the probes again, at "
                f"{min(check['speed_ratios']):.3f}–{max(check['speed_ratios']):.3f}× this fit's speed; "
                f"bounds hold ±{check['time_spread']:.0%} between processes in time and +{check.get('memory_spread', 0.0):.0%} in peak memory."
            )
        if self.history:
            lines.append(
                f"Past runs: {len(self.history)} used this calibration; actual/predicted tokens/s of the last "
                f"{min(len(self.history), HISTORY_WINDOW)}: correction factor {self.history_factor:.3f} "
                "(median, shrunk towards 1; applied to new predictions)."
            )
        return lines


def _positive(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


def _scaled(value: float, units: tuple[tuple[str, float], ...]) -> str:
    """`value` in the largest of `units` it reaches (the last, below them all)."""
    unit, scale = next(((unit, scale) for unit, scale in units if abs(value) >= scale), units[-1])
    return f"{value / scale:.3g} {unit}"


def _seconds(value: float) -> str:
    return (
        "0 s" if value == 0 else _scaled(value, (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9), ("ps", 1e-12)))
    )


def _bytes(value: float) -> str:
    return _scaled(value, (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1)))


def _pct(value: float | None) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.1f}%"
