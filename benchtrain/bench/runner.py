"""Run probes over the space (grid or Optuna), within a time budget, pruning past OOMs."""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from benchtrain.bench.choose import ProbePlanner
from benchtrain.bench.cost import CostModel, DeviceSpeed
from benchtrain.bench.disturbed import REFERENCE_EVERY, correct_for_drift, remeasure
from benchtrain.bench.space import SearchSpace
from benchtrain.bench.timing import WELL_TIMED_STEP_SECONDS, ProbeSettings
from benchtrain.calibration.dimensions import DIMENSIONS
from benchtrain.calibration.step_config import Mode, StepConfig
from benchtrain.common.json_types import JsonDict
from benchtrain.common.progress import Bar

ProbeFunction = Callable[[StepConfig, float | None], JsonDict]
# Keep a little of the budget for fitting and writing the calibration.
BUDGET_RESERVE = 0.04
# A drift reference is measured again only while it costs at most this share of the budget.
REFERENCE_MAX_SHARE = 0.03
# Probes of the grid that must have measured the prices before they may stop a benchmark short of
# a minimum viable fit.
PRICE_CONFIRMATIONS = 2


@dataclass
class BenchResult:
    rows: list[JsonDict] = field(default_factory=list)
    left_out: list[dict[str, int]] = field(default_factory=list)
    stopped_by_budget: bool = False
    reused: int = 0  # rows taken from an earlier, interrupted run (optuna)
    drift: JsonDict | None = None
    remeasured: int = 0  # further measurements of disturbed probes
    dropped_modes: list[Mode] = field(default_factory=list)  # modes (switches on) the budget could not reach


class Budget:
    """Seconds left from a start time on a clock (a virtual one in simulations); `None` means
    unbounded. `reserved` is what must be left for the work after the probes (evaluation,
    checkpoint and compile timings, fit and report), re-priced as the probes measure."""

    def __init__(
        self,
        seconds: float | None,
        started: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        reserved: Callable[[], float] = lambda: 0.0,
    ) -> None:
        self.seconds = seconds
        self.clock = clock
        self.started = clock() if started is None else started
        self.reserved = reserved

    def elapsed(self) -> float:
        return self.clock() - self.started

    def left(self) -> float | None:
        """The whole budget's seconds left (the reserve not subtracted)."""
        if self.seconds is None:
            return None
        return self.seconds * (1 - BUDGET_RESERVE) - self.elapsed()

    def remaining(self) -> float | None:
        """Seconds the probes may still spend."""
        left = self.left()
        return None if left is None else left - self.reserved()

    def allows(self, expected_seconds: float) -> bool:
        remaining = self.remaining()
        return remaining is None or remaining >= expected_seconds


def default_planner(space: SearchSpace) -> ProbePlanner:
    """A planner that knows nothing of the model: every probe priced by its tokens until measured."""
    return ProbePlanner(space, CostModel(lambda config: 1.0, DeviceSpeed(1e6, "tokens"), ProbeSettings()))


class Prober:
    """Runs probes and stamps each measurement with its position in the benchmark's sequence
    (references and re-measurements included), which drift correction interpolates over."""

    def __init__(self, probe: ProbeFunction, budget: Budget) -> None:
        self.probe, self.budget, self.count = probe, budget, 0

    def __call__(self, config: StepConfig) -> JsonDict:
        # The probe may spend what the budget has left for probes, and no more.
        row = self.probe(config, self.budget.remaining())
        row["position"] = self.count
        self.count += 1
        return row

    def again(self, row: JsonDict) -> JsonDict:
        return self(StepConfig.from_row(row))


def run_grid(
    space: SearchSpace,
    probe: ProbeFunction,
    budget: Budget,
    progress: Bar | None = None,
    reference_every: int | None = REFERENCE_EVERY,
    planner: ProbePlanner | None = None,
) -> BenchResult:
    """Probe what the fit learns most from per second (bench.choose) while the budget pays for it.
    The first successful probe whose steps time well is the drift reference, measured again every
    `reference_every` probes while that is cheap; budget left over measures disturbed probes again."""
    result = BenchResult()
    planner = planner or default_planner(space)
    prober = Prober(probe, budget)
    reference: StepConfig | None = None
    references: list[tuple[int, float]] = []
    since_reference = 0

    def reference_affordable() -> bool:
        price = planner.price(reference) if reference is not None else math.inf
        share = math.inf if budget.seconds is None else REFERENCE_MAX_SHARE * budget.seconds
        return price <= share and budget.allows(price)

    def measure_reference() -> None:
        nonlocal since_reference
        if reference is None:
            return
        row = prober(reference)
        planner.record(row, repeat=True)
        since_reference = 0
        if row["status"] == "ok":
            references.append((row["position"], row["tokens_per_second"]))

    while (config := planner.next(budget.remaining())) is not None:
        if not planner.viable() and planner.cost.measured:
            result.dropped_modes += planner.settle_for_measured_modes(budget.remaining())
            # Measured prices say no fit can be reached: stop spending, but only on prices the grid's
            # own probes measured twice (one busy moment decides nothing) and once even the cheapest
            # probes no longer fit.
            confirmed = len(result.rows) >= PRICE_CONFIRMATIONS
            if (
                confirmed
                and not planner.viable_within(budget.remaining())
                and not planner.cheap_probes_remain(budget.remaining())
            ):
                break
            config = planner.next(budget.remaining()) or config
        if reference_every and reference is not None and since_reference >= reference_every and reference_affordable():
            measure_reference()
            continue  # prices and time moved: choose again
        row = prober(config)
        planner.record(row)
        result.rows.append(row)
        since_reference += 1
        if (
            reference is None
            and reference_every
            and row["status"] == "ok"
            and row["step_seconds"] >= WELL_TIMED_STEP_SECONDS
        ):
            reference, since_reference = config, 0
            references.append((row["position"], row["tokens_per_second"]))
        _advance(progress, row)
    finish(result, planner, prober, progress)
    if reference is not None and len(references) > 1 and reference_affordable():
        measure_reference()  # closes the last stretch
    if reference_every:
        no_reference: JsonDict = {"reference": None, "measurements": [], "applied": False, "spread_pct": 0.0}
        result.drift = correct_for_drift(result.rows, references, reference) if reference is not None else no_reference
    return result


def finish(result: BenchResult, planner: ProbePlanner, prober: Prober, progress: Bar | None) -> None:
    """What the budget left out, the rows memory ruled out, and the disturbed probes measured again."""
    left = planner.candidates()
    result.stopped_by_budget = bool(left)
    result.left_out = [c.to_row() for c in left]
    result.rows.extend(planner.unprobed_rows())
    result.remeasured = remeasure(
        result.rows, prober.again, lambda row: prober.budget.allows(planner.price(StepConfig.from_row(row))), progress
    )


def _advance(progress: Bar | None, row: JsonDict) -> None:
    if progress is None:
        return
    if row.get("tokens_per_second"):
        progress.set_postfix_str(
            f"B={row['micro_batch_size']} W={row['num_workers']} A={row['grad_accum']} S={row['seq_len']}: {row['tokens_per_second']:,.0f} tok/s",
            refresh=False,
        )
    progress.update(1)


def study_name(hardware: JsonDict, model: JsonDict, space: SearchSpace, data: str | None, setup: str = "") -> str:
    """The optuna study an interrupted bench resumes: same device, model, space, data and setup (what is trained, on which base, with which optimizer)."""
    key = json.dumps(
        [hardware["name"], hardware["count"], model["fingerprint"], space.as_dict(), data, setup], sort_keys=True
    )
    return "bench-" + hashlib.sha256(key.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class OptunaStudy:
    """Where an Optuna search keeps its trials: the SQLite file, the study's name (what an
    interrupted bench resumes, `study_name`) and the TPE sampler's seed."""

    storage_path: Path
    name: str
    seed: int = 0


def run_optuna(
    space: SearchSpace,
    probe: ProbeFunction,
    budget: Budget,
    trials: int,
    study: OptunaStudy,
    progress: Bar | None = None,
    planner: ProbePlanner | None = None,
) -> BenchResult:
    """Sample the same space with Optuna (TPE), maximising tokens/s; an OOM is a failed trial. Each
    finished trial keeps its row in the SQLite study, so an interrupted benchmark resumes without
    repeating them; a trial known, ruled out or too dear is replaced by the planner's choice."""
    import optuna
    from optuna.distributions import BaseDistribution, CategoricalDistribution
    from optuna.trial import TrialState

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study.storage_path.parent.mkdir(parents=True, exist_ok=True)
    optuna_study = optuna.create_study(
        study_name=study.name,
        storage=f"sqlite:///{study.storage_path}",
        load_if_exists=True,
        direction="maximize",
        sampler=optuna.samplers.TPESampler(seed=study.seed),
    )
    distributions: dict[str, BaseDistribution] = {
        dimension: CategoricalDistribution(list(values))
        for dimension, values in zip(DIMENSIONS, space.values(), strict=True)
    }
    done: dict[StepConfig, JsonDict] = {}
    for finished in optuna_study.get_trials(states=(TrialState.COMPLETE, TrialState.FAIL)):
        if "row" in finished.user_attrs:
            done[StepConfig.from_row(finished.params)] = finished.user_attrs["row"]
    result = BenchResult(rows=list(done.values()), reused=len(done))
    planner = planner or default_planner(space)
    for row in result.rows:
        planner.record(row)
        _advance(progress, row)
    prober = Prober(probe, budget)
    target = min(trials, space.size)
    while len(planner.rows) < target:
        trial = optuna_study.ask(distributions)
        config = StepConfig.from_row(trial.params)
        if config in planner.rows or config not in planner.candidates() or not budget.allows(planner.price(config)):
            # Known, ruled out or too dear: tell Optuna what it was, and steer the next trial.
            known = planner.rows.get(config)
            if known is not None and known["status"] == "ok":
                optuna_study.tell(trial, known["tokens_per_second"])
            else:
                optuna_study.tell(trial, state=TrialState.FAIL)
            choice = planner.next(budget.remaining())
            if choice is None:
                break
            optuna_study.enqueue_trial(choice.to_row())
            continue
        try:
            row = prober(config)
        except BaseException:
            optuna_study.tell(trial, state=TrialState.FAIL)
            raise
        trial.set_user_attr("row", row)
        if row["status"] == "ok":
            optuna_study.tell(trial, row["tokens_per_second"])
        else:
            optuna_study.tell(trial, state=TrialState.FAIL)
        planner.record(row)
        result.rows.append(row)
        _advance(progress, row)
    finish(result, planner, prober, progress)
    result.stopped_by_budget = result.stopped_by_budget and len(planner.rows) < target
    return result
