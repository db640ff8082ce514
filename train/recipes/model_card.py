"""The model card a pushed run carries (README.md on the hub), written from its run.json alone:
the base model and its revision, the data, the method and its hyper-parameters, the plan against
what happened, the device and the calibration, the loss curve. Pure: run.json in, markdown out."""

from __future__ import annotations

from typing import Any

from calibration.dimensions import switches
from calibration.run_file import run_configuration
from common.durations import format_duration

LOSS_POINTS = 12  # rows of the loss curve's table


def model_card(record: dict[str, Any], repo_id: str) -> str:
    """README.md for `repo_id` from the run record."""
    model, plan = record.get("model") or {}, record.get("plan") or {}
    lora = plan.get("method", "full") != "full"  # adapters: a peft adapter on the base
    base = model.get("hub_id") or model.get("name") or "unknown"
    front = ["---", f"base_model: {base}", f"library_name: {'peft' if lora else 'transformers'}", "tags:", "- benchtrain"]
    front += ["- lora" if lora else "- full-fine-tuning", "---", ""]
    return "\n".join([*front, *_title(record, repo_id, base), *_data(record), *_method(record), *_outcome(record), *_losses(record)]) + "\n"


def _title(record: dict[str, Any], repo_id: str, base: str) -> list[str]:
    model = record.get("model") or {}
    revision = model.get("revision")
    partial = (record.get("final") or {}).get("partial")
    lines = [f"# {repo_id}", "", f"Fine-tuned from `{base}`" + (f" at revision `{revision}`" if revision else "") + " with benchtrain."]
    if partial:
        lines.append(f"This is the state of a run that stopped early ({record.get('status')}): see the plan against what happened.")
    return [*lines, ""]


def _data(record: dict[str, Any]) -> list[str]:
    data = record.get("data") or {}
    profile = data.get("profile") or {}
    samples, tokens = profile.get("count"), profile.get("total_tokens")
    size = f"{samples:,} samples, {tokens:,} tokens" if isinstance(samples, int) and isinstance(tokens, int) else "size not recorded"
    packing = "packed" if data.get("packing") else "padded"
    return ["## Training data", "", f"- `{data.get('source')}`: {data.get('format')}, {size}, {packing}; loss on {data.get('loss_on')}", ""]


def _method(record: dict[str, Any]) -> list[str]:
    plan = record.get("plan") or {}
    step = run_configuration(plan)
    rows: list[tuple[str, Any]] = [
        ("method", plan.get("method", "full")),
        ("optimizer", plan.get("optimizer", "adamw")),
        ("learning rate", plan.get("learning_rate")),
        ("micro-batch × accumulation × processes", f"{step.micro_batch_size} × {step.grad_accum} × {plan.get('world_size', 1)}"),
        ("max length", step.seq_len),
        *((dimension.name.replace("_", " "), step.on(dimension.name)) for dimension in switches()),
        ("epochs", plan.get("epochs")),
        ("optimizer steps", plan.get("total_steps") or plan.get("optimizer_steps")),
    ]
    lora = plan.get("lora") or {}
    if lora:
        rows += [("LoRA rank / alpha / dropout", f"{lora.get('rank')} / {lora.get('alpha')} / {lora.get('dropout', 0.0)}")]
        rows += [("LoRA targets", ", ".join(lora.get("targets") or []) or "default"), ("base quantization", lora.get("quantize", "none"))]
    rows += [(name, value) for name, value in (record.get("hyperparameters") or {}).items()]
    return ["## Method and hyper-parameters", "", "| | |", "|---|---|", *[f"| {name} | {value} |" for name, value in rows], ""]


def _outcome(record: dict[str, Any]) -> list[str]:
    estimate, actual = record.get("estimate") or {}, record.get("actual") or {}
    hardware = record.get("hardware") or {}
    rows = [
        ("time", _duration(estimate.get("total_seconds")), _duration(actual.get("command_seconds") or actual.get("total_seconds"))),
        ("tokens/s", _number(estimate.get("tokens_per_second")), _number(actual.get("tokens_per_second"))),
        ("peak memory (GiB)", _gib(estimate.get("peak_memory_bytes")), _gib(actual.get("peak_memory_bytes"))),
        ("optimizer steps", estimate.get("steps"), actual.get("steps")),
    ]
    error = record.get("estimate_error_pct")
    deadline = record.get("deadline_seconds")
    lines = ["## The plan against what happened", "", "| | planned | actual |", "|---|---|---|", *[f"| {a} | {b} | {c} |" for a, b, c in rows], ""]
    if error is not None:
        lines.append(f"- estimate error of the steps run: {error:+.1f}%")
    if deadline:
        met = record.get("met_deadline")
        verdict = "met" if met else "missed" if met is False else "not known"
        lines.append(f"- deadline {format_duration(float(deadline))}: {verdict}; status {record.get('status')}")
    lines += [f"- device: {hardware.get('name')}; calibration `{record.get('calibration_id')}`; run `{record.get('run_id')}`", ""]
    return lines


def _losses(record: dict[str, Any]) -> list[str]:
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


def _duration(seconds: Any) -> str:
    return format_duration(float(seconds)) if isinstance(seconds, (int, float)) else "—"


def _number(value: Any, digits: int = 0) -> str:
    return f"{value:,.{digits}f}" if isinstance(value, (int, float)) else "—"


def _gib(value: Any) -> str:
    return f"{value / 2**30:.2f}" if isinstance(value, (int, float)) else "—"
