"""Text tables for the terminal: computation returns rows, this module prints them."""

from __future__ import annotations

from typing import Any

from calibration.dimensions import switches

Column = tuple[str, str, str | None]  # the row's key, the column's title, its format


def measurement_columns() -> tuple[Column, ...]:
    """The sizes, each switch (titled by its label: ckpt), then what was measured."""
    switched = tuple((dimension.name, dimension.label.lstrip("/"), "{:d}") for dimension in switches())
    return (*SIZE_COLUMNS, *switched, *MEASURED_COLUMNS)


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


def format_table(rows: list[dict[str, Any]], columns: tuple[Column, ...] | None = None) -> str:
    columns = columns or measurement_columns()
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
