"""`train --dry-run --emit skypilot:FILE|dstack:FILE|slurm:FILE`: the launch task (train.recipes.launch_task) as the
engine's YAML (SLURM's sbatch script: train.launch_slurm), with comments saying where each figure came from, written
atomically. The run script: docs/design.md#the-engines-files."""

from __future__ import annotations

import shlex
from dataclasses import replace

import yaml

from benchtrain.common.atomic import write_text_atomic
from benchtrain.common.console import say
from benchtrain.common.durations import format_duration
from benchtrain.common.errors import BenchtrainError
from benchtrain.common.json_types import JsonDict
from benchtrain.train.launch_slurm import slurm_body, slurm_comments, slurm_targets
from benchtrain.train.package_wheel import build_wheel, wheel_name
from benchtrain.train.recipes.config import parse_emit
from benchtrain.train.recipes.launch_task import HOME_DIR, MASTER_PORT, ROOT, RUN_DIR, LaunchTask, Target, Upload

NODE_VARIABLES = {
    "skypilot": (
        "# SkyPilot's node variables (set on every node of the task).",
        'MASTER_ADDR=$(echo "$SKYPILOT_NODE_IPS" | head -n1)',
        'NODES="$SKYPILOT_NUM_NODES"',
        'NODE_RANK="$SKYPILOT_NODE_RANK"',
        'GPUS_PER_NODE="$SKYPILOT_NUM_GPUS_PER_NODE"',
    ),
    "dstack": (
        "# dstack's node variables (set on every node of the task).",
        'MASTER_ADDR="$DSTACK_MASTER_NODE_IP"',
        'NODES="$DSTACK_NODES_NUM"',
        'NODE_RANK="$DSTACK_NODE_RANK"',
        'GPUS_PER_NODE="$DSTACK_GPUS_PER_NODE"',
    ),
    "slurm": (
        "# SLURM's node variables (srun sets them in every task; MASTER_ADDR: the batch script's first node).",
        'MASTER_ADDR="$MASTER_ADDR"',
        'NODES="$SLURM_NNODES"',
        'NODE_RANK="$SLURM_NODEID"',
        'GPUS_PER_NODE="${SLURM_GPUS_ON_NODE:-0}"',
    ),
}
# The datasheet key of the device a node got (calibration.datasheets), or cpu.
DETECT_DEVICE = (
    "python -c 'import torch; from benchtrain.calibration.datasheets import sheet_for; "
    'sheet = sheet_for(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else None; print(sheet.key if sheet else "cpu")\''
)


def shell_word(word: str) -> str:
    """A word of the run script: a path under the task's root through $ROOT (the mounts' root)."""
    if word == ROOT or word.startswith(ROOT + "/"):
        return '"$ROOT"' + (shlex.quote(word[len(ROOT) :]) if word != ROOT else "")
    return shlex.quote(word)


def one_line(text: str) -> str:
    """A comment line of the run script or the task as one line: what it names comes partly from a calibration (a
    shared one's device name, where it rests on), and a line break there (one YAML reads as such: \\r, \\x85,
    \\u2028 too) would end the comment and make the rest of the value code that bash or the engine runs."""
    return " ".join(text.splitlines())


def shell_array(name: str, words: list[str]) -> str:
    return f"{name}=({' '.join(shell_word(word) for word in words)})"


def target_lines(task: LaunchTask, target: Target, card: str | None = None) -> list[str]:
    """A target's settings in the run script: its processes per node, train's options and the bench run it needs first;
    on `card` (another card rented under its name), that card's own bench, and train planned from what it measured."""
    row, chosen = target.row, target.chosen
    key = card or target.device_key
    benches = {bench.card: bench.arguments for bench in target.card_benches}
    bench = benches[card] if card is not None else row.settle_arguments
    source = f"{figure_source(target)}; rests on {row.rests_on}" if card is None else f"measured first here, on {card}"
    lines = [
        one_line(
            f"# {target.machine}: {chosen.config.phrase}, {target.option.sharding} sharding, "
            f"{chosen.optimizer_steps:,} optimizer steps ({source})"
        ),
        f"PER_NODE={target.gpus_per_node}",
        f"GRACE={target.grace.seconds}  # seconds from SIGTERM to SIGKILL: {target.grace.basis}",
        shell_array("TRAIN", task.train_command(target, measured=card is None)),
    ]
    # A card nobody measured is measured here first, once per card: a task recovered onto another card benches that one
    # even where the run (its run.json) is already there.
    lines.append(shell_array("BENCH", list(bench)))
    lines.append(f'MEASURED="$BENCHTRAIN_HOME"/{shlex.quote(f"measured-{key}-{target.gpus_per_node}")}')
    return lines


def case_pattern(key: str, target: Target) -> str:
    """A card's branch of the device case: its datasheet key with the target's GPUs per node."""
    return f"{key}:{target.gpus_per_node}"


def run_script(task: LaunchTask, engine: str) -> str:
    """The script every node runs: the engine's node variables, the target's settings, torchrun with --resume auto."""
    lines = [
        "set -eu",
        *NODE_VARIABLES[engine],
        "ROOT=${BENCHTRAIN_TASK_ROOT:-" + ROOT + "}  # the mounts' root: the run folder, the calibrations",
        "# BENCHTRAIN_HOME beside the run folder, on the bucket: a calibration measured first is there after a restart.",
        f"export BENCHTRAIN_HOME={shell_word(HOME_DIR)}",
        'mkdir -p "$BENCHTRAIN_HOME"',
    ]
    if len(task.targets) == 1 and not task.targets[0].card_benches:
        lines += target_lines(task, task.targets[0])
    else:
        lines += [
            f"DEVICE=$({DETECT_DEVICE})",
            "# The machine the engine found among the fallbacks, and the plan made for it.",
        ]
        lines.append('case "$DEVICE:$GPUS_PER_NODE" in')
        # Each target on its own card first, then the other cards rented under a target's name, each its own bench.
        branches: list[tuple[str, Target, str | None]] = [
            (case_pattern(target.device_key, target), target, None) for target in task.targets
        ]
        branches += [
            (case_pattern(bench.card, target), target, bench.card)
            for target in task.targets
            for bench in target.card_benches
        ]
        seen: set[str] = set()
        for pattern, target, card in branches:
            if pattern in seen:
                continue
            seen.add(pattern)
            lines.append(f"  {pattern})")
            lines += [f"    {line}" for line in target_lines(task, target, card)]
            lines.append("    ;;")
        planned = ", ".join(sorted(seen, key=[pattern for pattern, _, _ in branches].index))
        lines += [
            "  *)",
            f'    echo "benchtrain: this task was planned for {planned} (device:GPUs per node), not $DEVICE:$GPUS_PER_NODE" >&2',
            "    exit 2",
            "    ;;",
            "esac",
        ]
    lines += [
        "# torchrun gives its workers GRACE seconds after a SIGTERM (its default is 30) to save a checkpoint and export.",
        'LAUNCH=(python -m torch.distributed.run --nnodes "$NODES" --node_rank "$NODE_RANK" --nproc_per_node "$PER_NODE" '
        f'--master_addr "$MASTER_ADDR" --master_port "${{BENCHTRAIN_MASTER_PORT:-{MASTER_PORT}}}" --shutdown-timeout "$GRACE")',
        'if [ ${#BENCH[@]} -gt 0 ] && [ ! -f "$MEASURED" ]; then',
        '  "${LAUNCH[@]}" -m benchtrain.bench "${BENCH[@]}"',
        '  touch "$MEASURED"',
        "fi",
        "# --resume auto: a restarted task continues from the run's last complete checkpoint; the deadline stays the first start's.",
    ]
    # SkyPilot has no maximum duration of its own: SIGTERM makes train save a checkpoint and stop; the kill comes a
    # second after torchrun's own, so torchrun ends its workers itself.
    if engine == "skypilot":
        lines.append(
            f'exec timeout --signal=TERM --kill-after=$((GRACE + 1)) {int(task.duration.seconds)} "${{LAUNCH[@]}}" -m benchtrain.train "${{TRAIN[@]}}"'
        )
    else:
        lines.append('exec "${LAUNCH[@]}" -m benchtrain.train "${TRAIN[@]}"')
    return "\n".join(lines) + "\n"


def setup_script(task: LaunchTask) -> str:
    """The install: the wheel of the benchtrain that made the plan, uploaded beside the task (emit_task), and its
    dependencies from the index."""
    wheel = shlex.quote(f"/{wheel_name(task.version)}")
    return f'# the benchtrain that made the plan\npython -m pip install --quiet "${{BENCHTRAIN_TASK_ROOT:-{ROOT}}}"{wheel}\n'


def figure_source(target: Target) -> str:
    """Where a target's figures come from, in the words of the module's docstring."""
    return {
        "measured here": "measured here",
        "measured by someone": "shared (measured by someone else)",
        "predicted": "predicted from a 1-GPU calibration and collectives",
        "translated": "translated from another GPU by datasheet ratios",
    }.get(target.row.kind, target.row.kind)


def header(task: LaunchTask, engine: str) -> list[str]:
    """The comments at the top of the file: what each figure rests on."""
    best = task.targets[0]
    lines = [
        f"{engine} task written by `train --dry-run --emit` (benchtrain {task.version}) for {task.model}; no cloud was asked anything.",
        f"Deadline {format_duration(task.deadline_seconds)}, counted from the first start of train (a restart's lost time counts).",
        "Targets, in order (the first recommended):",
    ]
    for index, target in enumerate(task.targets, 1):
        row, chosen = target.row, target.chosen
        cost = f", ≤ ${target.cost_upper:,.2f}" if target.cost_upper is not None else ""
        price = f" at ${row.price_per_hour:,.2f}/GPU-hour (given)" if row.price_per_hour is not None else ""
        seconds = f"{format_duration(chosen.total_seconds_low)} – {format_duration(chosen.total_seconds_promised)}"
        lines.append(
            f"  {index}. {target.machine} on {target.nodes} node(s) × {target.gpus_per_node}: {chosen.config.phrase}, {target.option.sharding}; "
            f"{seconds}{cost}{price} — {figure_source(target)}"
        )
        if row.settle:
            lines.append(f"     measured first on the node: {row.settle}")
    lines += [f"  left out: {reason}" for reason in task.left_out]
    lines += [
        f"Nodes: {best.nodes} (the recommended target's layout).",
        f"Disk: {task.disk_gb} GB = {task.disk.basis}.",
        f"Capacity: {task.spot.reason}.",
        f"Maximum duration: {format_duration(task.duration.seconds)} = {task.duration.basis}.",
        f"Shutdown grace: {format_duration(best.grace.seconds)} from SIGTERM to SIGKILL = {best.grace.basis}; each target's as GRACE in the run script.",
        f"The run folder {RUN_DIR} is a bucket mounted on every node: checkpoints survive the machine, and `--resume auto` finds them.",
    ]
    for upload in task.uploads:
        lines.append(f"Uploaded to every node: {upload.what} {upload.local} → {upload.remote}.")
    lines += [f"Note: {note}." for note in task.notes]
    return lines


# -- SkyPilot ---------------------------------------------------------------------------------


def skypilot_task(task: LaunchTask) -> JsonDict:
    """A SkyPilot task (sky.Task.from_yaml's schema): resources.ordered holds the targets in turn."""
    candidates = []
    for target in task.targets:
        resources: JsonDict = {"disk_size": task.disk_gb}
        if target.accelerator is not None:
            resources["accelerators"] = f"{target.accelerator}:{target.gpus_per_node}"
        else:
            resources["cpus"] = "4+"
        if task.spot.use:
            resources["use_spot"] = True
        candidates.append(resources)
    file_mounts: JsonDict = {RUN_DIR: {"name": task.storage, "mode": "MOUNT_CACHED"}}
    file_mounts.update({upload.remote: str(upload.local) for upload in task.uploads})
    resources_section: JsonDict = {"ordered": candidates} if len(candidates) > 1 else candidates[0]
    if task.spot.use:  # managed jobs (`sky jobs launch`) recover a preempted task on the next target
        resources_section["job_recovery"] = {"strategy": "FAILOVER", "max_restarts_on_errors": 0}
    configuration: JsonDict = {
        "name": task.name,
        "num_nodes": task.nodes,
        "resources": resources_section,
        "file_mounts": file_mounts,
    }
    if (
        task.secrets
    ):  # null: `sky launch --secret NAME` passes the launching machine's value, which the file never holds
        configuration["secrets"] = {name: None for name in task.secrets}
    configuration["setup"] = setup_script(task)
    configuration["run"] = run_script(task, "skypilot")
    return configuration


# -- dstack -----------------------------------------------------------------------------------


def dstack_task(task: LaunchTask) -> tuple[JsonDict, LaunchTask]:
    """A dstack task, and the task it holds: dstack takes one list of GPU names (any offer, cheapest first), so only the
    targets of the recommended one's GPU count per node; the others left out, saying why."""
    best = task.targets[0]
    kept = [target for target in task.targets if target.gpus_per_node == best.gpus_per_node]
    dropped = [
        f"{target.machine}: {target.gpus_per_node} GPUs per node, dstack's GPU list has one count"
        for target in task.targets
        if target not in kept
    ]
    task = replace(task, targets=kept, left_out=[*task.left_out, *dropped])
    resources: JsonDict = {"disk": f"{task.disk_gb}GB.."}
    if best.accelerator is not None:
        names = list(dict.fromkeys(target.accelerator for target in kept if target.accelerator is not None))
        resources["gpu"] = {"name": names, "count": best.gpus_per_node}
    else:
        resources["cpu"] = "4.."
    configuration: JsonDict = {
        "type": "task",
        "name": task.name,
        "nodes": task.nodes,
        "python": "3.11",
        "shell": "bash",  # the run script uses bash arrays
        # The mapping form: the short LOCAL:REMOTE form splits at every colon, so a path holding one breaks it.
        "files": [{"local_path": str(upload.local), "path": upload.remote} for upload in task.uploads],
        "volumes": [{"name": task.storage, "path": RUN_DIR}],
        "commands": [setup_script(task).strip(), run_script(task, "dstack")],
        "resources": resources,
        "spot_policy": "auto" if task.spot.use else "on-demand",
        "max_duration": f"{int(task.duration.seconds)}s",
        "stop_duration": f"{task.engine_stop_seconds}s",  # dstack's stop waits for the grace (its default: 5m)
    }
    if task.spot.use:  # a preempted task is started again, and continues (--resume auto)
        configuration["retry"] = {
            "on_events": ["interruption", "no-capacity"],
            "duration": f"{int(task.duration.seconds)}s",
        }
    if not task.uploads:
        del configuration["files"]
    if task.secrets:  # a name without a value: dstack passes the launching machine's, which the file never holds
        configuration["env"] = list(task.secrets)
    return configuration, task


# -- the file ---------------------------------------------------------------------------------


class LiteralDumper(yaml.SafeDumper):
    """PyYAML's safe dumper writing multi-line strings (the scripts) as literal blocks."""


def literal(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


LiteralDumper.add_representer(str, literal)


def task_text(task: LaunchTask, engine: str) -> str:
    """The whole file: the comments, then the task."""
    if engine == "slurm":
        task = slurm_targets(task)
        comments = [*header(task, engine), *slurm_comments(task)]
        lines = "".join(f"# {one_line(line)}\n" if line else "#\n" for line in comments)
        return "#!/bin/bash\n" + lines + slurm_body(task, setup_script(task), run_script(task, engine))
    if engine == "skypilot":
        data = skypilot_task(task)
        launch = [
            f"Launch: sky launch -c {task.name} FILE (a cluster), or sky jobs launch FILE (a managed job: restarted after a preemption).",
            f"file_mounts {RUN_DIR}: a bucket SkyPilot creates if it has none of that name (MOUNT_CACHED: files are written locally, then uploaded).",
        ]
        launch += [
            f"Secret {name}: launch with --secret {name} (its value from your environment)." for name in task.secrets
        ]
    else:
        data, task = dstack_task(task)
        launch = [
            "Launch: dstack apply -f FILE.",
            f"The volume {task.storage} must exist and be reachable by every node ({RUN_DIR}: the run folder, checkpoints included).",
        ]
        launch += [f"{name}: set it where you run dstack apply (dstack passes its value)." for name in task.secrets]
    comments = [*header(task, engine), *launch]
    body = yaml.dump(data, Dumper=LiteralDumper, sort_keys=False, allow_unicode=True, width=4096)
    return "".join(f"# {one_line(line)}\n" if line else "#\n" for line in comments) + body


def emit_task(emit: str, task: LaunchTask) -> None:
    """`--emit ENGINE:FILE`: the engine's file, written atomically (an unwritable FILE: one line), and said."""
    request = parse_emit(emit)
    try:
        request.path.parent.mkdir(parents=True, exist_ok=True)
        # The package that made the plan, beside the task: uploaded with its files and installed by its setup.
        wheel = build_wheel(request.path.parent.resolve(), task.version)
        package = Upload(wheel, f"{ROOT}/{wheel.name}", "benchtrain, the package that made the plan")
        write_text_atomic(request.path, task_text(replace(task, uploads=[*task.uploads, package]), request.engine))
    except OSError as error:
        raise BenchtrainError(f"--emit: cannot write {request.path}: {error.strerror or error}") from None
    say(f"task: {request.path} (docs/launch.md: sky launch / sky jobs launch / dstack apply / sbatch)")
