"""Adding a method is one entry in train/workload/method.py's METHODS: DoRA (peft's LoraConfig with
`use_dora=True`), registered there alone, is a choice of `train` and `bench run`, builds DoRA's
adapters, is measured into a calibration that says so, plans and trains, and run.json records it
so that a resume trains it again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_main

from benchtrain.calibration.run_file import RunFile
from benchtrain.calibration.setup import measured_setup
from benchtrain.train.running.resume import resumed_method
from benchtrain.train.workload.method import METHODS, Method, MethodConfig, apply_method
from benchtrain.train.workload.model import build_model, resolve_model

GRID = [
    "--batch-sizes",
    "1,2",
    "--workers",
    "0",
    "--accum",
    "1",
    "--seq-lens",
    "32,64",
    "--max-probe-seconds",
    "0.2",
    "--quiet",
]
DORA = Method("dora", "DoRA", adapters=True, peft_options={"use_dora": True})


@pytest.fixture()
def with_dora(monkeypatch: pytest.MonkeyPatch) -> Method:
    """The whole change: one entry in the table, nothing else touched."""
    monkeypatch.setitem(METHODS, DORA.name, DORA)
    return DORA


def test_the_argument_parser_offers_it_and_the_model_gets_dora_adapters(with_dora: Method) -> None:
    from benchtrain.train.cli import build_parser
    from benchtrain.train.workload.method import method_from_args

    parser = build_parser()
    assert "dora (DoRA)" in " ".join(parser.format_help().split())
    method = method_from_args(
        parser.parse_args(["--data", "sample", "--deadline", "1h", "--method", "dora", "--lora-rank", "4"])
    )
    assert method.is_lora and method.describe().startswith("DoRA rank 4 (alpha 8)")
    model = apply_method(build_model(resolve_model("tiny"), "cpu"), method)
    magnitudes = [
        name
        for name, parameter in model.named_parameters()
        if "lora_magnitude_vector" in name and parameter.requires_grad
    ]
    assert magnitudes  # DoRA's per-column magnitudes beside LoRA's A and B, trained
    plain = apply_method(build_model(resolve_model("tiny"), "cpu"), MethodConfig(method="lora", lora_rank=4))
    assert not any("lora_magnitude_vector" in name for name, _ in plain.named_parameters())


def test_bench_measures_it_and_train_plans_trains_and_records_it(
    with_dora: Method, home: Path, heavy_tailed_jsonl: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_main(
        "bench", ["run", "--gpu", "cpu", "--method", "dora", "--lora-rank", "4", *GRID, "--no-report"], capsys
    )
    assert code == 0, err
    data = json.loads(next((home / "calibrations").glob("*.json")).read_text())
    assert data["training"]["method"] == "dora" and data["training"]["lora"]["rank"] == 4
    setup = measured_setup(data)
    assert (setup.method, setup.lora_rank) == ("dora", 4)

    train = [
        "--data",
        str(heavy_tailed_jsonl),
        "--deadline",
        "30m",
        "--effective-batch",
        "4",
        "--method",
        "dora",
        "--lora-rank",
        "4",
        "--max-steps",
        "2",
    ]
    code, out, err = run_main("train", train, capsys)
    assert code == 0, err
    assert "training DoRA rank 4" in out
    record = json.loads(next((home / "runs").glob("*/run.json")).read_text())
    assert record["plan"]["method"] == "dora" and record["plan"]["lora"]["rank"] == 4
    resumed = resumed_method(RunFile.from_json(record).resumed().method)
    assert (resumed.method, resumed.lora_rank, resumed.is_lora) == ("dora", 4, True)  # a resume trains DoRA again

    code, _, err = run_main("train", [*train[:-2], "--method", "lora", "--dry-run"], capsys)
    # a calibration of another method is refused, by the table's names
    assert code != 0 and "measured DoRA, not LoRA" in err


def test_what_trains_adapters_is_one_table_that_methods_and_calibration_files_read(with_dora: Method) -> None:
    """calibration/ cannot import train/: it reads calibration.adapters' table where a file names its method (a
    calibration's training section, run.json's plan), and METHODS' entries read the same table."""
    from benchtrain.calibration.adapters import TRAINS_ADAPTERS, trains_adapters
    from benchtrain.calibration.run_file import RunMethod
    from benchtrain.calibration.setup import describe_setup

    assert set(TRAINS_ADAPTERS) <= set(METHODS)
    assert all(entry.adapters == trains_adapters(name) for name, entry in METHODS.items())  # DoRA's too
    assert not RunMethod("full").adapters and RunMethod("dora", lora_rank=8).adapters
    assert resumed_method(RunMethod("full", lora_rank=8)) == MethodConfig(method="full")
    full = {"model": {"name": "tiny"}, "training": {"method": "full", "lora": {"rank": 8}}}
    dora = {"model": {"name": "tiny"}, "training": {"method": "dora", "lora": {"rank": 8}}}
    assert measured_setup(full).lora_rank is None and measured_setup(dora).lora_rank == 8
    assert "full fine-tuning" in describe_setup(full) and "dora r8" in describe_setup(dora)
