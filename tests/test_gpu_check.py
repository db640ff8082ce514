"""benchmarks/gpu_check.py (issue 34): every GPU claim in one command. On CPU its --smoke runs the
same checks (peers, loss, the LoRA bench, bench + train, compile, memory) at tiny shapes; each must
come back with a measured number, in the JSON and as a row of the markdown table."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_smoke_run_measures_every_check_and_writes_one_row_each(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "BENCHTRAIN_HOME": str(tmp_path / "home")}
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out)], env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    names = list(load_script().CHECKS)
    document = json.loads((out / "gpu_check.json").read_text())
    assert document["smoke"] is True and [check["name"] for check in document["checks"]] == names
    for check in document["checks"]:
        assert isinstance(check["value"], (int, float)), check
        assert check["claim"] and check["command"] and check["measured"], check
    table = (out / "gpu_check.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| check |")]
    assert [row.split(" | ")[0].removeprefix("| ") for row in rows] == names
    assert "not measured" not in table


def test_without_cuda_it_asks_for_smoke_in_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts benchmarks/ on it
    assert load_script().main(["--out", "unused"]) == 2
    captured = capsys.readouterr()
    assert captured.err == "no CUDA device: use --smoke\n" and captured.out == ""
