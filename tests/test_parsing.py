"""Durations, list options, search-space ordering and OOM pruning."""

from __future__ import annotations

import pytest

from benchtrain.bench.space import parse_int_list, ruled_out_by
from benchtrain.calibration.step_config import StepConfig
from benchtrain.common.durations import format_duration, parse_duration
from benchtrain.common.errors import BenchtrainError


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("15m", 900), ("12h", 43200), ("1h30m", 5400), ("45", 45), ("2.5", 2.5), ("1d", 86400)],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["0", "-5m", "soon", "", "5x", "1h-30m", "nan", "inf"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(BenchtrainError):
        parse_duration(text, "--deadline")


def test_format_duration() -> None:
    assert format_duration(12.34) == "12.3s"
    assert format_duration(200) == "3m20s"
    assert format_duration(3725) == "1h02m"


def test_parse_int_list() -> None:
    assert parse_int_list("4,1,2,2", "--batch-sizes") == (1, 2, 4)
    assert parse_int_list("0,2", "--workers", minimum=0) == (0, 2)
    for bad in ("0", "-1", "a", "1.5", "1,,2"):
        with pytest.raises(BenchtrainError, match="--batch-sizes"):
            parse_int_list(bad, "--batch-sizes")


def test_an_oom_rules_out_larger_batches_at_that_and_longer_lengths() -> None:
    oom = [StepConfig(micro_batch_size=4, num_workers=0, grad_accum=1, seq_len=256)]
    assert ruled_out_by(StepConfig(micro_batch_size=8, num_workers=2, grad_accum=2, seq_len=256), oom) == oom[0]
    assert ruled_out_by(StepConfig(micro_batch_size=4, num_workers=0, grad_accum=1, seq_len=512), oom) == oom[0]
    assert ruled_out_by(StepConfig(micro_batch_size=2, num_workers=0, grad_accum=1, seq_len=512), oom) is None
    assert ruled_out_by(StepConfig(micro_batch_size=8, num_workers=0, grad_accum=1, seq_len=128), oom) is None


def test_reading_a_json_file_fails_in_one_line(tmp_path) -> None:
    import re

    from benchtrain.common.atomic import read_json_file

    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00")
    assert read_json_file(_write(tmp_path / "ok.json", '{"a": 1}')) == {"a": 1}
    for name in ("broken.json", "binary.json"):
        with pytest.raises(BenchtrainError, match=re.escape(f"cannot read {tmp_path / name}: ")):
            read_json_file(tmp_path / name)
    with pytest.raises(BenchtrainError, match=r"^no such record$"):
        read_json_file(tmp_path / "absent.json", missing="no such record")
    with pytest.raises(BenchtrainError, match=r"cannot read .*absent\.json: .*No such file"):
        read_json_file(tmp_path / "absent.json")


def _write(path, text: str):
    path.write_text(text)
    return path
