"""A resumed run: the run it continues (its run.json, model, method, configuration, steps), what this
command may and may not change of it, and the command that resumes a stopped one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from common.console import say
from common.errors import BenchtrainError
from train.recipes.config import TrainConfig
from train.running.checkpoint import checkpoints_to_resume

# What a resumed run keeps from the interrupted one: the same batches in the same order.
RESUMED_CONFIGURATION = ("micro_batch_size", "grad_accum", "num_workers", "max_length", "gradient_checkpointing")



def resumed_spec(spec: Any, previous: dict[str, Any]) -> Any:
    """A resumed run trains the hub commit it started from, wherever the branch has moved since."""
    from train.workload.model import resolve_model

    pinned = (previous.get("model") or {}).get("revision")
    if spec.hub is None or not pinned or pinned == spec.hub.revision:
        return spec
    return resolve_model(f"{spec.hub.repo_id}@{pinned}")


def resumed_method(previous: dict[str, Any]) -> Any:
    """The interrupted run's method: a resumed run trains what it trained."""
    from train.workload.method import MethodConfig

    plan = previous["plan"]
    lora = plan.get("lora") or {}
    optimizer = str(plan.get("optimizer", "adamw"))
    if plan.get("method", "full") != "lora":
        return MethodConfig(optimizer=optimizer)
    targets = lora.get("targets")
    return MethodConfig(
        method="lora",
        lora_rank=int(lora["rank"]),
        lora_alpha=float(lora["alpha"]),
        lora_dropout=float(lora.get("dropout", 0.0)),
        lora_targets=tuple(targets) if targets else None,
        quantize=str(lora.get("quantize", "none")),
        optimizer=optimizer,
    )


def resumed_configuration(previous: dict[str, Any], config: TrainConfig) -> dict[str, Any]:
    """The interrupted run's configuration, which its resume keeps (--force with --max-length N
    takes N instead: check_same_run)."""
    configuration = {key: previous["plan"].get(key, 0) for key in RESUMED_CONFIGURATION}
    if config.force and isinstance(config.max_length, int):
        configuration["max_length"] = config.max_length
    return configuration


def check_same_run(previous: dict[str, Any], config: TrainConfig, spec: Any, method: Any) -> list[str]:
    """A resume continues the run it names: another model, method or max length than the run's is
    refused (one line) unless --force, which then trains with this command's. Returns what --force
    let through, to warn about. (Other data is checked once it is tokenized: check_same_data.)"""
    plan = previous["plan"]
    run = f"--resume: run {previous['run_id']}"
    problems = []
    trained = previous.get("model") or {}
    if trained.get("fingerprint") and trained["fingerprint"] != spec.fingerprint:
        problems.append(f"{run} trained model {trained.get('name')}, this command names {spec.name}: pass --model as the run did")
    earlier = resumed_method(previous)
    if not same_method(earlier, method):
        problems.append(f"{run} trained {earlier.describe()}, this command asks for {method.describe()}: repeat the run's method options")
    if isinstance(config.max_length, int) and config.max_length != plan["max_length"]:
        problems.append(f"{run} trained with max length {plan['max_length']}, this command asks for --max-length {config.max_length}: drop it")
    if problems and not config.force:
        raise BenchtrainError(f"{problems[0]}, or pass --force to continue with this command's")
    return problems


def same_method(earlier: Any, method: Any) -> bool:
    """The run's method (run.json keeps LoRA's targets as resolved module names) and this
    command's: the same method and adapter settings; targets only when this command names them."""
    if earlier.method != method.method or earlier.optimizer != method.optimizer:
        return False
    if not method.is_lora:
        return True
    same_settings = (earlier.lora_rank, earlier.alpha, earlier.lora_dropout, earlier.quantize) == (
        method.lora_rank,
        method.alpha,
        method.lora_dropout,
        method.quantize,
    )
    named = method.lora_targets is None or set(method.lora_targets) == set(earlier.lora_targets or ())
    return same_settings and named


def data_fingerprint(data: Any) -> str:
    """The tokenized data's identity: its format and every sample's length, in order (runs
    recorded before the data cache; newer ones keep the cache key: train.workload.fingerprint)."""
    import hashlib

    import numpy as np

    digest = hashlib.sha256(data.format.encode())
    digest.update(np.asarray(data.lengths, dtype=np.int64).tobytes())
    return digest.hexdigest()[:16]


def check_same_data(previous: dict[str, Any], loaded: Any, force: bool) -> str | None:
    """A resume trains on the run's data (the same samples, so the same batches in the same
    order): other data is refused unless --force. Returns the warning --force let through."""
    before = previous.get("data") or {}
    data, data_path, profile = loaded.data, loaded.data_path, loaded.profile
    known_key, known = (before.get("preparation") or {}).get("key"), before.get("fingerprint")
    if known_key is not None:
        same = known_key == loaded.prepared.key
    elif known is not None and loaded.prepared.exact:
        same = known == data_fingerprint(data)
    elif not loaded.prepared.exact:
        same = True  # an older run, and data profiled from a sample: checked once tokenized (train_planned)
    else:  # a run recorded before the fingerprint: its length profile
        earlier = before.get("profile") or {}
        same = (earlier.get("count"), earlier.get("total_tokens")) == (profile["count"], profile["total_tokens"])
    if same:
        return None
    earlier = before.get("profile") or {}
    problem = (
        f"--resume: run {previous['run_id']} trained on {before.get('source')} ({_count(earlier.get('count'))} samples, "
        f"{_count(earlier.get('total_tokens'))} tokens), not {data_path} ({profile['count']:,} samples, {profile['total_tokens']:,} tokens)"
    )
    if not force:
        raise BenchtrainError(f"{problem}: pass the run's --data, or --force to continue on this data")
    return problem


def _count(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) else "?"


def run_total_steps(previous: dict[str, Any]) -> int:
    """The run's optimizer steps as its first plan set them (a run.json from before `total_steps`:
    its plan's step limit, else its steps)."""
    plan = previous["plan"]
    if plan.get("total_steps"):
        return int(plan["total_steps"])
    steps, limit = int(plan["optimizer_steps"]), plan.get("step_limit")
    return min(steps, int(limit)) if limit else steps


def resumed_step_limit(previous: dict[str, Any], config: TrainConfig, completed: int) -> int:
    """Where a resume stops: the run's own end, or earlier (--max-steps below it, or --fit-deadline
    later). A run that did all its steps is not resumed, and a resume never extends a run."""
    total, run = run_total_steps(previous), f"--resume: run {previous['run_id']}"
    if completed >= total or previous.get("status") == "completed":
        raise BenchtrainError(f"{run} already did all {total:,} of its optimizer steps (its model is in final/): nothing to resume; train more in a new run")
    if config.max_steps is not None and config.max_steps > total:
        raise BenchtrainError(
            f"{run} has {total:,} optimizer steps; --max-steps {config.max_steps} would extend it, which a resume never does: "
            "drop --max-steps, or train more in a new run"
        )
    return min(total, config.max_steps or total)


def completed_steps(out_dir: Path) -> int:
    """Optimizer steps the run in `out_dir` finished, from its latest checkpoint's progress."""
    from train.running.checkpoint import read_progress

    return int(read_progress(checkpoints_to_resume(out_dir)[-1])["step"])


def resume_target(config: TrainConfig) -> tuple[Any, Any, Path | None, dict[str, Any] | None]:
    """The model spec, the method, the run folder and, with --resume, the run.json it continues
    (whose model and adapters it keeps; other options differing are warned of)."""
    from train.workload.model import resolve_model

    spec = resolve_model(config.model)
    out_dir = Path(config.out).expanduser() if config.out else None
    if config.resume and (out_dir is None or not (out_dir / "run.json").is_file()):
        raise BenchtrainError(f"--resume: {out_dir} has no run.json to continue")
    previous = json.loads((out_dir / "run.json").read_text()) if config.resume and out_dir else None
    method = config.method
    if previous:
        from train.recipes.variant_choice import asked_variant, with_run_variant

        method = with_run_variant(method, resumed_method(previous), asked_variant(config.quantize, config.optimizer))
        spec = resumed_spec(spec, previous)
        for problem in check_same_run(previous, config, spec, method):
            say(f"warning: {problem} (--force: continuing with this command's)")
        if same_method(resumed_method(previous), method):
            method = resumed_method(previous)  # the run's adapters exactly (its targets as resolved)
    return spec, method, out_dir, previous


def resume_command(command_line: list[str] | None, out_dir: Path, world_size: int) -> str | None:
    """This command again, continuing the run in `out_dir` (--help promises it after Ctrl-C)."""
    if command_line is None:
        return None
    import shlex

    kept, skip = [], False
    for token in command_line:
        if skip:
            skip = False
            continue
        if token in ("--resume", "--dry-run"):
            continue
        if token == "--out":
            skip = True
            continue
        if token.startswith("--out="):
            continue
        kept.append(token)
    launcher = ["accelerate", "launch", "--num_processes", str(world_size), "-m", "train"] if world_size > 1 else ["train"]
    return shlex.join([*launcher, *kept, "--resume", "--out", str(out_dir)])
