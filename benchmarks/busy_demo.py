"""The README's demo on a busy machine (issue 38): `scripts/demo.sh` beside N CPU-bound processes
(one per core on our 2-core machines), in a fresh BENCHTRAIN_HOME; prints one row per hog count:
exit code, wall time, the probes bench measured, the training steps run and whether the deadline
held. The demo must exit 0 with a report whatever the load.

    python benchmarks/busy_demo.py                     # 0 and 2 hogs, the demo's own budget (150 s) and deadline (5m)
    python benchmarks/busy_demo.py --hogs 2,4 --budget 60s --deadline 3m
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def spin() -> None:
    while True:
        pass


def run_demo(hogs: int, budget: str, deadline: str) -> dict[str, object]:
    """One demo beside `hogs` busy processes: its exit code, seconds and what it left behind."""
    with tempfile.TemporaryDirectory() as home:
        env = {**os.environ, "BENCHTRAIN_HOME": home, "BUDGET": budget, "DEADLINE": deadline}
        busy = [multiprocessing.Process(target=spin, daemon=True) for _ in range(hogs)]
        for process in busy:
            process.start()
        started = time.monotonic()
        try:
            done = subprocess.run(["bash", "scripts/demo.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
        finally:
            for process in busy:
                process.terminate()
        seconds = time.monotonic() - started
        calibrations = sorted(Path(home, "calibrations").glob("*.json"))
        probes = (
            sum(row["status"] == "ok" for row in json.loads(calibrations[-1].read_text())["measurements"])
            if calibrations
            else 0
        )
        runs = sorted(Path(home, "runs").glob("*/run.json"))
        run = json.loads(runs[-1].read_text()) if runs else {}
        reports = list(Path(home, "runs").glob("*/report.html"))
        return {
            "hogs": hogs,
            "exit": done.returncode,
            "seconds": round(seconds, 1),
            "probes ok": probes,
            "steps": (run.get("actual") or {}).get("steps"),
            "met deadline": run.get("met_deadline"),
            "report": bool(reports),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hogs", default="0,2", help="busy processes beside the demo, a comma list (default: 0,2)")
    parser.add_argument("--budget", default="150s", help="bench's budget (the demo's BUDGET)")
    parser.add_argument("--deadline", default="5m", help="train's deadline (the demo's DEADLINE)")
    args = parser.parse_args()
    rows = [run_demo(int(count), args.budget, args.deadline) for count in args.hogs.split(",")]
    columns = list(rows[0])
    print(" | ".join(columns))
    print(" | ".join("---" for _ in columns))
    for row in rows:
        print(" | ".join(str(row[column]) for column in columns))


if __name__ == "__main__":
    main()
