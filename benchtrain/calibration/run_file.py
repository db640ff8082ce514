"""run.json, read and written here only: `RunFile` is the document, `ResumedRun` what a resume reads of
it, typed, and the words a run's status holds. Docs: docs/design.md#runjson"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Final, TypeAlias, cast

from benchtrain.calibration.adapters import trains_adapters
from benchtrain.calibration.dimensions import switches
from benchtrain.calibration.step_config import StepConfig
from benchtrain.common.atomic import write_json_atomic
from benchtrain.common.errors import RunFileError

JsonValue: TypeAlias = "bool | int | float | str | list[JsonValue] | dict[str, JsonValue] | None"
JsonObject: TypeAlias = dict[str, JsonValue]
# What a section may be set to: the same values, held in any list or dict the code built (read-only
# containers are covariant, so a list[dict[str, float]] is one; JsonValue's list is not).
JsonIn: TypeAlias = "bool | int | float | str | Sequence[JsonIn] | Mapping[str, JsonIn] | None"

RUN_SCHEMA_VERSION = 1

# How a run ended: the words run.json's `actual.status` (and its top-level `status`) hold, which
# people's scripts read; the guard and the loop use these, never spell one. A new way to end is a new word.
COMPLETED: Final = "completed"  # every planned step ran
STEP_LIMIT: Final = "step_limit"  # stopped at a step limit: --max-steps, --fit-deadline, or the guard's shrink
STOPPED_FOR_DEADLINE: Final = "stopped_for_deadline"  # the deadline guard stopped it at the last safe moment
INTERRUPTED: Final = "interrupted"  # SIGINT or SIGTERM
# Runs that stopped before their planned end, from a checkpoint they can resume: their final/ is marked partial, and the end of the run says how to resume it.
STOPPED_EARLY: Final = (STOPPED_FOR_DEADLINE, INTERRUPTED)

# What a run does after its plan, in the order it does it: run.json's `phases` holds those this command planned and
# those that ended, so a restart after a preemption does what is left (train.running.resume.what_to_continue). A
# phase ends when what it wrote is complete on disk: the steps with their last checkpoint (the final evaluation in
# it, or done again from it), the export with final/ and its section, the push with its section, the report with it.
STEPS: Final = "steps"
EVALUATION: Final = "evaluation"
EXPORT: Final = "export"
PUSH: Final = "push"
REPORT: Final = "report"
PHASES: Final = (STEPS, EVALUATION, EXPORT, PUSH, REPORT)


def step_columns(config: StepConfig, world_size: int) -> JsonObject:
    """The step configuration as a plan's candidate is written, flat (a dry run's JSON, run.json's
    alternatives; the plan and `chosen` of a run.json from before `configuration`), its length as max_length."""
    columns: JsonObject = {
        "micro_batch_size": config.micro_batch_size,
        "grad_accum": config.grad_accum,
        "num_workers": config.num_workers,
    }
    columns.update(max_length=config.seq_len, world_size=world_size)
    return columns | {dimension.name: config.on(dimension.name) for dimension in switches()}


def flat_keys() -> tuple[str, ...]:
    """step_columns' keys."""
    return tuple(step_columns(StepConfig(1, 0, 1, 1), 1))


class _Reader:
    """Typed reads of one JSON object of one file: a missing key or another type is one line."""

    def __init__(self, source: str, where: str, values: Mapping[str, JsonValue]) -> None:
        self.source, self.where, self.values = source, where, values

    def _name(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def _fail(self, key: str, expected: str) -> RunFileError:
        value = self.values.get(key)
        found = "missing" if key not in self.values else f"{type(value).__name__} {value!r}"[:60]
        return RunFileError(f"run file {self.source}: {self._name(key)} should be {expected}, found {found}")

    def _typed(self, key: str, kinds: tuple[type, ...], expected: str, required: bool) -> JsonValue:
        """The value (None: absent or null, which only a required key refuses)."""
        value = self.values.get(key)
        if value is None:
            if required:
                raise self._fail(key, expected)
            return None
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            raise self._fail(key, expected)
        return value

    def text(self, key: str, default: str | None = None, required: bool = False) -> str | None:
        value = self._typed(key, (str,), "a string", required)
        return value if isinstance(value, str) else default

    def integer(self, key: str, default: int | None = None, required: bool = False) -> int | None:
        value = self._typed(key, (int,), "an integer", required)
        return int(value) if isinstance(value, int) else default

    def number(self, key: str, default: float | None = None, required: bool = False) -> float | None:
        value = self._typed(key, (int, float), "a number", required)
        return float(value) if isinstance(value, (int, float)) else default

    def flag(self, key: str) -> bool:
        return bool(self._typed(key, (bool, int), "true or false", False))

    def texts(self, key: str) -> tuple[str, ...] | None:
        value = self._typed(key, (list,), "a list of strings", False)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise self._fail(key, "a list of strings")
        return tuple(str(item) for item in value)

    def section(self, key: str, required: bool = False) -> _Reader:
        value = self._typed(key, (dict,), "an object", required)
        return _Reader(self.source, self._name(key), value if isinstance(value, dict) else {})

    def object(self, key: str) -> JsonObject | None:
        value = self._typed(key, (dict,), "an object", False)
        return value if isinstance(value, dict) else None


def _configuration(plan: _Reader) -> StepConfig:
    """The plan's step configuration: its `configuration` row (written with StepConfig.to_row); a
    run.json from before that row holds the flat keys, its length as max_length."""
    row = plan.section("configuration") if "configuration" in plan.values else plan
    return StepConfig(
        micro_batch_size=row.integer("micro_batch_size", required=True) or 0,
        num_workers=row.integer("num_workers", required=True) or 0,
        grad_accum=row.integer("grad_accum", required=True) or 0,
        seq_len=(row.integer("seq_len", required=True) if row is not plan else row.integer("max_length", 0)) or 0,
        switches=tuple(dimension.name for dimension in switches() if row.flag(dimension.name)),
    )


def run_configuration(plan: Mapping[str, JsonValue], source: str = "run.json") -> StepConfig:
    """The step configuration a run.json's plan section records (either form)."""
    return _configuration(_Reader(source, "plan", plan))


@dataclass
class RunFile:
    """run.json as a document: `configuration` and `world_size` (first in the plan), `estimate_check` (its error written
    twice), and every other section as written, in the file's order; `run_id` and the plan checked on read."""

    run_id: str
    configuration: StepConfig
    world_size: int
    sections: JsonObject = field(default_factory=dict)  # the rest, in order; plan and chosen without the step columns
    source: str = "run.json"  # the path errors name

    # -- read -------------------------------------------------------------------------------
    @classmethod
    def read(cls, path: Path) -> RunFile:
        try:
            document = json.loads(path.read_text())
        except OSError as error:
            raise RunFileError(f"cannot read run file {path}: {error.strerror or error}") from None
        except ValueError as error:
            raise RunFileError(f"run file {path} is not valid JSON ({error})") from None
        if not isinstance(document, dict):
            raise RunFileError(f"run file {path}: expected a JSON object, got {type(document).__name__}")
        return cls.from_json(document, str(path))

    @classmethod
    def from_json(cls, document: JsonObject, source: str = "run.json") -> RunFile:
        """The document as read (or built): the configuration, an older file's flat step columns in the plan and `chosen`,
        and `estimate_error_pct` are taken out, to be written from the one value again."""
        top = _Reader(source, "", document)
        run_id = top.text("run_id", required=True) or ""
        plan = top.section("plan", required=True)
        configuration = _configuration(plan)
        world_size = plan.integer("world_size", 1) or 1
        sections: JsonObject = {}
        for key, value in document.items():
            if key in ("plan", "chosen") and isinstance(value, dict):
                sections[key] = {
                    name: item for name, item in value.items() if name not in ("configuration", *flat_keys())
                }
            elif not (key == "estimate_error_pct" and "estimate_check" in document):
                sections[key] = value
        return cls(run_id, configuration, world_size, sections, source)

    def resumed(self) -> ResumedRun:
        """What a resume reads of this run, typed and checked (one line naming the key)."""
        return ResumedRun.of(self.to_json(), self.source)

    # -- write ------------------------------------------------------------------------------
    def to_json(self) -> JsonObject:
        """The document as run.json holds it, every repeated value written from its one source."""
        document: JsonObject = {}
        for key, value in self.sections.items():
            if key == "run_id":
                document[key] = self.run_id
            elif key == "plan" and isinstance(value, dict):
                document[key] = {
                    "configuration": dict(self.configuration.to_row()),
                    "world_size": self.world_size,
                    **value,
                }
            else:
                document[key] = value
            if key == "estimate_check":
                document["estimate_error_pct"] = value.get("error_pct") if isinstance(value, dict) else None
        return document

    def write(self, out_dir: Path) -> Path:
        path = out_dir / "run.json"
        write_json_atomic(path, self.to_json())
        return path

    # -- sections ---------------------------------------------------------------------------
    def get(self, key: str) -> JsonValue:
        return self.sections.get(key)

    def update(self, **values: JsonIn) -> None:
        """Top-level sections set (a new one goes last): the code's records of what happened, JSON by construction."""
        # Held as given, not copied: the cast only says JsonIn's containers are JSON's.
        self.sections.update(cast(JsonObject, values))

    @property
    def plan(self) -> JsonObject:
        """The plan section as written (a copy: set it with update_plan)."""
        plan = self.to_json()["plan"]
        return plan if isinstance(plan, dict) else {}

    def update_plan(self, **values: JsonIn) -> None:
        """Plan keys set; its step configuration is `configuration` (set that)."""
        held = self.sections.get("plan")
        assert isinstance(held, dict)
        held.update(
            cast(
                JsonObject, {key: value for key, value in values.items() if key not in ("configuration", *flat_keys())}
            )
        )

    @property
    def status(self) -> str | None:
        return _Reader(self.source, "", self.sections).text("status")

    @property
    def total_steps(self) -> int:
        return _total_steps(_Reader(self.source, "plan", self.plan))

    @property
    def learning_rate(self) -> float:
        return _Reader(self.source, "plan", self.plan).number("learning_rate", required=True) or 0.0

    @property
    def elapsed_before_plan(self) -> float:
        return _Reader(self.source, "", self.sections).number("elapsed_before_plan", 0.0) or 0.0

    @property
    def events(self) -> list[str]:
        return list(_Reader(self.source, "", self.sections).texts("events") or ())

    @property
    def push_status(self) -> str | None:
        return _Reader(self.source, "", self.sections).section("push").text("status")

    @property
    def phases_done(self) -> tuple[str, ...]:
        return phases_of(self.sections).done

    def plan_phases(self, planned: Sequence[str], done: Sequence[str] = ()) -> None:
        """`phases`: what this command will do (PHASES, in their order) and what of it already ended."""
        self.update(phases={"planned": list(planned), "done": [phase for phase in planned if phase in done]})

    def end_phase(self, phase: str) -> None:
        """`phase` ended (written with the section it wrote, by the caller's next write)."""
        phases = phases_of(self.sections)
        if phase not in phases.done:
            self.plan_phases(phases.planned, (*phases.done, phase))


@dataclass(frozen=True)
class RunPhases:
    """run.json's `phases`: those its last command planned and those that ended, in PHASES' order."""

    planned: tuple[str, ...] = ()
    done: tuple[str, ...] = ()

    @property
    def left(self) -> tuple[str, ...]:
        return tuple(phase for phase in self.planned if phase not in self.done)


def phases_of(document: Mapping[str, JsonValue], source: str = "run.json") -> RunPhases:
    """The `phases` a run.json holds (one from before them: none planned, none left)."""
    phases = _Reader(source, "", document).section("phases")
    return RunPhases(phases.texts("planned") or (), phases.texts("done") or ())


def _total_steps(plan: _Reader) -> int:
    """The run's optimizer steps as its first plan set them (a run.json from before `total_steps`: its plan's step limit, else its steps)."""
    total = plan.integer("total_steps")
    if total:
        return total
    steps, limit = plan.integer("optimizer_steps", required=True) or 0, plan.integer("step_limit")
    return min(steps, limit) if limit else steps


@dataclass(frozen=True)
class RunMethod:
    """The method as run.json's plan records it (train.running.resume.resumed_method makes it a MethodConfig)."""

    method: str = "full"
    optimizer: str = "adamw"
    lora_rank: int = 0
    lora_alpha: float = 0.0
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] | None = None
    quantize: str = "none"

    @property
    def adapters(self) -> bool:
        """Trains adapters (LoRA or a method of its family): its settings are the `lora_*` fields."""
        return trains_adapters(self.method)


def _method(plan: _Reader) -> RunMethod:
    lora = plan.section("lora")
    method = plan.text("method", "full") or "full"
    adapters = trains_adapters(method)  # their settings under `lora`
    return RunMethod(
        method=method,
        optimizer=plan.text("optimizer", "adamw") or "adamw",
        lora_rank=(lora.integer("rank", required=True) or 0) if adapters else 0,
        lora_alpha=(lora.number("alpha", required=True) or 0.0) if adapters else 0.0,
        lora_dropout=lora.number("dropout", 0.0) or 0.0,
        lora_targets=lora.texts("targets") or None,
        quantize=lora.text("quantize", "none") or "none",
    )


@dataclass(frozen=True)
class RunData:
    """What a resume compares of the run's data (train.running.resume.check_same_data)."""

    source: str | None = None
    fingerprint: str | None = None
    preparation_key: str | None = None
    count: int | None = None
    total_tokens: int | None = None


@dataclass(frozen=True)
class ResumedRun:
    """What resuming a run reads of its run.json, checked once on read."""

    run_id: str
    status: str | None
    model_name: str | None
    model_fingerprint: str | None
    model_revision: str | None  # the hub commit it trained
    method: RunMethod
    configuration: StepConfig  # the same batches in the same order
    max_length: int  # as the plan recorded it
    epochs: float
    total_steps: int  # its learning-rate schedule's horizon, fixed at its first plan
    base_learning_rate: float | None
    hyperparameters: JsonObject | None  # under HF's names (train.step.hyperparameters.settings_from)
    calibration_id: str | None
    calibration_path: str | None
    sharding: str
    data: RunData
    model_weights: str | None = None  # which base weights it trained on (train.workload.model.weights_identity)

    @classmethod
    def of(cls, document: JsonObject, source: str) -> ResumedRun:
        top = _Reader(source, "", document)
        plan, model, data = top.section("plan", required=True), top.section("model"), top.section("data")
        configuration = _configuration(plan)
        method = _method(plan)
        profile = data.section("profile")
        return cls(
            run_id=top.text("run_id", required=True) or "",
            status=top.text("status"),
            model_name=model.text("name"),
            model_fingerprint=model.text("fingerprint"),
            model_revision=model.text("revision"),
            model_weights=model.text("weights"),
            method=method,
            configuration=configuration,
            max_length=plan.integer("max_length", configuration.seq_len) or configuration.seq_len,
            epochs=plan.number("epochs", required=True) or 0.0,
            total_steps=_total_steps(plan),
            base_learning_rate=plan.number("base_learning_rate"),
            hyperparameters=top.object("hyperparameters"),
            calibration_id=top.text("calibration_id"),
            calibration_path=top.text("calibration_path"),
            sharding=plan.text("sharding", "none") or "none",
            data=RunData(
                data.text("source"),
                data.text("fingerprint"),
                data.section("preparation").text("key"),
                profile.integer("count"),
                profile.integer("total_tokens"),
            ),
        )

    def with_length(self, max_length: int | None) -> ResumedRun:
        """--force with --max-length N: the run's configuration trained at length N (check_same_run)."""
        if not max_length:
            return self

        return replace(
            self, configuration=self.configuration.with_shape(self.configuration.micro_batch_size, max_length)
        )
