"""`train --dry-run --emit slurm:FILE`: the launch task (train.recipes.launch_task) as an sbatch script. The same plan
and run script the other engines get, placed by SLURM: `--nodes`, GPUs per node, `--time` from the plan's upper end
with the install and a preemption, `--signal=B:USR1@LEAD` with the lead the plan measured (a step, a checkpoint, the
export), `--requeue`, output appended across requeues; srun starts one torchrun agent per node, rendezvous on the
first node of the allocation. How a signal becomes a checkpoint and a requeue: docs/launch.md#slurm."""

from __future__ import annotations

import math
import shlex
from dataclasses import replace

from benchtrain.common.durations import format_duration
from benchtrain.train.planning.rental import Spot, max_duration
from benchtrain.train.recipes.launch_task import ROOT, LaunchTask, Target

# The task's root on the cluster when BENCHTRAIN_TASK_ROOT is not set: beside the script, where sbatch was run, which
# a cluster's nodes share (a home or scratch folder).
DEFAULT_ROOT = '"$SLURM_SUBMIT_DIR"/'
# The signal every training process takes as "save a checkpoint and stop" (train.running.loop); USR1 itself would
# end them, and SIGTERM to torchrun's agent gives its workers only the agent's shutdown timeout.
WORKER_SIGNAL = "TERM"
SIGNALLED_EXIT = 138  # 128 + SIGUSR1: a node's agent stopped by a forwarded signal, so the job is requeued


def slurm_targets(task: LaunchTask) -> LaunchTask:
    """The targets of the recommended one's GPUs per node (an allocation has one count); the others left out, saying why."""
    best = task.targets[0]
    kept = [target for target in task.targets if target.gpus_per_node == best.gpus_per_node]
    dropped = [
        f"{target.machine}: {target.gpus_per_node} GPUs per node, an sbatch allocation has one count"
        for target in task.targets
        if target not in kept
    ]
    return replace(task, targets=kept, left_out=[*task.left_out, *dropped])


def lead_seconds(target: Target) -> float:
    """How long before the time limit the signal must come for the run to stop with its work saved, from what the plan
    measured: the slowest step at the upper end of its bound (or an evaluation pass, which a signal waits for), one
    checkpoint write and the export of final/ (a signal during the export waits for it)."""
    chosen = target.chosen
    overheads = chosen.overheads
    per_step = chosen.step_seconds / max(1, chosen.remaining_steps) + chosen.comm_seconds_per_step_high
    step = per_step * (1 + chosen.bound_fraction)
    return max(step, overheads.eval_pass_seconds) + overheads.checkpoint_seconds + overheads.export_seconds


def time_limit(task: LaunchTask) -> tuple[float, str]:
    """`--time`: the maximum duration with one preemption priced in, whatever the capacity (a cluster preempts and
    requeues), and how it was reckoned. Each start of a requeued job gets the whole of it again; the deadline guard
    still stops the run at the deadline counted from the first start."""
    upper = task.targets[0].chosen.total_seconds_promised + max(t.row.settle_seconds for t in task.targets)
    spot = Spot(True, task.spot.reason, task.spot.restart_seconds)
    duration = max_duration(upper, spot, task.deadline_seconds)
    return duration.seconds, duration.basis


def slurm_time(seconds: float) -> str:
    """D-HH:MM:SS, rounded up to a whole minute (SLURM's own granularity)."""
    minutes = max(1, math.ceil(seconds / 60))
    days, minutes = divmod(minutes, 24 * 60)
    return f"{days}-{minutes // 60:02d}:{minutes % 60:02d}:00"


def node_script() -> str:
    """What srun runs once per node: the run script (bench first where a target was not measured, then train) started in
    the background, so a forwarded signal reaches torchrun's workers; the node's exit says whether a signal stopped it."""
    return "\n".join(
        [
            "# USR1 reaches every process of the step (srun passes it on): the run script, torchrun and its workers",
            "# inherit it ignored (USR1 would end them); this shell alone takes it, and asks the workers to save.",
            "trap '' USR1",
            'bash "$BENCHTRAIN_TASK_ROOT/run.sh" & agent=$!  # the run script; torchrun replaces it (exec): $agent is the agent',
            "stopped=0",
            "# USR1: stop with the work saved, to be requeued; TERM (a cancel, a preemption): stop with the work saved.",
            f"trap 'stopped=1; pkill -{WORKER_SIGNAL} -P \"$agent\"' USR1",
            f"trap 'pkill -{WORKER_SIGNAL} -P \"$agent\"' TERM",
            'while :; do wait "$agent"; status=$?; kill -0 "$agent" 2>/dev/null || break; done',
            f'if [ "$stopped" = 1 ]; then exit {SIGNALLED_EXIT}; fi',
            'exit "$status"',
        ]
    )


def slurm_comments(task: LaunchTask) -> list[str]:
    """What the header says besides the other engines' lines: the time limit, the signal and the launch (the caller
    keeps each on its one comment line)."""
    seconds, basis = time_limit(task)
    lead = signal_lead(task)
    return [
        f"Time limit: {format_duration(seconds)} = {basis}; one preemption priced in: a requeued job starts again.",
        f"Signal: USR1 to this script {lead}s before the limit = the slowest step (or evaluation) at its upper end "
        "+ a checkpoint + the export, as the plan measured them; it saves a checkpoint, stops and requeues the job.",
        "Launch: sbatch FILE. The run folder is $BENCHTRAIN_TASK_ROOT/run (by default beside this file, where sbatch",
        "ran): every node must see it, the data and the package, on a shared filesystem.",
        "Save now and continue later: scancel --signal=USR1 --batch JOBID (requeued, it continues with --resume auto).",
    ]


def signal_lead(task: LaunchTask) -> int:
    return max(1, math.ceil(max(lead_seconds(target) for target in task.targets)))


def sbatch_lines(task: LaunchTask) -> list[str]:
    best = task.targets[0]
    lines = [
        f"#SBATCH --job-name={task.name}",
        f"#SBATCH --nodes={task.nodes}",
        "#SBATCH --ntasks-per-node=1  # one torchrun agent per node; it starts the node's processes",
    ]
    if best.accelerator is not None:
        lines.append(f"#SBATCH --gpus-per-node={best.gpus_per_node}")
    lines += [
        f"#SBATCH --time={slurm_time(time_limit(task)[0])}",
        f"#SBATCH --signal=B:USR1@{signal_lead(task)}",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append  # one log across the job's starts",
        f"#SBATCH --output={task.name}-%j.out",
    ]
    accelerators = list(dict.fromkeys(t.accelerator for t in task.targets if t.accelerator is not None))
    if len(accelerators) > 1:
        lines += [
            "# SLURM has no ordered list of GPU types: a feature list is any-of, and its names are the site's. The",
            "# script runs the plan made for the GPU the allocation got; to keep to these, name the site's features:",
            f"##SBATCH --constraint={'|'.join(accelerators)}",
        ]
    return lines


def root_word(path: str) -> str:
    """A path under the task's root as the batch script names it (through $ROOT)."""
    return '"$ROOT"' + shlex.quote(path.removeprefix(ROOT)) if path.startswith(ROOT + "/") else shlex.quote(path)


def slurm_body(task: LaunchTask, setup: str, run: str) -> str:
    """The sbatch script after its comments: the #SBATCH lines, the task's files copied under its root (the shared
    filesystem stands in for the other engines' uploads), the `setup` in an environment beside the run, the `run`
    script written beside the run, and srun with the signal forwarded and the requeue."""
    lines = sbatch_lines(task)
    lines += [
        "set -u",
        f"export BENCHTRAIN_TASK_ROOT=${{BENCHTRAIN_TASK_ROOT:-{DEFAULT_ROOT}{shlex.quote(task.name)}}}",
        'ROOT="$BENCHTRAIN_TASK_ROOT"',
        'mkdir -p "$ROOT/calibrations"',
    ]
    for upload in task.uploads:  # what the other engines upload: copied from where it was, on the shared filesystem
        if upload.remote != str(upload.local):
            lines.append(f"cp {shlex.quote(str(upload.local))} {root_word(upload.remote)}")
    lines += [
        "# The package that made the plan, installed once into an environment beside the run (its dependencies from",
        "# the index where the cluster's python3 lacks them; BENCHTRAIN_PYTHON names another interpreter).",
        'if [ ! -x "$ROOT/venv/bin/python" ]; then',
        '  rm -rf "$ROOT/venv.partial"',
        '  "${BENCHTRAIN_PYTHON:-python3}" -m venv --system-site-packages "$ROOT/venv.partial" || exit 1',
        "  (",
        '    export PATH="$ROOT/venv.partial/bin:$PATH"',
        *(f"    {line}" for line in setup.strip().splitlines()),
        "  ) || exit 1",
        '  mv "$ROOT/venv.partial" "$ROOT/venv"',
        "fi",
        'export PATH="$ROOT/venv/bin:$PATH"',
        "# The rendezvous: the allocation's first node.",
        'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
        "cat > \"$ROOT/run.sh\" <<'BENCHTRAIN_RUN_SCRIPT'",
        run.rstrip("\n"),
        "BENCHTRAIN_RUN_SCRIPT",
        "cat > \"$ROOT/node.sh\" <<'BENCHTRAIN_NODE_SCRIPT'",
        node_script(),
        "BENCHTRAIN_NODE_SCRIPT",
        "# USR1 (the time limit's --signal, or scancel --signal=USR1 --batch) reaches this shell only: srun passes it to",
        "# every node, whose training processes save a checkpoint and stop; then the job goes back in the queue.",
        'signalled=0 step=""',
        "trap 'signalled=1; kill -USR1 \"$step\" 2>/dev/null' USR1",
        "trap 'kill -TERM \"$step\" 2>/dev/null' TERM",
        'srun --ntasks-per-node=1 --kill-on-bad-exit=0 bash "$ROOT/node.sh" & step=$!',
        'while :; do wait "$step"; status=$?; kill -0 "$step" 2>/dev/null || break; done',
        f'if [ "$signalled" = 1 ] || [ "$status" = {SIGNALLED_EXIT} ]; then',
        '  echo "benchtrain: stopped by a signal with its work saved; back in the queue, it continues (--resume auto)" >&2',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "$status"',
    ]
    return "\n".join(lines) + "\n"
