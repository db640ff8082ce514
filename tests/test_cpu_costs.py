"""benchmarks/cpu_costs.py prints one row per operation, each with a time."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "cpu_costs.py"


def test_the_table_has_every_operation_timed(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts the checkout on it
    spec = importlib.util.spec_from_file_location("cpu_costs", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--rows", "8", "--inputs", "64", "--outputs", "128", "--repeat", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.rsplit(maxsplit=1)[0].strip(): float(line.rsplit(maxsplit=1)[1]) for line in lines[2:]}
    assert len(rows) == 8 and all(seconds >= 0 for seconds in rows.values())
    assert any("4-bit NF4, float32 compute" in name for name in rows) and any("frozen_heap" in name for name in rows)
