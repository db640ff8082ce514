"""The task that rents the machine a dry run chose and runs the plan on it, engine-neutral (its targets and
fallbacks, uploads, disk, spot, maximum duration); train.launch_command renders it. Computation only.
What it holds and why: docs/design.md#the-launch-task."""

from __future__ import annotations

import hashlib
import math
import re
import secrets
import time
from dataclasses import dataclass, field, replace
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING

from benchtrain.calibration.datasheets import SHEETS_BY_KEY, rented_together
from benchtrain.calibration.hardware import Hardware
from benchtrain.calibration.hub import hub_reference
from benchtrain.calibration.store import is_bundled
from benchtrain.calibration.topology import parse_interconnect
from benchtrain.common.durations import format_duration
from benchtrain.common.errors import BenchtrainError
from benchtrain.train.planning.rental import (
    GB,
    DiskSize,
    Duration,
    ShutdownGrace,
    Spot,
    max_duration,
    node_disk,
    shutdown_grace,
    spot_choice,
)
from benchtrain.train.recipes.machines import SETTLE_SECONDS, Option, Row, calibration_row, device_key, plan_of
from benchtrain.train.running.resume import without_options

if TYPE_CHECKING:
    from benchtrain.calibration.model import Calibration
    from benchtrain.train.planning.types import Candidate, Plan
    from benchtrain.train.recipes.config import TrainConfig
    from benchtrain.train.recipes.machines import Comparison
    from benchtrain.train.recipes.run_plan import RunPlan
    from benchtrain.train.workload.method import MethodConfig
    from benchtrain.train.workload.model import ModelSpec

MASTER_PORT = 29500  # torchrun's rendezvous port on the first node

# Where things are on every node.
ROOT = "/benchtrain"
RUN_DIR = f"{ROOT}/run"  # the run folder: a bucket mounted on every node, so a restarted task finds its checkpoints
CALIBRATIONS_DIR = f"{ROOT}/calibrations"  # the calibrations the targets rest on, uploaded
HOME_DIR = (
    f"{RUN_DIR}/home"  # BENCHTRAIN_HOME: beside the run, so a calibration measured first is there after a restart
)

# A task's name, and its run folder's bucket or volume (the name + RUN_SUFFIX): valid as an S3 and GCS bucket (3-63 of a-z,
# 0-9 and hyphens, beginning and ending with a letter or digit, no "goog") and as a dstack resource (^[a-z][a-z0-9-]{1,40}$).
NAME_PREFIX = "bt"
RUN_SUFFIX = "-run"
LONGEST_NAME = 41 - len(RUN_SUFFIX)
MODEL_PART = 12  # of the model's name, in the task's name
# Engine-side secrets a node gets when the run reads the hub (a gated model, --push-to-hub): named, never valued here.
HUB_TOKEN = "HF_TOKEN"

# Options of the dry run that the task's train command does not take: the comparison's, the emit's, the run folder.
DROPPED_WITH_VALUE = ("--use-calibration", "--consider", "--emit", "--out", "--device-memory")
DROPPED_FLAGS = ("--dry-run", "--json", "--for-trainer")
# Options naming local files or folders, which every node must see.
PATH_OPTIONS = ("--data", "--eval-data", "--tokenizer", "--model", "--price-per-hour")


@dataclass(frozen=True)
class CardBench:
    """Another card the engines rent under a target's accelerator name, and the bench run that measures it there."""

    card: str  # its datasheet key
    arguments: tuple[str, ...]  # bench's


@dataclass(frozen=True)
class Target:
    """One machine the task may run on: the planned row it launches (its machine, plan, price, and what its figures rest on
    and what would settle them), where its processes go, and the calibration its nodes plan from."""

    row: Row
    device_key: str  # a datasheet key (calibration.datasheets), or "cpu"
    accelerator: str | None  # the engines' name for it; None: CPU only
    nodes: int
    gpus_per_node: int  # processes per node (CPU: 1)
    calibration: str | None  # --use-calibration on the node; None: the one `settle` measures
    calibration_file: Path | None  # a local calibration file uploaded to CALIBRATIONS_DIR
    # The other cards the engines rent under its accelerator name (an H100 SXM row may get a PCIe or NVL), each with the
    # bench run that measures it first: train accepts a calibration of its own card only.
    card_benches: tuple[CardBench, ...] = ()

    @property
    def machine(self) -> str:
        """2×H100 SXM over nvlink: a row of `--consider`'s machine, else the calibration's device × its processes."""
        machine = self.row.source.machine
        return machine.label if machine is not None else f"{self.row.processes}×{self.row.device.name}"

    @property
    def option(self) -> Option:
        """What plans the row: its calibration, processes and sharding (none | ddp | fsdp)."""
        assert self.row.source.option is not None  # a target is made of a planned row only
        return self.row.source.option

    @property
    def chosen(self) -> Candidate:
        """The planned step (micro-batch × accumulation, workers, length), its steps and its seconds."""
        return plan_of(self.row).chosen

    @property
    def grace(self) -> ShutdownGrace:
        """How long its processes get from SIGTERM to SIGKILL to save and export (train.planning.rental.shutdown_grace)."""
        return shutdown_grace(self.chosen)

    @property
    def cost_upper(self) -> float | None:
        """What the target costs at most: a machine's at the upper end of its bracket, a calibration's at its estimate."""
        bracket = self.row.cost_bracket
        return bracket.upper if self.row.source.machine is not None and bracket else plan_of(self.row).cost


@dataclass(frozen=True)
class Upload:
    """A local file or folder every node sees at `remote` (SkyPilot file_mounts, dstack files)."""

    local: Path
    remote: str
    what: str  # --data, a calibration, …


@dataclass(frozen=True)
class LaunchTask:
    name: str
    targets: list[Target]  # the recommended one first
    left_out: list[str]  # rows not offered as fallbacks, and why
    train_arguments: list[str]  # the train command's own options, paths as the nodes see them
    uploads: list[Upload]
    disk: DiskSize
    spot: Spot
    duration: Duration
    deadline_seconds: float
    version: str
    model: str
    notes: list[str] = field(default_factory=list)
    secrets: tuple[str, ...] = ()  # environment variables the engine passes from the launching machine (never written)

    @property
    def storage(self) -> str:
        """The run folder's bucket (SkyPilot) or volume (dstack): this task's own, so no other task finds its run.json."""
        return f"{self.name}{RUN_SUFFIX}"

    @property
    def nodes(self) -> int:
        return self.targets[0].nodes

    @property
    def engine_stop_seconds(self) -> int:
        """The engine's wait from its stop to its kill (dstack's stop_duration): the longest of the targets' graces, and
        a second more, so torchrun's own kill of its workers comes first."""
        return max(target.grace.seconds for target in self.targets) + 1

    @property
    def disk_gb(self) -> int:
        return max(1, math.ceil(self.disk.total_bytes / GB))

    def train_command(self, target: Target, measured: bool = True) -> list[str]:
        """`train` as the nodes run it for `target` (under torchrun: train.launch_command); not `measured`: on another card
        rented under its name, planned from the calibration that card's bench stored (`latest` prefers this card's)."""
        calibration = (target.calibration if measured else None) or "latest"
        sharding = ["--sharding", target.option.sharding] if target.option.sharding == "fsdp" else []
        return [
            *self.train_arguments,
            "--use-calibration",
            calibration,
            *sharding,
            "--resume",
            "auto",
            "--out",
            RUN_DIR,
        ]


# -- the targets -----------------------------------------------------------------------------


def rows_to_targets(comparison: Comparison) -> tuple[list[Target], list[str]]:
    """The recommended row and those meeting the deadline at their upper end on as many nodes (an engine sets the node count
    once per task); the others, and why they were left out."""
    best = comparison.recommended
    if best is None:
        raise BenchtrainError(
            "--emit: no row meets the deadline at its upper end, so there is no machine to launch: a longer --deadline or other machines"
        )
    first = row_target(best)
    targets, left_out = [first], []
    for row in comparison.rows[1:]:
        name = row.source.machine.label if row.source.machine is not None else row.reference
        if row.run_plan is None:
            left_out.append(f"{name}: no plan ({row.problem})")
        elif not row.run_plan.plan.meets_deadline:
            left_out.append(f"{name}: misses the deadline at its upper end")
        else:
            target = row_target(row)
            if target.nodes != first.nodes:
                left_out.append(f"{name}: {target.nodes} node(s), the task has {first.nodes}")
            elif target.accelerator is None and first.accelerator is not None:
                left_out.append(f"{name}: a CPU, the task rents GPUs")
            else:
                targets.append(target)
    return targets, left_out


def row_target(row: Row) -> Target:
    """A planned row (of a comparison, or a single calibration's plan) as a target."""
    option = row.source.option
    assert row.run_plan is not None and option is not None
    cal = option.calibration
    key = device_key(cal) or "cpu"
    interconnect = option.interconnect or row.device.interconnect
    nodes, per_node = layout(row.processes, interconnect if isinstance(interconnect, str) else None)
    measured = row.settle is None  # a row nobody measured carries the bench run that measures it first
    file = calibration_file(cal) if measured else None  # uploaded, and named as the nodes see it
    calibration = (f"{CALIBRATIONS_DIR}/{file.name}" if file is not None else row.reference) if measured else None
    return Target(
        row=row,
        device_key=key,
        accelerator=accelerator_of(key, row.device),
        nodes=nodes,
        gpus_per_node=per_node,
        calibration=calibration,
        calibration_file=file,
    )


def layout(processes: int, interconnect: str | None) -> tuple[int, int]:
    """(nodes, processes per node): as the interconnect places them (2x8:nvlink+ib), else one node."""
    if interconnect:
        placed = parse_interconnect(interconnect).placed(processes)
        if placed.nodes and placed.gpus_per_node:
            return placed.nodes, placed.gpus_per_node
    return 1, processes


def accelerator_of(key: str, device: Hardware) -> str | None:
    """The engines' accelerator name; None for a CPU. A GPU they cannot name cannot be rented: one line."""
    if key == "cpu" and device.device_type != "cuda":
        return None
    sheet = SHEETS_BY_KEY.get(key)  # every datasheet row has its launch name
    if sheet is None:
        raise BenchtrainError(
            f"--emit: {device.name or key} has no accelerator name the engines know, so the task cannot rent it: plan another machine"
        )
    return sheet.launch_name


def calibration_file(cal: Calibration) -> Path | None:
    """A local calibration the nodes cannot fetch themselves (not bundled, not on the hub): uploaded."""
    return (
        None
        if cal.path is None or is_bundled(cal.path) or hub_reference(cal.data) is not None
        else Path(cal.path).resolve()
    )


# -- the command the nodes run -----------------------------------------------------------------


def node_arguments(command_line: list[str], cwd: Path) -> tuple[list[str], list[Upload]]:
    """The dry run's options as the nodes' train command takes them (the task adds its own calibration, resume and run
    folder), and the local files they name, uploaded to the same absolute path."""
    kept: list[str] = []
    uploads: list[Upload] = []
    tokens = iter(without_options(command_line, (*DROPPED_FLAGS, "--resume"), DROPPED_WITH_VALUE))
    for token in tokens:
        name, equals, inline = token.partition("=")
        value = (inline if equals else next(tokens, None)) if name in PATH_OPTIONS else None
        if value is None:
            kept.append(token)
            continue
        value, upload = node_path(name, value, cwd)
        uploads += [upload] if upload is not None else []
        kept += [name, value]
    return kept, uploads


def node_path(option: str, value: str, cwd: Path) -> tuple[str, Upload | None]:
    """A path option's value as the nodes see it: a local file or folder uploaded to the same absolute path; anything else (a
    preset, a hub id, a price) as given. A relative local path: one line (the task does not sync the working folder)."""
    path = Path(value).expanduser()
    if not path.is_absolute():
        if (cwd / path).exists():
            raise BenchtrainError(
                f"--emit: {option} {value} is a relative local path no node can see: give it as an absolute path "
                f"({(cwd / path).resolve()}), which the task uploads to every node, or put it on the hub"
            )
        return value, None
    if not path.exists():
        raise BenchtrainError(
            f"--emit: {option} {value} does not exist here, so no node can see it: name a file that exists, or a hub id"
        )
    return str(path), Upload(path, str(path), option)


def size_of(path: Path) -> int:
    return (
        path.stat().st_size
        if path.is_file()
        else sum(item.stat().st_size for item in path.rglob("*") if item.is_file())
    )


def benchtrain_version() -> str:
    try:
        return version("benchtrain")
    except PackageNotFoundError:
        return "0.1.0"


def name_part(text: str, longest: int) -> str:
    """`text` as lowercase letters, digits and single hyphens, at most `longest` characters, no "goog" (GCS refuses it)."""
    word = re.sub(r"-+", "-", "".join(char if char.isalnum() and char.isascii() else "-" for char in text.lower()))
    return word.replace("goog", "gg")[:longest].strip("-")


def data_tag(reference: str) -> str:
    """A short fingerprint of the data a task trains on: its reference, and for a local file its size, time and first MiB
    (reading a large file whole would slow every dry run)."""
    digest = hashlib.sha256(reference.encode())
    path = Path(reference).expanduser()
    if path.is_file():
        stat = path.stat()
        digest.update(f"{stat.st_size}:{stat.st_mtime_ns}".encode())
        with open(path, "rb") as handle:
            digest.update(handle.read(1 << 20))
    return digest.hexdigest()[:4]


def task_name(model: str, data: str, started: float, random_part: str | None = None) -> str:
    """The task's name, per plan: the model, the data's fingerprint, when its deadline started (UTC, to the minute) and a
    random part (a bucket name is global across a cloud's users). Two tasks never share a run folder."""
    model_part = name_part(model, MODEL_PART) or "model"
    stamp = time.strftime("%y%m%d%H%M", time.gmtime(started))
    random_part = random_part or secrets.token_hex(2)
    return f"{NAME_PREFIX}-{model_part}-{data_tag(data)}-{stamp}-{random_part}"[:LONGEST_NAME].strip("-")


def with_card_benches(target: Target, model: str, method: MethodConfig) -> Target:
    """`target` with a bench run for each other card rented under its name: a row nobody measured, its own bench on that
    card; a measured row, the bench its calibration's setup would need there."""
    if target.accelerator is None:
        return target
    others = [key for key in rented_together(target.accelerator) if key != target.device_key]
    words = list(target.row.settle_arguments)
    if not words:
        processes = target.nodes * target.gpus_per_node
        link = ["--interconnect", target.option.interconnect] if processes > 1 and target.option.interconnect else []
        lora = ["--lora"] if method.is_lora else []
        words = ["run", "--gpu", target.device_key, "--model", model, *lora, *link]
        words += ["--budget", format_duration(SETTLE_SECONDS)]
    where = words.index("--gpu") + 1
    benches = tuple(CardBench(key, (*words[:where], key, *words[where + 1 :])) for key in others)
    return replace(target, card_benches=benches)


def launch_task(
    targets: list[Target],
    left_out: list[str],
    plan: Plan,
    available_seconds: float,
    config: TrainConfig,
    spec: ModelSpec,
    method: MethodConfig,
    command_line: list[str],
) -> LaunchTask:
    """The task: its targets (the recommended first), the train command and its uploads, disk, spot (judged on the recommended `plan`) and maximum duration."""
    arguments, uploads = node_arguments(command_line, Path.cwd())
    targets = [with_card_benches(target, config.model, method) for target in targets]
    for target in targets:
        if target.calibration_file is not None:
            uploads.append(
                Upload(
                    target.calibration_file,
                    f"{CALIBRATIONS_DIR}/{target.calibration_file.name}",
                    f"the calibration of {target.machine}",
                )
            )
    first = targets[0]
    device_type = "cpu" if first.accelerator is None else "cuda"
    uploaded = sum(size_of(upload.local) for upload in uploads)
    disk = node_disk(spec, method, config.output.merge_lora, config.guard.keep_checkpoints, device_type, uploaded)
    spot = spot_choice(plan, available_seconds, config.guard.checkpoint_interval_seconds)
    settle = max((target.row.settle_seconds for target in targets), default=0.0)
    if any(target.card_benches for target in targets):  # a node on another card under the same name measures it first
        settle = max(settle, SETTLE_SECONDS)
    duration = max_duration(first.chosen.total_seconds_promised + settle, spot, config.run_deadline.deadline_seconds)
    name = task_name(spec.name, config.data.data, time.time())
    notes = []
    if any(target.row.settle for target in targets):
        notes.append(
            "a target nobody measured runs its `bench run` first (its figures are predicted or translated until then)"
        )
    deadline = config.run_deadline.deadline_seconds
    # A gated model or a push to the hub needs the user's token on every node: the engine passes it from the launching machine.
    hub_secrets = (HUB_TOKEN,) if spec.hub is not None or config.output.push_to_hub else ()
    return LaunchTask(
        name,
        targets,
        left_out,
        arguments,
        uploads,
        disk,
        spot,
        duration,
        deadline,
        benchtrain_version(),
        spec.name,
        notes,
        hub_secrets,
    )


def comparison_task(
    comparison: Comparison, config: TrainConfig, spec: ModelSpec, method: MethodConfig, command_line: list[str]
) -> LaunchTask:
    """The task of `--consider` or a comparison of calibrations: the recommended row and its fallbacks."""
    targets, left_out = rows_to_targets(comparison)
    best = comparison.recommended
    assert best is not None and best.run_plan is not None  # rows_to_targets: one line otherwise
    return launch_task(
        targets, left_out, best.run_plan.plan, comparison.available_seconds, config, spec, method, command_line
    )


def plan_task(run: RunPlan, config: TrainConfig, spec: ModelSpec, command_line: list[str]) -> LaunchTask:
    """The task of a single calibration's dry run: that plan on the machine (processes, interconnect) the calibration recorded."""
    if not run.plan.meets_deadline:
        raise BenchtrainError(
            "--emit: the plan misses the deadline at its upper end, so there is nothing to launch: a longer --deadline or another machine"
        )
    row = calibration_row(run)
    return launch_task(
        [row_target(row)], [], run.plan, run.plan.available_seconds, config, spec, run.fitted.method, command_line
    )
