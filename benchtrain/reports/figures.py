"""Matplotlib figures (Agg backend): readable labels with units, titles that state the finding."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

from benchtrain.common.json_types import JsonDict

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure

GIB = 2**30
plt.rcParams.update({"figure.dpi": 110, "axes.grid": True, "grid.alpha": 0.3, "font.size": 10})


def save(figure: Figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, format="png")
    plt.close(figure)
    return path


def measured_vs_predicted(
    measured: list[float], held_out: list[float], fitted: list[float], median_error: float | None, path: Path
) -> Path:
    figure, axis = plt.subplots(figsize=(6.4, 5.0))
    axis.scatter(measured, fitted, s=22, color="#7f8c8d", label="fitted on all probes")
    axis.scatter(measured, held_out, s=26, color="#2e86c1", marker="D", label="held out (cross-validated)")
    low, high = min(measured + held_out) * 0.9, max(measured + held_out) * 1.1
    axis.plot([low, high], [low, high], color="black", linewidth=1, label="perfect prediction")
    axis.fill_between(
        [low, high], [low * 0.85, high * 0.85], [low * 1.15, high * 1.15], color="#2e86c1", alpha=0.08, label="±15%"
    )
    axis.set(xlabel="measured tokens/s", ylabel="predicted tokens/s")
    title = "Predicted vs measured throughput"
    if median_error is not None:
        title += f"\nheld-out predictions are off by {median_error:.1f}% at the median"
    axis.set_title(title)
    axis.legend(loc="upper left", fontsize=8)
    return save(figure, path)


def throughput_heatmaps(rows: list[JsonDict], path: Path) -> Path:
    """tokens/s over micro batch × sequence length, one panel per accumulation (best worker count)."""
    import pandas as pd  # as the report modules do: importing benchtrain does not load it

    accums = sorted({row["grad_accum"] for row in rows})
    batches = sorted({row["micro_batch_size"] for row in rows})
    lengths = sorted({row["seq_len"] for row in rows})
    figure, axes = plt.subplots(1, len(accums), figsize=(4.8 * len(accums), 4.2), squeeze=False)
    best = max(rows, key=lambda row: row["tokens_per_second"])
    frame = pd.DataFrame(rows)
    for axis, accum in zip(axes[0], accums, strict=True):
        measured = frame[frame["grad_accum"] == accum]
        best_of = measured.pivot_table(
            index="seq_len", columns="micro_batch_size", values="tokens_per_second", aggfunc="max"
        )
        grid = best_of.reindex(index=lengths, columns=batches).to_numpy(dtype=float)
        image = axis.imshow(grid, origin="lower", cmap="viridis", aspect="auto")
        for (i, j), value in np.ndenumerate(grid):
            if not np.isnan(value):
                axis.text(j, i, f"{value:,.0f}", ha="center", va="center", fontsize=8, color="white")
        axis.set_xticks(range(len(batches)), [str(b) for b in batches])
        axis.set_yticks(range(len(lengths)), [str(s) for s in lengths])
        axis.set(xlabel="micro batch size (sequences)", ylabel="sequence length (tokens)")
        axis.set_title(f"gradient accumulation {accum}")
        axis.grid(False)
        figure.colorbar(image, ax=axis, label="tokens/s (best worker count)")
    figure.suptitle(
        f"Fastest measured: batch {best['micro_batch_size']}, length {best['seq_len']}, accumulation "
        f"{best['grad_accum']}, {best['num_workers']} workers ({best['tokens_per_second']:,.0f} tokens/s)"
    )
    return save(figure, path)


def memory_vs_batch(
    rows: list[JsonDict],
    oom_rows: list[JsonDict],
    limit_bytes: float,
    predict: Callable[[int, int], float] | None,
    path: Path,
) -> Path:
    figure, axis = plt.subplots(figsize=(6.8, 4.6))
    lengths = sorted({row["seq_len"] for row in rows} | {row["seq_len"] for row in oom_rows})
    colors = plt.cm.plasma(np.linspace(0.1, 0.85, max(1, len(lengths))))
    batches = sorted({row["micro_batch_size"] for row in rows} | {row["micro_batch_size"] for row in oom_rows})
    span = np.linspace(min(batches), max(batches), 50) if batches else np.array([])
    for color, length in zip(colors, lengths, strict=True):
        points = sorted(
            (row["micro_batch_size"], row["peak_memory_bytes"])
            for row in rows
            if row["seq_len"] == length and row.get("peak_memory_bytes")
        )
        if points:
            axis.scatter(
                [p[0] for p in points],
                [p[1] / GIB for p in points],
                color=color,
                s=24,
                label=f"measured, length {length}",
            )
        if predict is not None and len(span):
            axis.plot(
                span, [predict(int(max(1, round(b))), length) / GIB for b in span], color=color, linewidth=1, alpha=0.8
            )
    if oom_rows:
        batch_sizes = [row["micro_batch_size"] for row in oom_rows]
        axis.scatter(
            batch_sizes, [limit_bytes / GIB] * len(oom_rows), marker="x", s=60, color="#c0392b", label="out of memory"
        )
    axis.axhline(
        limit_bytes / GIB,
        color="#c0392b",
        linestyle="--",
        linewidth=1,
        label=f"device memory {limit_bytes / GIB:.1f} GiB",
    )
    axis.set(xlabel="micro batch size (sequences)", ylabel="peak memory (GiB)")
    peak = max((row.get("peak_memory_bytes") or 0 for row in rows), default=0)
    if 0 < peak < 0.2 * limit_bytes:
        axis.set_yscale("log")  # far below the limit: a log scale keeps both readable
    axis.set_title(
        f"Peak memory vs batch size (lines: fitted model)\nlargest measured peak uses {peak / limit_bytes:.0%} of device memory"
    )
    axis.legend(fontsize=7, loc="upper left")
    return save(figure, path)


def data_wait_by_workers(rows: list[JsonDict], path: Path) -> Path:
    workers = sorted({row["num_workers"] for row in rows})
    shares = [[100 * (row.get("data_wait_share") or 0) for row in rows if row["num_workers"] == w] for w in workers]
    figure, axis = plt.subplots(figsize=(6.0, 4.0))
    axis.boxplot(shares, tick_labels=[str(w) for w in workers])
    axis.set(xlabel="DataLoader workers", ylabel="time waiting for data (% of step)")
    medians = [float(np.median(s)) if s else 0.0 for s in shares]
    best = workers[int(np.argmin(medians))]
    axis.set_title(
        f"Data wait by worker count\nleast waiting with {best} workers (median {min(medians):.1f}% of the step)"
    )
    return save(figure, path)


def progress_over_time(
    elapsed: list[float],
    actual_tokens: list[float],
    predicted: dict[str, float],
    deadline: float,
    path: Path,
    ended: tuple[float, float],
    title: list[str],
) -> Path:
    """Tokens done over time since the plan: the actual run against the estimate and its bounds. `ended`: (seconds, tokens) where the run ended;
    `predicted["ran_end"]`: the estimate for the steps that ran; `title`: the estimate check's words (the banner's and the console's)."""
    figure, axis = plt.subplots(figsize=(7.2, 4.8))
    total, start = predicted["tokens"], predicted["start"]
    for key, style, label in (
        ("end_low", ":", "estimate bounds"),
        ("end", "-", "estimate, whole plan"),
        ("end_high", ":", None),
    ):
        axis.plot([start, predicted[key]], [0, total / 1e6], linestyle=style, color="#2e86c1", label=label)
    axis.fill_betweenx(
        [0, total / 1e6], [start, predicted["end_low"]], [start, predicted["end_high"]], color="#2e86c1", alpha=0.08
    )
    axis.plot(elapsed, [t / 1e6 for t in actual_tokens], color="#27ae60", linewidth=2, label="actual")
    end_seconds, end_tokens = ended
    axis.scatter(
        [predicted["ran_end"]],
        [end_tokens / 1e6],
        marker="o",
        s=50,
        color="#2e86c1",
        zorder=3,
        label="estimate for the steps that ran",
    )
    axis.scatter([end_seconds], [end_tokens / 1e6], marker="X", s=60, color="#27ae60", zorder=3, label="the run ended")
    view = max(end_seconds, predicted["end_high"]) * 1.25
    if deadline <= view * 1.6:
        axis.axvline(deadline, color="#c0392b", linestyle="--", label=f"deadline ({deadline:.0f}s after the plan)")
    else:
        # A far-away deadline would squash the lines: keep the view on the run and point at it.
        axis.set_xlim(0, view)
        axis.annotate(
            f"deadline at {deadline:.0f}s →", xy=(0.98, 0.04), xycoords="axes fraction", ha="right", color="#c0392b"
        )
    axis.set(xlabel="time since the plan (s)", ylabel="tokens trained (millions)")
    axis.set_title("\n".join(wrap(title)), fontsize=9)
    axis.legend(fontsize=8, loc="upper left")
    return save(figure, path)


def throughput_over_time(
    elapsed: list[float], actual: list[float], predicted: list[float], path: Path, finding: str | None
) -> Path:
    """Rolling real tokens/s against the prediction; `finding`: the estimate check's throughput line."""
    figure, axis = plt.subplots(figsize=(7.2, 4.2))
    axis.plot(elapsed, actual, color="#27ae60", label="actual (rolling 20 steps)")
    axis.plot(elapsed, predicted, color="#2e86c1", linestyle="--", label="predicted from the calibration")
    axis.set(xlabel="time since the plan (s)", ylabel="real tokens/s")
    axis.set_title("\n".join(["Throughput over time", *wrap([finding] if finding else [])]), fontsize=9)
    axis.legend(fontsize=8)
    axis.set_ylim(bottom=0)
    return save(figure, path)


def wrap(lines: list[str], width: int = 90) -> list[str]:
    """Title lines that fit the figure's width."""
    return [part for line in lines for part in textwrap.wrap(line, width)]


def loss_curve(
    steps: list[int],
    losses: list[float],
    path: Path,
    eval_steps: list[int] | None = None,
    eval_losses: list[float] | None = None,
) -> Path:
    figure, axis = plt.subplots(figsize=(7.2, 4.0))
    axis.plot(steps, losses, color="#8e44ad", linewidth=1, label="training loss")
    if eval_steps and eval_losses:
        axis.plot(eval_steps, eval_losses, color="#e67e22", marker="o", linewidth=1.5, label="eval loss")
        axis.legend()
    axis.set(xlabel="optimizer step", ylabel="loss")
    if losses:
        title = f"Loss\ntraining from {losses[0]:.3f} to {losses[-1]:.3f} over {steps[-1]} steps"
        if eval_losses:
            title += f"; eval {eval_losses[-1]:.3f} at the end"
        axis.set_title(title)
    return save(figure, path)


def learning_rate_curve(steps: list[int], rates: list[float], path: Path) -> Path:
    figure, axis = plt.subplots(figsize=(7.2, 4.0))
    axis.plot(steps, rates, color="#16a085", linewidth=1.2)
    axis.set(xlabel="optimizer step", ylabel="learning rate")
    axis.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    if rates:
        peak = max(rates)
        axis.set_title(
            f"Learning rate\npeak {peak:.3g} at step {steps[rates.index(peak)]}, {rates[-1]:.3g} at the last step"
        )
    return save(figure, path)


def estimate_error_history(labels: list[str], errors: list[float], path: Path) -> Path:
    figure, axis = plt.subplots(figsize=(7.2, 4.0))
    positions = list(range(len(errors)))
    axis.bar(positions, errors, color=["#27ae60" if abs(e) <= 15 else "#c0392b" for e in errors])
    axis.axhline(0, color="black", linewidth=0.8)
    axis.set_xticks(positions, labels, rotation=30, ha="right", fontsize=7)
    axis.set_ylabel("estimate error, % of the estimate\n(+ = took longer than estimated)")
    trend = "smaller" if len(errors) >= 2 and abs(errors[-1]) < abs(errors[0]) else "not smaller"
    axis.set_title(f"Estimate error of each run, oldest first\nthe latest error is {trend} than the first")
    return save(figure, path)


def time_vs_cost(options: list[JsonDict], deadline_hours: float, path: Path, title: str) -> Path:
    """One point per option: estimated hours (bars: its bounds) against cost; the deadline as a line. `options`: label, hours, low, high, cost (None without a
    price), predicted, recommended. Without prices the options stand side by side on the x axis."""
    figure, axis = plt.subplots(figsize=(7.2, 4.8))
    priced = all(option["cost"] is not None for option in options)
    for index, option in enumerate(options):
        x = option["cost"] if priced else index
        color = "#27ae60" if option["recommended"] else ("#8e44ad" if option["predicted"] else "#2e86c1")
        hours, face = option["hours"], "white" if option["predicted"] else color
        spread = [[hours - option["low"]], [option["high"] - hours]]
        axis.errorbar(
            [x],
            [hours],
            yerr=spread,
            fmt="s" if option["predicted"] else "o",
            markerfacecolor=face,
            color=color,
            markersize=8,
            capsize=4,
        )
        axis.annotate(option["label"], (x, option["hours"]), textcoords="offset points", xytext=(8, 4), fontsize=7)
    axis.axhline(deadline_hours, color="#c0392b", linestyle="--", linewidth=1, label=f"deadline ({deadline_hours:g} h)")
    predicted_handle = plt.Line2D(
        [], [], marker="s", color="#8e44ad", markerfacecolor="white", linestyle="", label="predicted (not measured)"
    )
    handles = [
        plt.Line2D([], [], marker="o", color="#27ae60", linestyle="", label="recommended"),
        plt.Line2D([], [], marker="o", color="#2e86c1", linestyle="", label="measured calibration"),
        *([predicted_handle] if any(option["predicted"] for option in options) else []),
        plt.Line2D([], [], color="#c0392b", linestyle="--", label=f"deadline ({deadline_hours:g} h)"),
    ]
    axis.legend(handles=handles, fontsize=8, loc="best")
    if priced:
        axis.set_xlabel("cost (USD: hours × price per device-hour × processes)")
        axis.set_xlim(0, max(option["cost"] for option in options) * 1.4 or 1.0)  # room for the labels
    else:
        axis.set_xticks(
            range(len(options)), [option["label"] for option in options], rotation=20, ha="right", fontsize=7
        )
        axis.set_xlabel("option (no prices given)")
        axis.set_xlim(-0.5, len(options) - 0.3)
    highest = max(deadline_hours, *(option["high"] for option in options))
    lowest = min(option["low"] for option in options)
    if lowest > 0 and highest / lowest > 20:
        # Options far under (or over) the deadline: a log scale keeps them and the deadline readable.
        axis.set_yscale("log")
        axis.set_ylim(lowest / 1.5, highest * 1.5)
        axis.set_ylabel("estimated time (h, log scale; bars: bounds)")
    else:
        axis.set_ylim(bottom=0, top=highest * 1.1)
        axis.set_ylabel("estimated time (h; bars: bounds)")
    axis.set_title("\n".join(wrap([title])), fontsize=9)
    return save(figure, path)
