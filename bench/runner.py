"""Run probes over the space (grid or Optuna), within a time budget, pruning past OOMs."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.drift import REFERENCE_EVERY, correct_for_drift, reference_config
from bench.remeasure import remeasure
from bench.space import DIMENSIONS, ProbeConfig, SearchSpace, budget_order, ruled_out_by

ProbeFunction = Callable[[ProbeConfig, float | None], dict[str, Any]]
# Keep a little of the budget for fitting and writing the calibration.
BUDGET_RESERVE = 0.04


@dataclass
class BenchResult:
    rows: list[dict[str, Any]] = field(default_factory=list)
    left_out: list[dict[str, int]] = field(default_factory=list)
    stopped_by_budget: bool = False
    reused: int = 0  # rows taken from an earlier, interrupted run (optuna)
    drift: dict[str, Any] | None = None
    remeasured: int = 0  # further measurements of disturbed probes


class Budget:
    """Seconds left from a start time; `None` means unbounded."""

    def __init__(self, seconds: float | None, started: float | None = None) -> None:
        self.seconds = seconds
        self.started = time.monotonic() if started is None else started

    def remaining(self) -> float | None:
        if self.seconds is None:
            return None
        return self.seconds * (1 - BUDGET_RESERVE) - (time.monotonic() - self.started)

    def allows(self, expected_seconds: float) -> bool:
        remaining = self.remaining()
        return remaining is None or remaining >= expected_seconds


def _expected_probe_seconds(rows: list[dict[str, Any]]) -> float:
    durations = [row["probe_seconds"] for row in rows if row.get("probe_seconds")]
    return sum(durations) / len(durations) if durations else 0.0


def _skipped_row(config: ProbeConfig, cause: ProbeConfig) -> dict[str, Any]:
    return {
        **config.as_dict(),
        "status": "skipped",
        "error": f"skipped: batch {cause.micro_batch_size} at length {cause.seq_len} ran out of memory",
    }


class Prober:
    """Runs probes and stamps each measurement with its position in the benchmark's sequence
    (references and re-measurements included), which drift correction interpolates over."""

    def __init__(self, probe: ProbeFunction, budget: Budget) -> None:
        self.probe, self.budget, self.count = probe, budget, 0

    def __call__(self, config: ProbeConfig) -> dict[str, Any]:
        row = self.probe(config, self.budget.remaining())
        row["position"] = self.count
        self.count += 1
        return row

    def again(self, row: dict[str, Any]) -> dict[str, Any]:
        return self(ProbeConfig.of(row))


def run_grid(space: SearchSpace, probe: ProbeFunction, budget: Budget, progress: Any = None, reference_every: int | None = REFERENCE_EVERY) -> BenchResult:
    """Probe in budget order, skipping what an OOM rules out; every `reference_every` probes the
    reference configuration runs again so that machine drift can be corrected afterwards. Budget
    left over goes to measuring disturbed probes again."""
    result = BenchResult()
    order = budget_order(space)
    oom: list[ProbeConfig] = []
    reference = reference_config(space)
    references: list[tuple[int, float]] = []
    since_reference = reference_every or 0
    prober = Prober(probe, budget)

    failed_reference: dict[str, Any] = {}
    tracking = bool(reference_every)

    def measure_reference() -> None:
        nonlocal reference_every
        row = prober(reference)
        if row["status"] == "ok":
            references.append((row["position"], row["tokens_per_second"]))
        else:
            # No drift correction then; the failure is the reference's own row when its turn comes.
            failed_reference.update(row)
            reference_every = None
            if row["status"] == "oom":
                oom.append(reference)

    for index, config in enumerate(order):
        if config == reference and failed_reference:
            result.rows.append(dict(failed_reference))
            _advance(progress, result.rows[-1])
            continue
        cause = ruled_out_by(config, oom)
        if cause is not None:
            result.rows.append(_skipped_row(config, cause))
            _advance(progress, result.rows[-1])
            continue
        if not budget.allows(_expected_probe_seconds(result.rows)):
            result.stopped_by_budget = True
            result.left_out = [c.as_dict() for c in order[index:] if ruled_out_by(c, oom) is None]
            break
        if reference_every and since_reference >= reference_every:
            measure_reference()
            since_reference = 0
        row = prober(config)
        since_reference += 1
        result.rows.append(row)
        if row["status"] == "oom":
            oom.append(config)
        _advance(progress, row)
    result.remeasured = remeasure(result.rows, prober.again, lambda: budget.allows(2 * _expected_probe_seconds(result.rows)), progress)
    if reference_every and references and budget.allows(_expected_probe_seconds(result.rows)):
        measure_reference()  # closes the last stretch
    if tracking:
        result.drift = correct_for_drift(result.rows, references, reference)
    return result


def _advance(progress: Any, row: dict[str, Any]) -> None:
    if progress is None:
        return
    if row.get("tokens_per_second"):
        progress.set_postfix_str(
            f"B={row['micro_batch_size']} W={row['num_workers']} A={row['grad_accum']} S={row['seq_len']}: {row['tokens_per_second']:,.0f} tok/s",
            refresh=False,
        )
    progress.update(1)


def study_name(hardware: dict[str, Any], model: dict[str, Any], space: SearchSpace, data: str | None) -> str:
    key = json.dumps([hardware["name"], hardware["count"], model["fingerprint"], space.as_dict(), data], sort_keys=True)
    return "bench-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def run_optuna(
    space: SearchSpace,
    probe: ProbeFunction,
    budget: Budget,
    trials: int,
    storage_path: Path,
    name: str,
    progress: Any = None,
    seed: int = 0,
) -> BenchResult:
    """Sample the same space with Optuna (TPE), maximising tokens/s; an OOM is a failed trial.

    The study lives in SQLite, and each finished trial keeps its measurement row, so a
    benchmark that was interrupted resumes without repeating finished probes.
    """
    import optuna
    from optuna.distributions import CategoricalDistribution
    from optuna.trial import TrialState

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage_path.parent.mkdir(parents=True, exist_ok=True)
    study = optuna.create_study(
        study_name=name,
        storage=f"sqlite:///{storage_path}",
        load_if_exists=True,
        direction="maximize",
        sampler=optuna.samplers.TPESampler(seed=seed),
    )
    distributions = {dimension: CategoricalDistribution(list(values)) for dimension, values in zip(DIMENSIONS, space.values(), strict=True)}
    done: dict[ProbeConfig, dict[str, Any]] = {}
    for trial in study.get_trials(states=(TrialState.COMPLETE, TrialState.FAIL)):
        if "row" in trial.user_attrs:
            done[ProbeConfig(**{k: int(v) for k, v in trial.params.items()})] = trial.user_attrs["row"]
    result = BenchResult(rows=list(done.values()), reused=len(done))
    prober = Prober(probe, budget)
    for row in result.rows:
        _advance(progress, row)
    oom = [config for config, row in done.items() if row["status"] == "oom"]
    target = min(trials, space.size)
    fallback = [config for config in budget_order(space) if config not in done]
    while len(done) < target:
        if not budget.allows(_expected_probe_seconds(result.rows[result.reused :])):
            result.stopped_by_budget = True
            break
        trial = study.ask(distributions)
        config = ProbeConfig(**{k: int(trial.params[k]) for k in distributions})
        cause = ruled_out_by(config, oom)
        if config in done or cause is not None:
            # Already known: tell Optuna what it was, and steer the next trial to a new point.
            known = done.get(config)
            if known is not None and known["status"] == "ok":
                study.tell(trial, known["tokens_per_second"])
            else:
                study.tell(trial, state=TrialState.FAIL)
            if cause is not None and config not in done:
                done[config] = _skipped_row(config, cause)
                result.rows.append(done[config])
                _advance(progress, done[config])
            next_new = next((c for c in fallback if c not in done and ruled_out_by(c, oom) is None), None)
            if next_new is None:
                break
            study.enqueue_trial(next_new.as_dict())
            continue
        try:
            row = prober(config)
        except BaseException:
            study.tell(trial, state=TrialState.FAIL)
            raise
        trial.set_user_attr("row", row)
        if row["status"] == "ok":
            study.tell(trial, row["tokens_per_second"])
        else:
            study.tell(trial, state=TrialState.FAIL)
            if row["status"] == "oom":
                oom.append(config)
        done[config] = row
        result.rows.append(row)
        _advance(progress, row)
    fresh = result.rows[result.reused :]
    result.remeasured = remeasure(result.rows, prober.again, lambda: budget.allows(2 * _expected_probe_seconds(fresh)), progress)
    if result.stopped_by_budget or len(done) < space.size:
        result.left_out = [c.as_dict() for c in budget_order(space) if c not in done]
    return result
