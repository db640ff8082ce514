"""The calibration report: is the fitted model trustworthy, and what does the device like?"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from benchtrain.calibration.accuracy import estimate_error_pct
from benchtrain.calibration.model import Calibration
from benchtrain.calibration.schema import read_calibration_file, variant_data
from benchtrain.calibration.setup import describe_setup, variant_name, variant_of
from benchtrain.calibration.step_config import StepConfig
from benchtrain.calibration.store import CSV_COLUMNS
from benchtrain.calibration.training import Training
from benchtrain.common.json_types import JsonDict
from benchtrain.reports import figures
from benchtrain.reports.html import bullet_list, escape, figure_grid, key_values, section, table, verdict, write_page


def write_calibration_report(calibration_path: Path, out_dir: Path | None = None) -> Path:
    calibration_path = Path(calibration_path)
    data = read_calibration_file(calibration_path)
    out = Path(out_dir) if out_dir else calibration_path.with_name(f"{calibration_path.stem}-report")
    out.mkdir(parents=True, exist_ok=True)
    sections = setup_sections(data, calibration_path, None, out)
    # Each other setup the calibration measured (bench run --quantize none,4bit …), its figures apart.
    for index in range(len(data.get("variants") or [])):
        sections += setup_sections(data, calibration_path, index, out / f"variant-{index + 1}")
    subtitle = f"{data['model']['name']} on {data['hardware']['name']} — created {data['created_at']}"
    return write_page(out / "report.html", f"Calibration {data['id']}", subtitle, sections)


def setup_sections(file_data: JsonDict, path: Path, variant: int | None, out: Path) -> list[str]:
    """The sections of one setup the file measured (the first: variant None), under a heading naming it when the file holds several."""
    data = variant_data(file_data, variant)
    out.mkdir(parents=True, exist_ok=True)
    cal = Calibration(file_data, path, variant) if data.get("fit") else None
    sections = fit_sections(cal, data, out)
    sections += drift_sections(data)
    sections += [measurements_section(data["measurements"]), setup_section(data), history_section(data)]
    if not file_data.get("variants"):
        return sections
    heading = f"{'First setup' if variant is None else f'Variant {variant + 1}'}: {variant_name(*variant_of(data))}"
    return [section(heading, f"<p>{escape(describe_setup(data))}</p>"), *sections]


def fit_sections(cal: Calibration | None, data: JsonDict, out: Path) -> list[str]:
    """Is the fitted model trustworthy (held-out error, the fit in words), and the figures of what was measured, drawn into `out`."""
    rows = data["measurements"]
    ok = [row for row in rows if row["status"] == "ok"]
    oom = [row for row in rows if row["status"] == "oom"]
    sections = []
    if cal is not None:
        error = cal.fit["held_out_error"]
        median = error.get("median_abs_pct")
        sections.append(
            verdict(
                f"Held-out throughput error: median {median:.1f}%, 90th percentile {error.get('p90_abs_pct', 0):.1f}% "
                f"over {error.get('count')} probes ({cal.fit['kind']} model).",
                median is not None and median <= 15,
            )
        )
        sections.append(section("The fit in words", bullet_list(cal.explain())))
        fitted = [cal.throughput.tokens_per_second(StepConfig.from_row(row)) for row in ok]
        held_out = cal.fit.get("held_out_predicted_tokens_per_second") or fitted
        scatter = figures.measured_vs_predicted(
            [row["tokens_per_second"] for row in ok], list(held_out), fitted, median, out / "measured_vs_predicted.png"
        )
        figure_paths = [
            (
                scatter,
                "Each probe's measured tokens/s against the model's prediction when that probe was left out of the fit",
            )
        ]
    else:
        sections.append(verdict("No model was fitted: too few probes succeeded.", False))
        figure_paths = []
    if ok:
        figure_paths.append(
            (
                figures.throughput_heatmaps(ok, out / "throughput_heatmap.png"),
                "Measured tokens/s by micro batch and sequence length",
            )
        )
        memory = cal.memory if cal else None
        predict = None
        if memory is not None:
            model = memory

            def predict(batch: int, length: int) -> float:
                return model.peak_bytes(StepConfig(micro_batch_size=batch, num_workers=0, grad_accum=1, seq_len=length))

        memory_figure = figures.memory_vs_batch(
            ok, oom, float(data["hardware"]["memory_bytes"]), predict, out / "memory_vs_batch.png"
        )
        figure_paths.append((memory_figure, "Peak memory against the device limit"))
        figure_paths.append(
            (
                figures.data_wait_by_workers(ok, out / "data_wait.png"),
                "Share of each step spent waiting for the DataLoader",
            )
        )
    sections.append(section("Figures", figure_grid(figure_paths)))
    return sections


def drift_sections(data: JsonDict) -> list[str]:
    """How the machine's speed drifted during the benchmark (a reference probed again and again)."""
    drift = (data.get("search") or {}).get("drift") or {}
    if not drift.get("measurements"):
        return []
    reference = drift["reference"]
    rescaled = "Every measurement was rescaled to its median speed (raw figures are kept in the JSON)."
    applied = rescaled if drift.get("applied") else "No correction was applied."
    words = (
        f"The reference configuration (batch {reference['micro_batch_size']}, {reference['num_workers']} workers, accumulation "
        f"{reference['grad_accum']}, length {reference['seq_len']}) was probed {len(drift['measurements'])} times during the benchmark; "
        f"its speed varied by {drift.get('spread_pct', 0):.1f}%. {applied}"
    )
    names = {"position": "probe number", "after_rows": "after probe", "tokens_per_second": "reference tokens/s"}
    frame = pd.DataFrame(drift["measurements"]).rename(columns=names)
    return [section("Machine drift during the benchmark", f"<p>{escape(words)}</p>", table(frame.round(0)))]


def measurements_section(rows: list[JsonDict]) -> str:
    hidden = ("step_seconds_spread", "timed_steps", "probe_seconds", "error")
    columns = [column for column in CSV_COLUMNS if column not in hidden]
    frame = pd.DataFrame(rows).reindex(columns=columns)
    frame["peak_memory_bytes"] = frame["peak_memory_bytes"] / 2**20
    frame = frame.rename(
        columns={"peak_memory_bytes": "peak MiB", "tokens_per_second": "tokens/s", "data_wait_share": "data wait share"}
    )
    frame = frame.sort_values("tokens/s", ascending=False).round(
        {"tokens/s": 0, "step_seconds": 4, "peak MiB": 0, "data wait share": 3, "mfu": 3}
    )
    return section("Measurements", table(frame))


def setup_section(data: JsonDict) -> str:
    hardware, software = data["hardware"], data["software"]
    trainer = Training.from_record(data.get("training")).trainer
    return section(
        "Hardware, software and what was trained",
        f"<p><strong>Measured: {escape(trainer.words())}</strong></p>" if trainer is not None else "",
        key_values(
            [
                *hardware.items(),
                *software.items(),
                *((f"training {key}", value) for key, value in (data.get("training") or {}).items()),
            ]
        ),
        bullet_list([f"warning: {warning}" for warning in data.get("warnings", [])]) if data.get("warnings") else "",
    )


def history_section(data: JsonDict) -> str:
    """How past estimates with this calibration fared; time_error_pct (+: took longer than estimated)
    recomputed with the one convention (older files stored the opposite sign)."""
    history = data.get("history", [])
    history = [
        {
            **entry,
            "time_error_pct": estimate_error_pct(
                entry.get("predicted_total_seconds"), entry.get("actual_total_seconds")
            ),
        }
        for entry in history
    ]
    columns = [
        "run_id",
        "finished_at",
        "predicted_tokens_per_second",
        "actual_tokens_per_second",
        "time_error_pct",
        "status",
    ]
    shown = (
        table(pd.DataFrame(history).reindex(columns=columns).round(2))
        if history
        else "<p>No run has used this calibration yet.</p>"
    )
    return section("How past estimates with this calibration fared", shown)
