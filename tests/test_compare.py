"""Which machine to rent (issue 26): one dry run plans the same run for several calibrations, a row
each, the cheapest that meets the deadline first.

Calibrations: the real H100 one (bundled; the same bytes as tests/fixtures/h100-llama-3.2-1b-fullgrid.json),
a TEST DOUBLE of an H200 made from it (its hardware block changed and a run history that makes it
1.78× faster: nothing was measured on an H200), and synthetic CPU calibrations of 1 and 2
processes of this machine (tests/helpers.py)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from helpers import assert_one_line_error, cpu_calibration, dry_run, h100_data, heavy_tailed, run_main, tokenized

from benchtrain.calibration.hardware import Hardware
from benchtrain.calibration.model import Calibration
from benchtrain.calibration.store import save_calibration
from benchtrain.common.atomic import json_text
from benchtrain.common.durations import format_duration
from benchtrain.common.errors import BenchtrainError
from benchtrain.train.planning.prices import parse_prices, run_cost
from benchtrain.train.recipes.config import TrainConfig
from benchtrain.train.recipes.machines import compare, no_row_meets_the_deadline
from benchtrain.train.recipes.run_plan import PlanContext
from benchtrain.train.workload.data import length_profile
from benchtrain.train.workload.method import MethodConfig
from benchtrain.train.workload.model import resolve_model

H100 = "h100-llama-3.2-1b"
H100_HARDWARE = {
    "device_type": "cuda",
    "name": "NVIDIA H100 80GB HBM3",
    "peak_flops_entry": "H100 SXM",
    "memory_bytes": 85e9,
}
H200_HARDWARE = {"device_type": "cuda", "name": "NVIDIA H200", "peak_flops_entry": "H200", "memory_bytes": 150e9}


def h200_double() -> dict[str, Any]:
    """TEST DOUBLE: the H100 calibration relabelled as an H200 with 141 GB, and five past runs
    that each went 2× faster than predicted (history factor 2^(5/6) ≈ 1.78). Not a measurement."""
    data = copy.deepcopy(h100_data())
    data["id"] = "h200-test-double-llama-3-2-1b"
    data["hardware"].update(
        name="NVIDIA H200 (test double)", memory_bytes=150_000_000_000, peak_flops_entry="H200", peak_bf16_flops=989e12
    )
    data["history"] = [
        {"run_id": f"double-{i}", "predicted_tokens_per_second": 1.0, "actual_tokens_per_second": 2.0} for i in range(5)
    ]
    return data


def run_compare(
    calibrations: list[dict[str, Any]],
    model: str = "llama-3.2-1b",
    sources: list[dict[str, Any]] | None = None,
    **options: Any,
) -> Any:
    from benchtrain.train.step.hardware import detect_hardware

    config = TrainConfig.of(data="test", dry_run=True, **{"deadline": "12h", **options})
    data = tokenized(heavy_tailed(400))
    loaded = [Calibration(copy.deepcopy(item)) for item in calibrations]
    context = PlanContext(config, resolve_model(model), data, None, 0.0)
    return compare(
        context,
        MethodConfig(),
        loaded,
        Hardware.from_record(detect_hardware()),
        length_profile(data.lengths),
        [Calibration(copy.deepcopy(item)) for item in sources or []],
    )


# -- prices -----------------------------------------------------------------------------------


def test_prices_per_device_by_the_words_of_its_name(tmp_path: Path) -> None:
    prices = parse_prices("h100=2.5,h200=3.8")
    assert prices.for_device("any", Hardware.from_record(H100_HARDWARE)) == 2.5
    assert prices.for_device("any", Hardware.from_record(H200_HARDWARE)) == 3.8
    assert (
        parse_prices("2.5").for_device("x", Hardware.from_record(H200_HARDWARE))
        == parse_prices(2.5).for_device("x", Hardware.from_record(H100_HARDWARE))
        == 2.5
    )
    assert parse_prices(None).for_device("x", Hardware.from_record(H100_HARDWARE)) is None
    assert (
        parse_prices("h100=2.5,h100-sxm=2.9").for_device("x", Hardware.from_record(H100_HARDWARE)) == 2.9
    )  # the more specific key
    assert (
        parse_prices("h100=2.5,my-cal=9").for_device("my-cal", Hardware.from_record(H100_HARDWARE)) == 9
    )  # a calibration id
    # the default
    assert (
        parse_prices("h100=2.5,1.0").for_device("x", Hardware.from_record({"device_type": "cpu", "name": "AMD EPYC"}))
        == 1.0
    )
    with pytest.raises(
        BenchtrainError, match=r"no price for NVIDIA H200 \(calibration c; prices given for h100\): add h200=USD"
    ):
        parse_prices("h100=2.5").for_device("c", Hardware.from_record(H200_HARDWARE))
    lines = tmp_path / "prices.txt"
    lines.write_text("# rented by the hour\nh100 = 2.5\nh200=$3.80  # on demand\n")
    table = tmp_path / "prices.json"
    table.write_text(json.dumps({"h100": 2.5, "h200": 3.8}))
    for path in (lines, table):
        assert parse_prices(str(path)).for_device("x", Hardware.from_record(H200_HARDWARE)) == 3.8
    for bad, fragment in (
        ("h100=abc", "'abc' is not a price"),
        ("h100=-1", "non-negative"),
        ("h100=1,H100=2", "repeated"),
        ("1,2", "two prices"),
    ):
        with pytest.raises(BenchtrainError, match=fragment):
            parse_prices(bad)
    assert run_cost(7200, 2.5, 4) == 20.0 and run_cost(7200, None, 4) is None


# -- ranking ----------------------------------------------------------------------------------


def test_the_table_ranks_the_cheapest_that_meets_the_deadline_first() -> None:
    """The double is 1.78× faster at training, the measured overheads are the same: the price at
    which it costs what the H100 costs at $2.50 is 2.5 × the H100's time / its time. Below it the
    double ranks first, above it the H100. Each cost is time × price × processes."""
    h100, h200 = h100_data(), h200_double()
    timed = run_compare([h100, h200])  # without prices: the fastest that meets the deadline first
    assert timed.ranked_by == "time" and [row.calibration_id for row in timed.rows] == [h200["id"], h100["id"]]
    assert timed.rows[0].recommended and timed.rows[0].run_plan.plan.cost is None
    even = 2.5 * timed.rows[1].run_plan.plan.chosen.total_seconds / timed.rows[0].run_plan.plan.chosen.total_seconds
    cheap = run_compare([h100, h200], price_per_hour=f"h100=2.5,h200={even * 0.98}")
    assert cheap.ranked_by == "cost" and [row.calibration_id for row in cheap.rows] == [h200["id"], h100["id"]]
    assert cheap.recommended is cheap.rows[0]
    dear = run_compare([h100, h200], price_per_hour=f"h100=2.5,h200={even * 1.02}")
    assert [row.calibration_id for row in dear.rows] == [h100["id"], h200["id"]] and dear.recommended is dear.rows[0]
    for comparison in (cheap, dear):
        for row in comparison.rows:
            chosen = row.run_plan.plan.chosen
            assert row.run_plan.plan.cost == pytest.approx(
                chosen.total_seconds / 3600 * row.price_per_hour * row.processes
            )
            assert row.run_plan.plan.meets_deadline and chosen.fits_in_memory
        h100_row = next(row for row in comparison.rows if row.calibration_id == h100["id"])
        double_row = next(row for row in comparison.rows if row.calibration_id == h200["id"])
        assert double_row.run_plan.plan.chosen.step_seconds < h100_row.run_plan.plan.chosen.step_seconds / 1.7
        # Memory and MFU on each row's own device.
        assert h100_row.device.memory_bytes == h100["hardware"]["memory_bytes"] != double_row.device.memory_bytes
        assert double_row.memory_headroom > h100_row.memory_headroom
        assert double_row.compute["mfu"] > h100_row.compute["mfu"] > 0


def test_a_row_that_misses_the_deadline_is_not_recommended_however_cheap() -> None:
    h100, h200 = h100_data(), h200_double()
    loose = run_compare([h100, h200], price_per_hour="h100=2.5,h200=5.0")
    assert loose.rows[0].calibration_id == h100["id"]  # the cheaper one
    times = {row.calibration_id: row.run_plan.plan.chosen.total_seconds_promised for row in loose.rows}
    # after the 5% margin the double fits, the H100 does not
    between = (times[h100["id"]] + times[h200["id"]]) / 2 / 0.95
    tight = run_compare([h100, h200], price_per_hour="h100=2.5,h200=5.0", deadline=f"{between:.2f}")
    assert [row.calibration_id for row in tight.rows] == [h200["id"], h100["id"]]
    assert (
        tight.rows[0].recommended and not tight.rows[1].run_plan.plan.meets_deadline and not tight.rows[1].recommended
    )
    double = next(row for row in loose.rows if row.calibration_id == h200["id"]).run_plan.plan.chosen
    # half its training fits
    short = round(
        (double.overheads.total_seconds + (double.total_seconds_promised - double.overheads.total_seconds) / 2) / 0.95
    )
    none = run_compare([h100, h200], price_per_hour="h100=2.5,h200=5.0", deadline=f"{short}s")
    assert none.recommended is None and none.rows[0].calibration_id == h200["id"]
    message = no_row_meets_the_deadline(none, 0.05)
    assert message.startswith(
        f"no calibration's plan meets the {format_duration(short)} deadline: the closest, h200-test-double-llama-3-2-1b (NVIDIA H200 (test double) × 1)"
    )
    assert "--deadline " in message and "--epochs " in message and "--max-steps " in message


def test_priority_keeps_its_meaning_inside_each_row() -> None:
    fast = run_compare([h100_data()], price_per_hour="2.5", priority="fast").rows[0].run_plan.plan
    frugal = run_compare([h100_data()], price_per_hour="2.5", priority="memory_efficient").rows[0].run_plan.plan
    assert fast.request.priority == "fast" and frugal.request.priority == "memory_efficient"
    assert frugal.chosen.peak_memory_bytes <= fast.chosen.peak_memory_bytes
    assert frugal.chosen.total_seconds <= fast.chosen.total_seconds * 1.1 + frugal.chosen.overheads.total_seconds


def test_a_model_too_big_for_a_device_is_a_row_without_a_plan() -> None:
    """Full fine-tuning of an 8B model needs ≈120 GiB before activations: no plan on the H100 (80 GB)."""
    small = copy.deepcopy(h100_data())
    small["model"] = {
        **small["model"],
        "fingerprint": resolve_model("llama-3.1-8b").fingerprint,
        "name": "llama-3.1-8b",
    }
    big = copy.deepcopy(small)
    big["id"] = "big-double"
    big["hardware"].update(name="NVIDIA H200 (test double)", memory_bytes=500e9, peak_flops_entry="H200")
    comparison = run_compare([small, big], model="llama-3.1-8b", price_per_hour="h100=2.5,h200=3.8")
    assert comparison.rows[-1].run_plan is None and "use --lora" in comparison.rows[-1].problem
    assert comparison.rows[-1].calibration_id == small["id"] and not comparison.rows[-1].recommended
    assert comparison.ranked_by == "cost"  # the row without a plan needs no price: the others are ranked by theirs


# -- one and two processes, measured and predicted --------------------------------------------


def test_one_and_two_cpu_processes_cost_time_times_price_times_processes() -> None:
    one, two = cpu_calibration("cpu-one"), cpu_calibration("cpu-two", processes=2)
    comparison = run_compare([one, two], model="tiny", price_per_hour="cpu=1.0")
    by_processes = {row.processes: row for row in comparison.rows}
    # measured: nothing predicted
    assert set(by_processes) == {1, 2} and not any(row.source.option.predicted for row in comparison.rows)
    for processes, row in by_processes.items():
        assert row.run_plan.plan.chosen.world_size == processes
        assert row.run_plan.plan.cost == pytest.approx(row.run_plan.plan.chosen.total_seconds / 3600 * 1.0 * processes)
    # Two processes share the steps: faster, but both pay for the start-up, so dearer.
    assert by_processes[2].run_plan.plan.chosen.step_seconds < by_processes[1].run_plan.plan.chosen.step_seconds
    assert comparison.rows[0].processes == 1 and comparison.rows[0].recommended
    assert run_compare([one, two], model="tiny").rows[0].processes == 2  # ranked by time without prices


def test_predicted_rows_from_collectives_another_calibration_measured() -> None:
    """A 1-process calibration + the all-reduce a 2-process calibration of another model measured
    on this device: a predicted 2-process row, its all-reduce bracketed between hidden behind
    backward and not at all (the upper bound adds it in full, calibration.topology). A measured
    2-process calibration in the comparison replaces it."""
    from benchtrain.calibration.comm import CommModel
    from benchtrain.train.planning.comm import traffic_of
    from benchtrain.train.planning.memory_check import memory_need

    one = cpu_calibration("cpu-one")
    other_model = cpu_calibration("gpt2-two", processes=2, fingerprint="another-model")
    comparison = run_compare([one], model="tiny", sources=[other_model], price_per_hour="cpu=1.0")
    measured, predicted = sorted(comparison.rows, key=lambda row: row.processes)
    assert not measured.source.option.predicted and predicted.source.option.predicted and predicted.processes == 2
    assert predicted.source.option.collectives_from == "gpt2-two" and predicted.to_json()["source"] == "predicted"
    gradients = traffic_of("ddp", memory_need(resolve_model("tiny"), MethodConfig(), "cpu"), "cpu").gradient_bytes
    expected = CommModel.from_json(other_model["distributed"]["comm"]).all_reduce_seconds(gradients)
    assert expected > 0 and predicted.run_plan.communication["seconds_per_step"] == pytest.approx(expected)
    assert predicted.run_plan.communication["collectives_from"] == "gpt2-two"
    chosen, bound = predicted.run_plan.plan.chosen, predicted.run_plan.plan.chosen.bound_fraction
    assert chosen.comm_seconds_per_step_high == pytest.approx(expected)  # none hidden: the measured all-reduce
    assert chosen.comm_seconds_per_step_low < chosen.comm_seconds_per_step < chosen.comm_seconds_per_step_high
    compute = chosen.step_seconds - chosen.remaining_steps * chosen.comm_seconds_per_step
    bracketed = compute * (1 + bound) + chosen.remaining_steps * expected + chosen.overheads.total_seconds
    assert chosen.total_seconds_high == pytest.approx(bracketed) and chosen.total_seconds_promised == pytest.approx(
        bracketed
    )
    assert predicted.to_json()["comm_overlap"] and not measured.to_json()["comm_overlap"]
    assert predicted.run_plan.plan.cost == pytest.approx(chosen.total_seconds / 3600 * 2)
    assert any("predicted rows" in note for note in comparison.notes)
    two = cpu_calibration("cpu-two", processes=2)
    both = run_compare([one, two], model="tiny", sources=[other_model, two])
    assert [row.source.option.predicted for row in both.rows] == [False, False]
    elsewhere = {**other_model, "hardware": {**other_model["hardware"], "name": "another CPU"}}
    # collectives of another device: no prediction
    assert len(run_compare([one], model="tiny", sources=[elsewhere]).rows) == 1


# -- the command --------------------------------------------------------------------------------


def test_the_recommended_row_is_the_single_calibration_plan(
    home: Path, chats: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    double = home.parent / "h200-double.json"
    double.write_text(json.dumps(h200_double()))
    common = [
        "--model",
        "llama-3.2-1b",
        "--data",
        str(chats),
        "--epochs",
        "3",
        "--price-per-hour",
        "h100=2.5,h200=3.8",
        "--json",
    ]
    code, out, err = dry_run(capsys, "--use-calibration", f"{H100},{double}", *common)
    assert code == 0, err
    table = json.loads(out)
    assert [row["reference"] for row in table["rows"]] == [H100, str(double)]  # the overheads outweigh training here
    assert table["recommended"] == table["rows"][0]["calibration_id"] and table["rows"][0]["recommended"]
    for row in table["rows"]:
        code, out, err = dry_run(capsys, "--use-calibration", row["reference"], *common)
        assert code == 0, err
        single = json.loads(out)
        assert row["plan"]["chosen"] == single["plan"]["chosen"]
        assert (
            row["plan"]["cost"]
            == single["plan"]["cost"]
            == pytest.approx(single["plan"]["chosen"]["total_seconds"] / 3600 * row["price_per_hour"])
        )
        assert row["compute"] == single["compute"] and row["device"] == single["device"]
    report = home / "plans"
    (folder,) = report.iterdir()
    assert (folder / "report.html").is_file() and (folder / "time_vs_cost.png").is_file()
    assert json.loads((folder / "comparison.json").read_text())["rows"] == table["rows"]
    # `all`: the stored calibrations of this model and method, and the bundled ones.
    save_calibration(h200_double())
    save_calibration(cpu_calibration("cpu-one"))  # another model: left out
    code, out, err = dry_run(capsys, "--use-calibration", "all", "--no-report", *common)
    assert code == 0, err
    assert sorted(row["reference"] for row in json.loads(out)["rows"]) == sorted([H100, h200_double()["id"]])


def test_the_table_in_words_and_in_the_report(
    home: Path, chats: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """CPU calibrations of 1 and 2 processes stored; `all` finds them (not the bundled H100's other
    model); the 2-process row plans as a single dry run of it does."""
    for data in (cpu_calibration("cpu-one"), cpu_calibration("cpu-two", processes=2)):
        save_calibration(data)
    out_dir = tmp_path / "which"
    code, out, err = dry_run(
        capsys, "--use-calibration", "all", "--data", str(chats), "--price-per-hour", "cpu=1", "--out", str(out_dir)
    )
    assert code == 0, err
    assert (
        "2 option(s) for tiny (full fine-tuning), priority balanced, deadline 12h00m" in out and "ranked by cost" in out
    )
    header = next(line for line in out.splitlines() if "calibration" in line and "deadline" in line)
    assert all(column in header for column in ("time", "bounds", "cost", "peak memory (headroom)", "MFU"))
    assert "recommended: 1, cpu-one on" in out
    assert (
        f"train it there with: train --use-calibration cpu-one --deadline 12h --data {chats} --price-per-hour cpu=1\n"
        in out
    )
    assert f"report: {out_dir / 'report.html'}" in err
    html = (out_dir / "report.html").read_text()
    assert "Time vs cost" in html and "cpu-two" in html and "data:image/png;base64" in html
    code, out, _ = run_main("report", [str(out_dir)], capsys)
    assert code == 0 and out.strip() == str(out_dir / "report.html")
    table = json.loads((out_dir / "comparison.json").read_text())
    two = next(row for row in table["rows"] if row["world_size"] == 2)
    code, out, err = dry_run(
        capsys, "--use-calibration", "cpu-two", "--data", str(chats), "--price-per-hour", "cpu=1", "--json"
    )
    assert code == 0 and "planning for the 2 processes (ddp) calibration cpu-two measured" in err
    assert json.loads(out)["plan"]["chosen"] == two["plan"]["chosen"]


@pytest.mark.parametrize(
    ("argv", "fragment", "code"),
    [
        (
            ["--use-calibration", "cpu-one,cpu-lora"],
            "calibrations of different methods in one comparison: cpu-one measured full, cpu-lora measured lora",
            2,
        ),
        (
            ["--use-calibration", f"cpu-one,{H100}"],
            "calibrations of different models in one comparison: cpu-one measured tiny, h100-llama-3-2-1b-",
            2,
        ),
        (
            ["--use-calibration", "cpu-one,cpu-two", "--price-per-hour", "h100=2.5"],
            "--price-per-hour has no price for",
            2,
        ),
        (
            ["--use-calibration", "cpu-one,cpu-two", "--deadline", "2s"],
            "no calibration's plan meets the 2.0s deadline: the closest, cpu-",
            3,
        ),
        (["--use-calibration", "cpu-one,cpu-two", "--fit-deadline"], "--fit-deadline cuts each plan's steps", 2),
        (
            ["--use-calibration", "all", "--model", "gpt2"],
            "no stored or bundled calibration of gpt2 (full fine-tuning)",
            2,
        ),
    ],
)
def test_comparison_errors_are_one_line(
    home: Path, chats: Path, capsys: pytest.CaptureFixture[str], argv: list[str], fragment: str, code: int
) -> None:
    save_calibration(cpu_calibration("cpu-one"))
    save_calibration(cpu_calibration("cpu-two", processes=2))
    save_calibration(cpu_calibration("cpu-lora", training={"method": "lora"}))
    got, _, err = run_main(
        "train", ["--dry-run", "--data", str(chats), "--deadline", "12h", "--no-report", *argv], capsys
    )
    assert_one_line_error(got, err, fragment, code)


def test_a_comparison_is_a_dry_run(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main("train", ["--use-calibration", "a,b", "--data", "sample", "--deadline", "1h"], capsys)
    assert_one_line_error(code, err, "compares calibrations, which is a dry run: add --dry-run")
    code, _, err = run_main("train", ["--json", "--data", "sample", "--deadline", "1h"], capsys)
    assert_one_line_error(code, err, "--json prints a dry run's plan as JSON: add --dry-run")


def test_the_report_escapes_and_embeds_its_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from benchtrain.reports.comparison_report import write_comparison_report

    hostile = '<script>alert("x")</script>'
    record = run_compare([h100_data(), h200_double()], price_per_hour="h100=2.5,h200=3.8", deadline="1m").to_json()
    record["rows"][0]["reference"] = hostile
    (tmp_path / "comparison.json").write_text(json_text(record))
    html = write_comparison_report(tmp_path).read_text()
    assert hostile not in html and "&lt;script&gt;" in html
    assert (tmp_path / "time_vs_cost.png").read_bytes().startswith(
        b"\x89PNG\r\n\x1a\n"
    ) and "data:image/png;base64" in html
    assert ("No option meets" in html) == (record["recommended"] is None)
    (tmp_path / "comparison.json").write_text("{}")
    code, _, err = run_main("report", [str(tmp_path)], capsys)
    assert_one_line_error(code, err, "is not a benchtrain comparison")
