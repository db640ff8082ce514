"""Reports from fixture files: valid PNGs, nothing external, strings escaped, renders in Chromium."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import synthetic_calibration, synthetic_rows

from benchtrain.calibration.store import save_calibration
from benchtrain.reports.calibration_report import write_calibration_report
from benchtrain.reports.run_report import write_run_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
HOSTILE = '<script>alert("x")</script>'


def fixture_run(
    folder: Path, run_id: str = "tiny-run", error: float = 0.0, created: str = "2026-01-01T00:00:00+00:00"
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    losses = [
        {
            "step": i,
            "loss": 5.0 / i,
            "elapsed": 2.0 + 0.1 * i,
            "seconds": 0.1,
            "predicted_seconds": 0.095,
            "tokens": 500,
        }
        for i in range(1, 101)
    ]
    for entry in losses:  # warm-up, then a decay
        entry["learning_rate"] = 3e-4 * min(1.0, entry["step"] / 5) * (1 - entry["step"] / 101)
    record = {
        "schema_version": 1,
        "run_id": run_id,
        "created_at": created,
        "status": "completed",
        "calibration_id": "cpu-tiny-x",
        "model": {"name": "tiny", "fingerprint": "abc"},
        "data": {
            "source": f"/data/{HOSTILE}.jsonl",
            "format": "text",
            "packing": True,
            "profile": {"count": 100, "mean": 50.0},
        },
        "plan": {
            "micro_batch_size": 4,
            "grad_accum": 2,
            "num_workers": 0,
            "max_length": 128,
            "world_size": 1,
            "optimizer_steps": 100,
            "notes": [HOSTILE],
        },
        "estimate": {
            "total_seconds": 13.0 * (1 + error),
            "total_seconds_low": 12.0,
            "total_seconds_high": 14.5,
            "train_seconds": 9.5,
            "tokens": 50_000,
            "tokens_per_second": 5263.0,
            "tokens_per_second_low": 4800.0,
            "tokens_per_second_high": 5700.0,
            "naive_seconds": 8.0,
            "cost": None,
        },
        "actual": {
            "total_seconds": 13.0,
            "train_seconds": 10.0,
            "tokens_per_second": 5000.0,
            "steps": 100,
            "status": "completed",
            "cost": None,
        },
        "deadline_seconds": 60.0,
        "elapsed_before_plan": 1.0,
        "met_deadline": True,
        "timeline": [],
        "losses": losses,
        "events": ["checkpoint step-0000100 saved in 0.05s"],
        "alternatives": [
            {
                "micro_batch_size": 8,
                "grad_accum": 1,
                "num_workers": 0,
                "max_length": 128,
                "total_seconds": 14.0,
                "total_seconds_high": 15.0,
                "tokens_per_second": 5000.0,
                "peak_memory_bytes": 5e8,
            }
        ],
    }
    (folder / "run.json").write_text(json.dumps(record))
    return folder


def assert_self_contained(html: str) -> None:
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", html), "the report references something external"
    assert "<script" not in html.lower()
    for source in re.findall(r'<img[^>]+src="([^"]+)"', html):
        assert source.startswith("data:image/png;base64,")


def test_run_report(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    fixture_run(runs / "older", "older", error=0.3, created="2025-12-01T00:00:00+00:00")
    run_dir = fixture_run(runs / "tiny-run")
    html = write_run_report(run_dir).read_text()
    assert_self_contained(html)
    assert "&lt;script&gt;alert" in html  # user strings are escaped
    for name in ("progress.png", "throughput.png", "loss.png", "learning_rate.png", "history.png"):
        assert (run_dir / name).read_bytes().startswith(PNG_MAGIC), name
    for phrase in (
        "Estimate vs actual",
        "naive estimate",
        "Alternatives",
        "History",
        "Learning rate of each optimizer step",
    ):
        assert phrase in html


def test_calibration_report(home: Path) -> None:
    rows = synthetic_rows(memory_limit=6e9, batch_sizes=(1, 2, 4, 8, 16))
    data = synthetic_calibration(rows, memory_bytes=6e9)
    data["software"]["note"] = HOSTILE
    data["history"] = [
        {
            "run_id": "r1",
            "predicted_tokens_per_second": 1000.0,
            "actual_tokens_per_second": 950.0,
            "time_error_pct": 5.0,
        }
    ]
    data["search"] = {
        "drift": {
            "reference": {"micro_batch_size": 2, "num_workers": 0, "grad_accum": 1, "seq_len": 256},
            "measurements": [
                {"after_rows": 0, "tokens_per_second": 1000.0},
                {"after_rows": 8, "tokens_per_second": 800.0},
            ],
            "applied": True,
            "spread_pct": 22.2,
        }
    }
    path = save_calibration(data)
    report = write_calibration_report(path)
    html = report.read_text()
    assert_self_contained(html)
    assert HOSTILE not in html and "&lt;script&gt;" in html
    for name in ("measured_vs_predicted.png", "throughput_heatmap.png", "memory_vs_batch.png", "data_wait.png"):
        assert (report.parent / name).read_bytes().startswith(PNG_MAGIC), name
    for phrase in (
        "The fit in words",
        "fixed per micro-step",
        "Hardware, software and what was trained",
        "How past estimates",
        "varied by 22.2%",
    ):
        assert phrase in html


def test_report_cli_rejects_a_folder_without_run_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from benchtrain.common.errors import guard_cli
    from benchtrain.reports.cli import main

    assert guard_cli(main, [str(tmp_path)]) == 2
    assert "has no run.json" in capsys.readouterr().err


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHECK_SCRIPT = """<script>
window.addEventListener('load', () => {
  const images = Array.from(document.images);
  const broken = images.filter(img => !(img.complete && img.naturalWidth > 0)).length;
  document.title = 'IMAGES ' + images.length + ' BROKEN ' + broken;
});
</script>"""


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")
@pytest.mark.parametrize("kind", ["run", "calibration"])
def test_reports_render_in_headless_chromium_with_every_image_loaded(tmp_path: Path, home: Path, kind: str) -> None:
    if kind == "run":
        report = write_run_report(fixture_run(tmp_path / "runs" / "r"))
    else:
        report = write_calibration_report(save_calibration(synthetic_calibration()))
    probe = report.with_name("probe.html")
    probe.write_text(report.read_text().replace("</body>", CHECK_SCRIPT + "</body>"))
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
    ]
    result = subprocess.run(
        [CHROMIUM, *flags, "--virtual-time-budget=5000", "--dump-dom", probe.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    match = re.search(r"<title>IMAGES (\d+) BROKEN (\d+)</title>", result.stdout)
    assert match, result.stderr[-2000:]
    assert int(match.group(1)) >= 3 and int(match.group(2)) == 0
