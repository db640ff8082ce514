"""Which probe next: the one the fit learns most from per second of budget, within memory and budget.
The rule and why: docs/design.md#bench-choose
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import numpy as np

from benchtrain.bench.cost import CostModel, MemoryPrior
from benchtrain.bench.space import SearchSpace, Shape, ruled_out_by, shape_of
from benchtrain.calibration.fit import MIN_ROWS_FOR_FIT, throughput_features
from benchtrain.calibration.step_config import Mode, StepConfig
from benchtrain.common.json_types import JsonDict

# A probe is not run when its predicted peak × (1 + this) passes the device's memory.
MEMORY_HEADROOM = 0.05
# Sizes grow step by step: a probe holds at most this many times the tokens of the largest
# micro-batch that ran (memory and prices are extrapolated no further than that).
GROWTH = 4
RIDGE = 1e-3
# A host with this many cores or fewer runs the minimum viable fit without DataLoader workers.
FEW_CORES = 2
# Bench gives up on a minimum viable fit only when what is left cannot pay for the probes it still
# needs at the cheapest price measured, times this: prices measured on a disturbed machine (or once)
# are not trusted to rule everything out while a few cheap probes would settle it.
GIVE_UP_MARGIN = 1.0


@dataclass
class ProbePlanner:
    space: SearchSpace
    cost: CostModel
    memory: MemoryPrior | None = None
    memory_limit_bytes: float | None = None
    rows: dict[StepConfig, JsonDict] = field(default_factory=dict)
    oom: list[StepConfig] = field(default_factory=list)
    seen_shapes: set[Shape] = field(default_factory=set)
    # Modes (switches on: checkpointing) the minimum no longer waits for: the budget could not reach them.
    dropped_modes: set[Mode] = field(default_factory=set)
    host_cores: int | None = None  # the host's CPU cores (None: not known, workers as any other dimension)

    def record(self, row: JsonDict, repeat: bool = False) -> None:
        """A probe's row (first measurement or a repeat): prices and memory learn from it."""
        config = StepConfig.from_row(row)
        if not repeat:
            self.rows[config] = row
        if row.get("status") == "oom":
            self.oom.append(config)
        if row.get("probe_seconds") is not None:
            self.seen_shapes.add(shape_of(config))
        self.cost.observe(row)
        if self.memory is not None:
            self.memory.observe(row)

    def ok_rows(self) -> list[JsonDict]:
        return [row for row in self.rows.values() if row.get("status") == "ok"]

    def price(self, config: StepConfig) -> float:
        return self.cost.probe_seconds(config, shape_of(config) not in self.seen_shapes)

    def predicted_peak(self, config: StepConfig) -> float | None:
        return self.memory.peak_bytes(config) if self.memory is not None else None

    def over_memory(self, config: StepConfig) -> bool:
        peak = self.predicted_peak(config)
        return (
            peak is not None
            and self.memory_limit_bytes is not None
            and peak * (1 + MEMORY_HEADROOM) > self.memory_limit_bytes
        )

    def candidates(self) -> list[StepConfig]:
        """Not yet probed, not ruled out by an OOM, not predicted past the device's memory."""
        return [
            c
            for c in self.space.all_configs()
            if c not in self.rows and ruled_out_by(c, self.oom) is None and not self.over_memory(c)
        ]

    def unprobed_rows(self) -> list[JsonDict]:
        """Rows for what was not probed because of memory: ruled out by an OOM, or predicted over."""
        rows = []
        for config in self.space.all_configs():
            if config in self.rows:
                continue
            cause = ruled_out_by(config, self.oom)
            if cause is not None:
                error = f"skipped: batch {cause.micro_batch_size} at length {cause.seq_len} ran out of memory"
            elif self.over_memory(config):
                peak = self.predicted_peak(config) or 0.0
                error = f"skipped: predicted peak {peak / 2**30:.1f} GiB passes the device's {(self.memory_limit_bytes or 0) / 2**30:.1f} GiB"
            else:
                continue
            rows.append({**config.to_row(), "status": "skipped", "error": error})
        return rows

    def viable(self) -> bool:
        """A minimum viable fit: enough successful probes, every mode (checkpointing off, on) covered."""
        return len(self.ok_rows()) >= MIN_ROWS_FOR_FIT and not self._missing_modes()

    def _missing_modes(self) -> set[Mode]:
        return (
            set(self.space.modes()) - self.dropped_modes - {StepConfig.from_row(row).switches for row in self.ok_rows()}
        )

    def still_needed(self) -> int:
        """Successful probes a minimum viable fit still needs."""
        return max(MIN_ROWS_FOR_FIT - len(self.ok_rows()), len(self._missing_modes()), 1)

    def cheap_probes_remain(self, remaining: float | None) -> bool:
        """Whether `remaining` seconds still pay for the probes the minimum needs at the cheapest
        price of any candidate: then bench keeps measuring (each probe measures the prices again)
        instead of giving up on prices that a busy moment may have inflated."""
        pool = self.candidates()
        if remaining is None or not pool:
            return remaining is None and bool(pool)
        return remaining >= GIVE_UP_MARGIN * self.still_needed() * min(self.price(c) for c in pool)

    def settle_for_measured_modes(self, remaining: float | None) -> list[Mode]:
        """When the budget cannot reach a minimum fit with every checkpointing mode but can with
        the modes already measured, the minimum stops waiting for the others (a calibration of
        one mode plans that mode; better than none). Returns the modes dropped."""
        missing = self._missing_modes()
        if self.viable() or not missing or missing == set(self.space.modes()) or self.viable_within(remaining):
            return []
        self.dropped_modes |= missing
        if self.viable_within(remaining):
            return sorted(missing)
        self.dropped_modes -= missing
        return []

    def next(self, remaining: float | None) -> StepConfig | None:
        """The next probe to run with `remaining` seconds of budget (None: unbounded), or None."""
        pool = self.candidates()
        if not pool:
            return None
        if not self.viable() and self.host_cores is not None and self.host_cores <= FEW_CORES:
            fewest = min(c.num_workers for c in pool)  # a worker would compete with the step for a core
            pool = [c for c in pool if c.num_workers == fewest]
        largest = max((c.micro_batch_size * c.seq_len for c in map(StepConfig.from_row, self.ok_rows())), default=None)
        if largest is not None:
            pool = [c for c in pool if c.micro_batch_size * c.seq_len <= GROWTH * largest] or pool
        prices = {c: self.price(c) for c in pool}
        affordable = [c for c in pool if remaining is None or prices[c] <= remaining]
        if not affordable:
            return None
        if not self.viable():
            missing = self._missing_modes()
            still_needed = self.still_needed()
            if missing and len(self.ok_rows()) + len(missing) >= MIN_ROWS_FOR_FIT:
                affordable = [c for c in affordable if c.switches in missing] or affordable
            # Leave room for the rest of the minimum: prefer probes a share of what is left pays.
            if remaining is not None:
                affordable = [c for c in affordable if prices[c] <= remaining / still_needed] or affordable
        gains = self._gains(affordable)
        relevance = self._relevance(affordable) if self.viable() else dict.fromkeys(affordable, 1.0)
        return max(affordable, key=lambda c: (gains[c] * relevance[c] / max(prices[c], 1e-9), -prices[c], c))

    def _gains(self, configs: list[StepConfig]) -> dict[StepConfig, float]:
        everything = self.space.all_configs()
        # Seconds per √token at the scale of the measured steps (the prior's before any): once, the same for every feature.
        largest = max(everything, key=lambda c: c.micro_batch_size * c.seq_len)
        curvature = (
            self.cost.step_seconds(largest) / largest.grad_accum / math.sqrt(largest.micro_batch_size * largest.seq_len)
        )
        scale = np.maximum(np.abs(np.stack([self._feature(c, curvature) for c in everything])).max(axis=0), 1e-30)
        information = RIDGE * np.eye(len(scale))
        for row in self.ok_rows():
            z = self._feature(StepConfig.from_row(row), curvature) / scale
            information += np.outer(z, z)
        inverse = np.linalg.inv(information)
        gains = {}
        for config in configs:
            z = self._feature(config, curvature) / scale
            gains[config] = math.log1p(float(z @ inverse @ z))
        return gains

    def _feature(self, config: StepConfig, curvature: float) -> np.ndarray:
        """The throughput model's features on relative error, plus √tokens × `curvature` (why: docs/design.md#bench-choose)."""
        micro = max(self.cost.step_seconds(config) / config.grad_accum, 1e-12)
        tokens = config.micro_batch_size * config.seq_len
        return np.append(throughput_features(config), math.sqrt(tokens) * curvature) / micro

    def _relevance(self, configs: list[StepConfig]) -> dict[StepConfig, float]:
        tokens = {c: c.micro_batch_size * c.seq_len for c in configs}
        largest = max(tokens.values())
        return {c: 1.0 + tokens[c] / largest for c in configs}

    def preview(self, seconds: float | None, stop_when_viable: bool = False) -> list[tuple[StepConfig, float]]:
        """The probes this planner would run in `seconds` at today's prices, with each price: a
        dry run of the choice that assumes every probe succeeds as predicted."""
        return self._dry_run(seconds, stop_when_viable)[0]

    def viable_within(self, seconds: float | None) -> bool:
        """Whether a minimum viable fit can still be completed in `seconds` at today's prices."""
        return self._dry_run(seconds, True)[1].viable()

    def _dry_run(
        self, seconds: float | None, stop_when_viable: bool
    ) -> tuple[list[tuple[StepConfig, float]], ProbePlanner]:
        planner = copy.deepcopy(self)
        chosen: list[tuple[StepConfig, float]] = []
        left = seconds
        while not (stop_when_viable and planner.viable()):
            config = planner.next(left)
            if config is None:
                break
            price = planner.price(config)
            chosen.append((config, price))
            left = None if left is None else left - price
            planner.rows[config] = {**config.to_row(), "status": "ok"}
            planner.seen_shapes.add(shape_of(config))
        return chosen, planner
