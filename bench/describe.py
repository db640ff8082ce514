"""A calibration in words, for `bench show`, `bench run` and `bench refit`."""

from __future__ import annotations

from collections import Counter
from typing import Any

from calibration.accuracy import describe_estimate_error, estimate_error_pct
from calibration.comm import describe_collectives
from calibration.dimensions import switches
from calibration.model import Calibration
from calibration.setup import describe_setup
from calibration.slices import describe_slices
from common.json_types import JsonDict

Column = tuple[str, str, str | None]  # the row's key, the column's title, its format

SIZE_COLUMNS: tuple[Column, ...] = (
    ("micro_batch_size", "batch", "{:d}"),
    ("num_workers", "workers", "{:d}"),
    ("grad_accum", "accum", "{:d}"),
    ("seq_len", "seq_len", "{:d}"),
)
MEASURED_COLUMNS: tuple[Column, ...] = (
    ("tokens_per_second", "tokens/s", "{:,.0f}"),
    ("step_seconds", "step s", "{:.4f}"),
    ("mfu", "MFU", "{:.1%}"),
    ("peak_memory_bytes", "peak MiB", None),
    ("data_wait_share", "data wait", "{:.1%}"),
    ("status", "status", "{}"),
)


def format_table(rows: list[dict[str, Any]]) -> str:
    """The measurement rows as a text table: the sizes, each switch (titled by its label: ckpt), then what was measured."""
    columns = (*SIZE_COLUMNS, *((dimension.name, dimension.label.lstrip("/"), "{:d}") for dimension in switches()), *MEASURED_COLUMNS)
    header = [title for _, title, _ in columns]
    body = [[_cell(row.get(key), key, style) for key, _, style in columns] for row in rows]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(line, widths, strict=True)) for line in [header, *body]]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def _cell(value: Any, key: str, style: str | None) -> str:
    if value is None or value == "":
        return "-"
    if key == "peak_memory_bytes":
        return f"{value / 2**20:,.0f}"
    try:
        return style.format(value) if style else str(value)
    except (ValueError, TypeError):
        return str(value)


def describe_step(training: JsonDict, overheads: JsonDict) -> str:
    """How THE step ran: compiled or eager (with the measured compile time), and its loss."""
    loss = training.get("loss", "plain")
    if not training.get("compile"):
        return f"eager, {loss} loss"
    cold = overheads.get("compile_seconds_per_shape", 0.0)
    cached = overheads.get("compile_cached_seconds_per_shape")
    from_cache = f", {cached:.1f}s from inductor's cache" if cached is not None else ""
    return f"torch.compile, {loss} loss; compiling a batch shape took {cold:.1f}s ({overheads.get('compile_shapes_measured', 0)} measured){from_cache}"


def describe_calibration(data: JsonDict, path: str) -> list[str]:
    hardware, model = data["hardware"], data["model"]
    counts = Counter(row["status"] for row in data["measurements"])
    lines = [
        f"calibration {data['id']}  ({path})",
        f"  created {data['created_at']} on {hardware['name']} ×{hardware['count']} "
        f"({hardware['memory_bytes'] / 2**30:.1f} GiB), model {model['name']} ({model['parameter_count']:,} parameters)",
        "  setup: " + describe_setup(data),
        "  probes: " + ", ".join(f"{count} {status}" for status, count in sorted(counts.items())),
        "  step: " + describe_step(data.get("training") or {}, data.get("overheads") or {}),
    ]
    if data.get("slices"):
        lines.append("  " + describe_slices(data["slices"]))
    distributed = data.get("distributed")
    if distributed:
        processes = f"{distributed['world_size']} ({distributed['backend']}, {distributed['sharding']})"
        lines.append(f"  processes: {processes}; {describe_collectives(distributed)}")
    search = data.get("search") or {}
    if search.get("stopped_by_budget"):
        lines.append(f"  the budget stopped the benchmark: {len(search.get('left_out', []))} configurations were not probed")
    drift = search.get("drift") or {}
    if drift.get("applied"):
        reference = drift["reference"]
        lines.append(
            f"  drift: the reference probe (batch {reference['micro_batch_size']}, length {reference['seq_len']}) varied "
            f"{drift['spread_pct']:.1f}% over {len(drift['measurements'])} repeats; measurements were rescaled to its median speed"
        )
    for warning in data.get("warnings", []):
        lines.append(f"  warning: {warning}")
    if data.get("fit"):
        lines += ["", "fit:", *(f"  {line}" for line in Calibration(data).explain())]
    best = sorted((row for row in data["measurements"] if row["status"] == "ok"), key=lambda row: -row["tokens_per_second"])[:5]
    lines += ["", "best configurations measured:", format_table(best)]
    history = data.get("history", [])
    if history:
        lines += ["", "how past estimates fared:"]
        for entry in history[-10:]:
            lines.append(
                f"  run {entry.get('run_id', '?')}: predicted {entry.get('predicted_tokens_per_second', 0):,.0f} tok/s, "
                f"actual {entry.get('actual_tokens_per_second', 0):,.0f} tok/s; estimate error "
                f"{describe_estimate_error(estimate_error_pct(entry.get('predicted_total_seconds'), entry.get('actual_total_seconds')))}"
            )
    return lines
