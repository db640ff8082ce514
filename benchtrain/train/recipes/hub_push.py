"""`--push-to-hub ORG/NAME`: the run's model on the Hugging Face hub, with a model card; checked before any work,
pushed after training, the upload priced in the plan. docs/design.md#pushing-to-the-hub."""

from __future__ import annotations

import argparse
import shlex
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

from benchtrain.calibration.adapters import trains_adapters
from benchtrain.calibration.dimensions import switches
from benchtrain.calibration.run_file import RunFile, run_configuration
from benchtrain.common.atomic import read_json_file, write_json_atomic, write_text_atomic
from benchtrain.common.console import say
from benchtrain.common.durations import format_duration
from benchtrain.common.errors import EXIT_OK, EXIT_PUSH_FAILED, BenchtrainError
from benchtrain.common.home import benchtrain_home
from benchtrain.common.hub_access import valid_repo_id, writing_user
from benchtrain.common.json_types import JsonDict
from benchtrain.train.export import FINAL, FINAL_MERGED

# No push measured from this machine yet: a conservative sustained upload rate (a cloud GPU host
# usually does better; the first push measures it and later plans use the measurement).
DEFAULT_UPLOAD_BYTES_PER_SECOND = 20e6
RATE_FILE = "hub_upload.json"
# Smaller uploads are dominated by the hub's round trips: they say little about the bandwidth.
MIN_MEASURED_BYTES = 5e6


@dataclass(frozen=True)
class PushTarget:
    """Where a run's model goes on the hub (`user`: whom the token belongs to, once checked)."""

    repo_id: str
    private: bool = False
    revision: str | None = None  # a branch, created if missing; None: main
    user: str | None = None

    @property
    def url(self) -> str:
        from huggingface_hub import constants

        return f"{constants.ENDPOINT}/{self.repo_id}" + (f"/tree/{self.revision}" if self.revision else "")


def check_push(target: PushTarget) -> PushTarget:
    """The target with the token's user; one line now rather than after training when the hub is off, unreachable or refuses."""
    return replace(target, user=writing_user("--push-to-hub", again="train again", otherwise=", or drop --push-to-hub"))


def upload_rate() -> tuple[float, str]:
    """Bytes per second an upload is planned at, and where that figure comes from."""
    try:
        measured = read_json_file(benchtrain_home() / RATE_FILE)
        rate = float(measured["bytes_per_second"])
        if rate > 0:
            return rate, f"measured by the push of {measured['bytes'] / 1e6:,.0f} MB on {measured['at'][:10]}"
    except (BenchtrainError, OSError, KeyError, TypeError, ValueError):
        pass
    return (
        DEFAULT_UPLOAD_BYTES_PER_SECOND,
        f"a default ({DEFAULT_UPLOAD_BYTES_PER_SECOND / 1e6:.0f} MB/s): no push measured from this machine yet",
    )


def remember_rate(size: int, seconds: float) -> None:
    """A push large enough to measure the bandwidth: kept for the next plans."""
    if size < MIN_MEASURED_BYTES or seconds <= 0:
        return
    at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    benchtrain_home().mkdir(parents=True, exist_ok=True)
    write_json_atomic(
        benchtrain_home() / RATE_FILE, {"bytes_per_second": size / seconds, "bytes": size, "seconds": seconds, "at": at}
    )


def folder_to_push(run_dir: Path, record: JsonDict) -> Path:
    """final-merged/ when the run wrote one (--merge-lora), else final/."""
    final = record.get("final") or {}
    merged = run_dir / FINAL_MERGED
    return merged if final.get("merged_path") and merged.is_dir() else run_dir / FINAL


def retry_command(run_dir: Path, target: PushTarget) -> str:
    options = ["--hub-private"] if target.private else []
    options += ["--hub-revision", target.revision] if target.revision else []
    return shlex.join(["train", "--out", str(run_dir), "--push-to-hub", target.repo_id, *options, "--push-only"])


def push_run(run_dir: Path, record: JsonDict, target: PushTarget) -> JsonDict:
    """Upload the run's model folder with its model card; returns run.json's record (a failure: with the retry command)."""
    from huggingface_hub import HfApi

    folder = folder_to_push(run_dir, record)
    files = sorted(
        str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file() and path.name != "README.md"
    )
    size = sum((folder / name).stat().st_size for name in files)
    section: JsonDict = {
        "repo_id": target.repo_id,
        "revision": target.revision,
        "private": target.private,
        "folder": folder.name,
    }
    # The retry from inside the run folder: run.json keeps nothing that a move of the folder breaks.
    section.update(files=[*files, "README.md"], bytes=size, url=target.url, retry=retry_command(Path("."), target))
    started = time.monotonic()
    try:
        write_text_atomic(folder / "README.md", model_card(record, target.repo_id))
        api = HfApi()
        api.create_repo(target.repo_id, private=target.private, exist_ok=True)
        if target.revision:
            api.create_branch(target.repo_id, branch=target.revision, exist_ok=True)
        commit = api.upload_folder(
            repo_id=target.repo_id,
            folder_path=folder,
            revision=target.revision,
            commit_message=f"benchtrain run {record.get('run_id')}",
        )
    except Exception as error:  # the network, the hub, the disk: said in one line, final/ kept
        text = str(error).splitlines()[0] if str(error) else ""
        return {
            **section,
            "status": "failed",
            "error": f"{type(error).__name__}: {text}",
            "seconds": time.monotonic() - started,
        }
    seconds = time.monotonic() - started
    remember_rate(size, seconds)
    return {
        **section,
        "status": "pushed",
        "seconds": seconds,
        "commit_url": str(getattr(commit, "commit_url", "") or ""),
    }


def describe_push(section: JsonDict, run_dir: Path) -> str:
    """One line: pushed (where, how much, how long), or failed with the retry for the run folder where it is now."""
    if section.get("status") == "pushed":
        return f"pushed {section['bytes'] / 1e6:,.1f} MB to {section['url']} in {section['seconds']:.1f}s"
    retry = section["retry"].replace("--out .", f"--out {shlex.quote(str(run_dir))}", 1)
    return f"warning: the push to {section['repo_id']} failed ({section.get('error')}); final/ is intact: retry with `{retry}`"


def push_existing_run(args: argparse.Namespace) -> int:
    """`train --out RUN --push-to-hub ORG/NAME --push-only`: a finished run's model pushed (again)."""
    if not args.push_to_hub:
        raise BenchtrainError("--push-only pushes a run to the hub: add --push-to-hub ORG/NAME")
    run_dir = Path(args.out).expanduser()
    record = read_json_file(
        run_dir / "run.json", missing=f"--push-only: {run_dir} has no run.json: name a run folder with --out"
    )
    target = PushTarget(valid_repo_id(args.push_to_hub, "--push-to-hub"), bool(args.hub_private), args.hub_revision)
    run_file = RunFile.from_json(record, str(run_dir / "run.json"))  # checked before the push
    if not folder_to_push(run_dir, record).is_dir():
        raise BenchtrainError(f"--push-only: {run_dir} has no final/ to push: the run has not finished its export")
    section = push_run(run_dir, record, check_push(target))
    run_file.update(push=section)
    run_file.write(run_dir)
    say(describe_push(section, run_dir))
    return EXIT_OK if section["status"] == "pushed" else EXIT_PUSH_FAILED


# -- the model card: README.md on the hub, from run.json alone (pure: run.json in, markdown out) ------------------

LOSS_POINTS = 12  # rows of the loss curve's table


def model_card(record: JsonDict, repo_id: str) -> str:
    """README.md for `repo_id` from the run record."""
    model, plan = record.get("model") or {}, record.get("plan") or {}
    lora = trains_adapters(plan.get("method", "full"))  # a peft adapter on the base
    base = model.get("hub_id") or model.get("name") or "unknown"
    front = [
        "---",
        f"base_model: {base}",
        f"library_name: {'peft' if lora else 'transformers'}",
        "tags:",
        "- benchtrain",
    ]
    front += ["- lora" if lora else "- full-fine-tuning", "---", ""]
    return (
        "\n".join(
            [
                *front,
                *_title(record, repo_id, base),
                *_data(record),
                *_method(record),
                *_outcome(record),
                *_losses(record),
            ]
        )
        + "\n"
    )


def _title(record: JsonDict, repo_id: str, base: str) -> list[str]:
    model = record.get("model") or {}
    revision = model.get("revision")
    partial = (record.get("final") or {}).get("partial")
    lines = [
        f"# {repo_id}",
        "",
        f"Fine-tuned from `{base}`" + (f" at revision `{revision}`" if revision else "") + " with benchtrain.",
    ]
    if partial:
        lines.append(
            f"This is the state of a run that stopped early ({record.get('status')}): see the plan against what happened."
        )
    return [*lines, ""]


def _data(record: JsonDict) -> list[str]:
    data = record.get("data") or {}
    profile = data.get("profile") or {}
    samples, tokens = profile.get("count"), profile.get("total_tokens")
    size = (
        f"{samples:,} samples, {tokens:,} tokens"
        if isinstance(samples, int) and isinstance(tokens, int)
        else "size not recorded"
    )
    packing = "packed" if data.get("packing") else "padded"
    return [
        "## Training data",
        "",
        f"- `{data.get('source')}`: {data.get('format')}, {size}, {packing}; loss on {data.get('loss_on')}",
        "",
    ]


def _method(record: JsonDict) -> list[str]:
    plan = record.get("plan") or {}
    step = run_configuration(plan)
    rows: list[tuple[str, object]] = [
        ("method", plan.get("method", "full")),
        ("optimizer", plan.get("optimizer", "adamw")),
        ("learning rate", plan.get("learning_rate")),
        (
            "micro-batch × accumulation × processes",
            f"{step.micro_batch_size} × {step.grad_accum} × {plan.get('world_size', 1)}",
        ),
        ("max length", step.seq_len),
        *((dimension.name.replace("_", " "), step.on(dimension.name)) for dimension in switches()),
        ("epochs", plan.get("epochs")),
        ("optimizer steps", plan.get("total_steps") or plan.get("optimizer_steps")),
    ]
    lora = plan.get("lora") or {}
    if lora:
        rows += [
            ("LoRA rank / alpha / dropout", f"{lora.get('rank')} / {lora.get('alpha')} / {lora.get('dropout', 0.0)}")
        ]
        rows += [
            ("LoRA targets", ", ".join(lora.get("targets") or []) or "default"),
            ("base quantization", lora.get("quantize", "none")),
        ]
    rows += [(name, value) for name, value in (record.get("hyperparameters") or {}).items()]
    return [
        "## Method and hyper-parameters",
        "",
        "| | |",
        "|---|---|",
        *[f"| {name} | {value} |" for name, value in rows],
        "",
    ]


def _outcome(record: JsonDict) -> list[str]:
    estimate, actual = record.get("estimate") or {}, record.get("actual") or {}
    hardware = record.get("hardware") or {}
    rows = [
        (
            "time",
            _duration(estimate.get("total_seconds")),
            _duration(actual.get("command_seconds") or actual.get("total_seconds")),
        ),
        ("tokens/s", _number(estimate.get("tokens_per_second")), _number(actual.get("tokens_per_second"))),
        ("peak memory (GiB)", _gib(estimate.get("peak_memory_bytes")), _gib(actual.get("peak_memory_bytes"))),
        ("optimizer steps", estimate.get("steps"), actual.get("steps")),
    ]
    error = record.get("estimate_error_pct")
    deadline = record.get("deadline_seconds")
    lines = [
        "## The plan against what happened",
        "",
        "| | planned | actual |",
        "|---|---|---|",
        *[f"| {a} | {b} | {c} |" for a, b, c in rows],
        "",
    ]
    if error is not None:
        lines.append(f"- estimate error of the steps run: {error:+.1f}%")
    if deadline:
        met = record.get("met_deadline")
        verdict = "met" if met else "missed" if met is False else "not known"
        lines.append(f"- deadline {format_duration(float(deadline))}: {verdict}; status {record.get('status')}")
    lines += [
        f"- device: {hardware.get('name')}; calibration `{record.get('calibration_id')}`; run `{record.get('run_id')}`",
        "",
    ]
    return lines


def _losses(record: JsonDict) -> list[str]:
    losses = record.get("losses") or []
    if not losses:
        return []
    stride = max(1, len(losses) // LOSS_POINTS)
    points = losses[::stride]
    if points[-1] is not losses[-1]:
        points.append(losses[-1])
    evals = {entry["step"]: entry.get("eval_loss") for entry in record.get("evals") or []}
    table = [f"| {p['step']} | {p['loss']:.4f} | {_number(evals.get(p['step']), 4)} |" for p in points]
    return ["## Loss curve", "", "| step | training loss | eval loss |", "|---|---|---|", *table, ""]


def _duration(seconds: object) -> str:
    return format_duration(float(seconds)) if isinstance(seconds, (int, float)) else "—"


def _number(value: object, digits: int = 0) -> str:
    return f"{value:,.{digits}f}" if isinstance(value, (int, float)) else "—"


def _gib(value: object) -> str:
    return f"{value / 2**30:.2f}" if isinstance(value, (int, float)) else "—"
