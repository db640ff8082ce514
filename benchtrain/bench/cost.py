"""A probe's price (seconds, peak memory) before it runs, prior first, then measured.
The model and why: docs/design.md#bench-cost
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from benchtrain.bench.timing import ProbeSettings, min_timed_steps, steps_needed
from benchtrain.calibration.fit_tools import fit_nonnegative
from benchtrain.calibration.memory_fit import fit_memory
from benchtrain.calibration.step_config import Mode, StepConfig
from benchtrain.common.json_types import JsonDict

if TYPE_CHECKING:
    from benchtrain.calibration.memory_fit import MemoryModel

# The share of the device's peak a training step is assumed to reach before anything is measured:
# low on purpose (a probe priced too high is only ordered late; one priced too low overruns).
PRIOR_EFFICIENCY = 0.25
# A compiled step's first run of a new shape, before the first one is measured (torch.compile of a
# decoder block: tens of seconds); only orders and prices the first compiled probe.
COMPILE_PRIOR_SECONDS = 30.0
# Predictions are priced at least this much above the fit (a cost under-estimate overruns).
MIN_COST_MARGIN = 0.10


@dataclass(frozen=True)
class DeviceSpeed:
    """FLOP/s a training step is assumed to reach before it is measured, and where that came from."""

    flops_per_second: float
    source: str


def device_speed(hardware: JsonDict) -> DeviceSpeed:
    """The datasheet's dense bf16 peak (GPUs in the table), else a timed matmul on the device, times PRIOR_EFFICIENCY."""
    peak = hardware.get("peak_bf16_flops")
    if peak:
        return DeviceSpeed(
            peak * PRIOR_EFFICIENCY,
            f"{hardware.get('peak_flops_entry') or hardware['name']} peak × {PRIOR_EFFICIENCY:.0%}",
        )
    measured = matmul_flops(hardware["device_type"])
    return DeviceSpeed(
        measured * PRIOR_EFFICIENCY, f"a timed matmul ({measured / 1e9:,.0f} GFLOP/s) × {PRIOR_EFFICIENCY:.0%}"
    )


def matmul_flops(device_type: str, seconds: float = 0.3) -> float:
    """FLOP/s of square matmuls on the device, timed for about `seconds` (fp32 on a CPU, bf16 on a GPU)."""
    import torch

    cuda = device_type == "cuda"
    size = 4096 if cuda else 512
    dtype = torch.bfloat16 if cuda else torch.float32
    device = torch.device("cuda" if cuda else "cpu")
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    (a @ b).sum().item()  # warm-up, and a synchronisation
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        c = a @ b
        count += 1
    c.sum().item()
    return 2 * size**3 * count / (time.perf_counter() - started)


@dataclass
class Observation:
    config: StepConfig
    step_seconds: float | None
    first_step_seconds: float | None
    warmup_steps: int
    probe_seconds: float
    timed_seconds: float
    spread: float | None
    new_shape: bool


@dataclass
class CostModel:
    """Prices probes: the FLOPs prior until measured, then the measurements."""

    flops_per_token: Callable[[StepConfig], float]
    speed: DeviceSpeed
    settings: ProbeSettings
    compiled: bool = False
    observations: list[Observation] = field(default_factory=list)
    compile_prior_seconds: float = (
        COMPILE_PRIOR_SECONDS  # a new shape's compilation until measured (or as an earlier depth measured it)
    )
    _fit: tuple[float, float, float] | None = None  # fixed seconds, seconds per FLOP, relative margin

    def observe(self, row: JsonDict) -> None:
        """Learn from a probe's row (any status: an OOM's seconds are a cost too)."""
        if not row.get("probe_seconds"):
            return
        step = row.get("step_seconds") if row.get("status") == "ok" else None
        timed = (row.get("step_seconds_mean") or step or 0.0) * int(row.get("timed_steps") or 0)
        self.observations.append(
            Observation(
                StepConfig.from_row(row),
                step,
                row.get("first_step_seconds"),
                int(row.get("warmup_steps") or 0),
                float(row["probe_seconds"]),
                timed,
                row.get("step_seconds_spread"),
                bool(row.get("new_shape", True)),
            )
        )
        self._fit = self._fit_steps()

    @property
    def measured(self) -> bool:
        return self._fit is not None

    @property
    def source(self) -> str:
        return "measured" if self.measured else f"prior: FLOPs ÷ {self.speed.source}"

    def step_flops(self, config: StepConfig) -> float:
        return self.flops_per_token(config) * config.micro_batch_size * config.seq_len * config.grad_accum

    def step_seconds(self, config: StepConfig) -> float:
        if self._fit is None:
            return self.step_flops(config) / self.speed.flops_per_second
        fixed, per_flop, _ = self._fit
        return fixed * config.grad_accum + per_flop * self.step_flops(config)

    def step_seconds_high(self, config: StepConfig) -> float:
        """The price a budget decision uses: the estimate plus what the fit has missed so far."""
        margin = self._fit[2] if self._fit is not None else 0.0
        return self.step_seconds(config) * (1 + max(MIN_COST_MARGIN, margin))

    def first_step_extra(self, new_shape: bool) -> float:
        """What a probe's first step costs beyond a steady one: a compilation for a new shape of a compiled step, else allocation and DataLoader start."""
        extras = [
            (o.new_shape, max(0.0, o.first_step_seconds - o.step_seconds))
            for o in self.observations
            if o.step_seconds and o.first_step_seconds is not None
        ]
        same = [extra for shape, extra in extras if shape == new_shape]
        if same:
            return max(same) if new_shape and self.compiled else statistics.median(same)
        if self.compiled:
            # Unmeasured: a new shape compiles (the prior); a repeated one pays what the step's
            # own warm-up costs, which the probes of new shapes cannot tell apart from compiling.
            return self.compile_prior_seconds if new_shape else 0.0
        return statistics.median(extra for _, extra in extras) if extras else 0.0

    def start_seconds(self, config: StepConfig) -> float:
        """Seconds a probe spends outside its steps (loader and worker start-up, teardown), from probes with as many workers (or any, else none)."""

        def outside(o: Observation) -> float:
            steps = (
                (o.first_step_seconds or 0.0) + max(0, o.warmup_steps - 1) * (o.step_seconds or 0.0) + o.timed_seconds
            )
            return max(0.0, o.probe_seconds - steps)

        alike = [
            outside(o)
            for o in self.observations
            if o.step_seconds and (o.config.num_workers > 0) == (config.num_workers > 0)
        ]
        return statistics.median(alike) if alike else 0.0

    def timed_steps(self, config: StepConfig) -> int:
        """Timed steps expected: what the spread seen so far needs, within the probe's time share."""
        step = self.step_seconds(config)
        spreads = [o.spread for o in self.observations if o.spread is not None]
        wanted = steps_needed(statistics.median(spreads), self.settings) if spreads else self.settings.min_steps
        within_share = max(min_timed_steps(step, self.settings), math.ceil(self.settings.max_seconds / max(step, 1e-9)))
        return max(min_timed_steps(step, self.settings), min(wanted, within_share, self.settings.max_steps))

    def probe_seconds(self, config: StepConfig, new_shape: bool) -> float:
        """The whole probe, priced high (bench.runner never starts one it cannot afford)."""
        step = self.step_seconds_high(config)
        steps = self.settings.warmup_steps + self.timed_steps(config)
        return self.start_seconds(config) + self.first_step_extra(new_shape) + steps * step

    def _fit_steps(self) -> tuple[float, float, float] | None:
        # One point per step size (FLOPs, accumulation): the fastest measured. A busy moment only
        # ever slows a step, so a size measured again at the quiet speed replaces the disturbed price.
        fastest: dict[tuple[float, int], float] = {}
        for o in self.observations:
            if o.step_seconds:
                key = (self.step_flops(o.config), o.config.grad_accum)
                fastest[key] = min(fastest.get(key, math.inf), o.step_seconds)
        if not fastest:
            return None
        flops = np.array([key[0] for key in fastest])
        seconds = np.array(list(fastest.values()))
        accums = np.array([key[1] for key in fastest], dtype=float)
        if len({round(f / a) for f, a in zip(flops, accums, strict=True)}) < 2:
            # One size: the prior's shape, scaled to what it measured.
            per_flop = float(np.median(seconds / flops))
            fixed = 0.0
        else:
            fixed, per_flop = fit_nonnegative(np.stack([accums, flops], axis=1), seconds)
        predicted = fixed * accums + per_flop * flops
        margin = float(np.max(np.abs(predicted - seconds) / seconds))
        return float(fixed), float(per_flop), margin


@dataclass
class MemoryPrior:
    """A probe's peak memory before the memory fit exists: the bytes the model keeps (exact, from the
    `meta` device) plus activations per token (Korthikanti et al. 2022), rescaled to the probes once they measure it."""

    static_bytes: float
    accumulated_gradient_bytes: float
    layers: int
    hidden: int
    compute_bytes: int  # 2 (bf16 on CUDA) or 4 (fp32 on CPU)
    observations: list[tuple[StepConfig, float]] = field(default_factory=list)
    _cache: dict[tuple[Mode, bool, int], tuple[float, float, MemoryModel]] = field(default_factory=dict)

    def prior_per_token(self, checkpointing: bool) -> float:
        scale = self.compute_bytes / 2
        if checkpointing:
            return (self.layers * self.hidden * 2 + 34 * self.hidden) * scale
        return 34 * self.layers * self.hidden * scale

    def accumulating(self, config: StepConfig) -> float:
        return self.accumulated_gradient_bytes if config.grad_accum > 1 else 0.0

    def observe(self, row: JsonDict) -> None:
        if row.get("status") == "ok" and row.get("peak_memory_bytes"):
            self.observations.append((StepConfig.from_row(row), float(row["peak_memory_bytes"])))

    def per_token_bytes(self, config: StepConfig) -> float:
        """Bytes per token in flight: from the probes of this mode (switches on: (peak − what the
        model keeps) ÷ tokens: the static part is exact, so anything else it holds only raises the
        figure), else the prior scaled as the other modes' probes scaled theirs (never down)."""
        per_token = [
            (c, (peak - self.static_bytes - self.accumulating(c)) / (c.micro_batch_size * c.seq_len))
            for c, peak in self.observations
        ]
        own = [value for c, value in per_token if c.switches == config.switches]
        if own:
            return max(max(own), 0.0)
        other = [value / self.prior_per_token(c.gradient_checkpointing) for c, value in per_token]
        ratio = max(other) if other else 1.0
        return self.prior_per_token(config.gradient_checkpointing) * max(1.0, ratio)

    def peak_bytes(self, config: StepConfig) -> float:
        """What the model keeps + tokens × bytes per token (+ accumulation's gradients). With two
        sizes of this mode measured, the larger of that line fitted to them and the calibration's
        linear memory model (whose attention term may read the same growth kinder)."""
        same = [(c, peak) for c, peak in self.observations if c.switches == config.switches]
        tokens = config.micro_batch_size * config.seq_len
        unseen = config.grad_accum > 1 and not any(c.grad_accum > 1 for c, _ in same)
        if len({c.micro_batch_size * c.seq_len for c, _ in same}) < 2:
            return self.static_bytes + self.accumulating(config) + tokens * self.per_token_bytes(config)
        intercept, slope, model = self._fits(config.switches, unseen)
        by_tokens = intercept + max(0.0, slope) * tokens + (self.accumulating(config) if config.grad_accum > 1 else 0.0)
        fitted = model.peak_bytes(config) + (self.accumulating(config) if unseen else 0.0)
        return float(max(by_tokens, fitted))

    def _fits(self, mode: Mode, unseen: bool) -> tuple[float, float, MemoryModel]:
        """(intercept, bytes per token, linear memory model) of this mode's probes; refitted only
        when a probe was added (the planner asks for every configuration, every choice)."""
        key = (mode, unseen, len(self.observations))
        if key not in self._cache:
            same = [(c, peak) for c, peak in self.observations if c.switches == mode]
            counts = np.array([float(c.micro_batch_size * c.seq_len) for c, _ in same])
            peaks = np.array([peak - (0.0 if unseen else self.accumulating(c)) for c, peak in same])
            slope, intercept = np.polyfit(counts, peaks, 1)
            model = fit_memory([c for c, _ in same], np.array([peak for _, peak in same]))
            self._cache[key] = (float(intercept), float(slope), model)
        return self._cache[key]
