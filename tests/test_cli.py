"""The three commands end to end on CPU, and every bad input: one line, exit 2, no traceback."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import assert_one_line_error, pretend_interrupted, run_main, synthetic_calibration

from benchtrain.calibration.store import save_calibration

SMALL_GRID = [
    "--batch-sizes",
    "1,2,4",
    "--workers",
    "0,1",
    "--accum",
    "1,2",
    "--seq-lens",
    "32,64",
    "--max-probe-seconds",
    "0.3",
    "--quiet",
]


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["run", "--batch-sizes", "0,2"], "--batch-sizes: values must be positive"),
        (["run", "--batch-sizes", "two"], "is not an integer"),
        (["run", "--workers", "-1"], "--workers: values must be non-negative"),
        (["run", "--seq-lens", "1.5"], "--seq-lens"),
        (["run", "--accum", ""], "--accum"),
        (["run", "--budget", "soon"], "--budget 'soon' is not a duration"),
        (["run", "--budget", "0s"], "--budget must be positive"),
        (["run", "--model", "gpt-17"], "unknown model 'gpt-17'"),
        (["run", "--trials", "0", "--search", "optuna"], "--trials must be a positive integer"),
        (["show", "nope"], "unknown calibration 'nope'"),
    ],
)
def test_bench_bad_input(home: Path, capsys: pytest.CaptureFixture[str], argv: list[str], fragment: str) -> None:
    assert_one_line_error(*run_main("bench", argv, capsys)[::2], fragment)


def test_bench_model_directory_without_config(home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty-model").mkdir()
    code, _, err = run_main("bench", ["run", "--model", str(tmp_path / "empty-model")], capsys)
    assert_one_line_error(code, err, "has no config.json")


def test_bench_unwritable_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("BENCHTRAIN_HOME", str(blocker / "home"))
    code, _, err = run_main("bench", ["run"], capsys)
    assert_one_line_error(code, err, "is not writable")


@pytest.mark.slow
def test_bench_then_train_then_report_end_to_end(
    home: Path, heavy_tailed_jsonl: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_main("bench", ["run", "--gpu", "cpu", *SMALL_GRID], capsys)
    assert code == 0, err
    assert "best configurations measured" in out and "Held-out tokens/s error" in out
    calibration_path = next((home / "calibrations").glob("*.json"))
    data = json.loads(calibration_path.read_text())
    assert data["search"]["space"]["batch_sizes"] == [1, 2, 4]
    assert sum(row["status"] == "ok" for row in data["measurements"]) == 24
    assert data["fit"]["held_out_error"]["median_abs_pct"] is not None
    assert data["overheads"]["checkpoint_save_seconds"] > 0 and data["overheads"]["report_seconds"] > 0
    assert (calibration_path.parent / f"{calibration_path.stem}-report" / "report.html").is_file()

    code, out, err = run_main("bench", ["list"], capsys)
    assert code == 0 and data["id"] in out
    code, out, _ = run_main("bench", ["show", "--json"], capsys)
    assert json.loads(out)["id"] == data["id"]

    code, out, err = run_main(
        "train", ["--data", str(heavy_tailed_jsonl), "--deadline", "30m", "--effective-batch", "4"], capsys
    )
    assert code == 0, err
    run_dir = next((home / "runs").iterdir())
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "completed" and record["met_deadline"] is True
    step = record["plan"]["configuration"]  # the step configuration, written once
    assert (
        set(step) == {"micro_batch_size", "grad_accum", "num_workers", "seq_len", "gradient_checkpointing"}
        and "world_size" in record["plan"]
    )
    assert step["micro_batch_size"] * step["grad_accum"] == 4
    assert (
        record["estimate"]["tokens_per_second_low"]
        < record["estimate"]["tokens_per_second"]
        < record["estimate"]["tokens_per_second_high"]
    )
    assert record["actual"]["steps"] == record["plan"]["optimizer_steps"]
    assert record["calibration_id"] == data["id"]
    assert (run_dir / "report.html").is_file() and (run_dir / "progress.png").is_file()
    assert list((run_dir / "checkpoints").iterdir())
    history = json.loads(calibration_path.read_text())["history"]
    assert len(history) == 1 and history[0]["run_id"] == record["run_id"]

    code, out, err = run_main("report", [str(run_dir)], capsys)
    assert code == 0 and out.strip().endswith("report.html")

    # A deadline far too short for 50 epochs: refused up front with the options, exit 3.
    code, _, err = run_main("train", ["--data", str(heavy_tailed_jsonl), "--deadline", "20s", "--epochs", "50"], capsys)
    assert_one_line_error(code, err, "options: --epochs", expected_code=3)
    assert len(list((home / "runs").iterdir())) == 1  # nothing new written, nothing damaged


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (None, "does not exist"),
        ([], "is empty"),
        (['{"text": "ok"}', '{"text": broken}'], "line 2: not valid JSON"),
        (['["a list"]'], "line 1: expected a JSON object"),
        (['{"title": "no text here"}'], "no usable text field"),
    ],
)
def test_train_bad_data(
    calibrated_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], content: list[str] | None, fragment: str
) -> None:
    path = tmp_path / "data.jsonl"
    if content is not None:
        write_lines(path, content)
    code, _, err = run_main("train", ["--data", str(path), "--deadline", "5m"], capsys)
    assert_one_line_error(code, err, fragment)


def test_datasets_own_error_log_stays_out_of_a_bad_file_s_one_line(
    calibrated_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """datasets logs its own error before raising; with its handler's stream gone (configured under
    an earlier test's captured stderr, or a closed pipe) logging printed a traceback beside our line."""
    import io
    import logging

    gone = io.StringIO()
    gone.close()
    handler = logging.StreamHandler(gone)
    logging.getLogger("datasets").addHandler(handler)
    try:
        path = tmp_path / "data.jsonl"
        write_lines(path, ['{"text": "ok"}', '{"text": broken}'])
        code, _, err = run_main("train", ["--data", str(path), "--deadline", "5m"], capsys)
    finally:
        logging.getLogger("datasets").removeHandler(handler)
    assert_one_line_error(code, err, "line 2: not valid JSON")


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--deadline", "0"], "--deadline must be positive"),
        (["--deadline", "tomorrow"], "is not a duration"),
        (["--use-calibration", "missing-id"], "unknown calibration"),
        (["--tokenizer", "/no/such/dir"], "no tokenizer in"),
        (["--model", "gpt2"], "was measured for model tiny, not gpt2"),
        (["--max-length", "-3"], "--max-length"),
        (["--epochs", "0"], "--epochs must be positive"),
        (["--resume"], "--resume needs --out"),
    ],
)
def test_train_bad_options(
    calibrated_home: Path, capsys: pytest.CaptureFixture[str], extra: list[str], fragment: str
) -> None:
    argv = ["--data", "sample", "--deadline", "5m", *extra]
    code, _, err = run_main("train", argv, capsys)
    assert_one_line_error(code, err, fragment)


def test_train_refuses_a_calibration_from_another_device(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from benchtrain.train.workload.model import resolve_model

    other = {"device_type": "cuda", "name": "NVIDIA H100 80GB HBM3", "count": 1, "memory_bytes": 80 * 2**30}
    save_calibration(
        synthetic_calibration(
            hardware=other,
            model={"name": "tiny", "parameter_count": 1, "fingerprint": resolve_model("tiny").fingerprint},
        )
    )
    code, _, err = run_main("train", ["--data", "sample", "--deadline", "5m"], capsys)
    assert_one_line_error(code, err, "was measured on NVIDIA H100")
    # A dry run plans for the calibration's device (tests/test_bundled_calibration.py).
    code, out, err = run_main("train", ["--data", "sample", "--deadline", "5m", "--dry-run"], capsys)
    assert code == 0 and "plan (balanced)" in out and "planning for NVIDIA H100 80GB HBM3" in err


def test_a_corrupt_calibration_names_the_file(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = home / "calibrations"
    folder.mkdir(parents=True)
    (folder / "broken.json").write_text("{")
    code, _, err = run_main("train", ["--data", "sample", "--deadline", "5m", "--use-calibration", "broken"], capsys)
    assert_one_line_error(code, err, "broken.json is not valid JSON")


def test_dry_run_prints_the_plan_and_writes_nothing(calibrated_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(
        "train", ["--data", "sample", "--deadline", "1h", "--dry-run", "--price-per-hour", "2.5"], capsys
    )
    assert code == 0
    for phrase in ("estimate", "naive estimate", "alternative", "cost: $", "deadline"):
        assert phrase in out
    assert not (calibrated_home / "runs").exists()


def test_help_is_instant_and_has_examples() -> None:
    for command in ("bench", "train", "reports"):
        result = subprocess.run(
            [sys.executable, "-m", f"benchtrain.{command}", "--help"], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0 and "examples:" in result.stdout
        check = subprocess.run(
            [sys.executable, "-c", f"import sys, benchtrain.{command}.cli; sys.exit('torch' in sys.modules)"],
            capture_output=True,
            timeout=60,
        )
        assert check.returncode == 0, f"{command} --help imports torch"


def run_process_group(command: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """Run a launcher and its workers in a session of their own; on timeout kill all of them (a
    worker left behind would outlive the test) and fail with what they printed."""
    import os
    import signal

    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(
            f"{' '.join(command[:6])} … did not finish within {timeout:.0f}s (a rank hung); stderr:\n{stderr[-3000:]}"
        )
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def torchrun(module: str, arguments: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        f"benchtrain.{module}",
        *arguments,
    ]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_processes_under_torchrun(calibrated_home: Path, heavy_tailed_jsonl: Path, fork_server) -> None:
    """Under a launcher (torchrun, like `accelerate launch`): a 1-process calibration plus all-reduce
    measured now predicts the 2-process step; data sharded, LR scaled, one record. Then bench under
    2 processes stores a world-size-2 calibration with its communication model, and train plans
    from it. The first command runs under torchrun itself; the others under the fork server's
    launch, which sets what torchrun sets for its workers (and saves 8 s of imports a rank) but,
    like srun or mpirun, leaves the rendezvous store to rank 0: rank 0 must leave last."""
    import os

    env = {**os.environ, "BENCHTRAIN_HOME": str(calibrated_home), "OMP_NUM_THREADS": "1"}
    folder = calibrated_home / "ranks"

    def launch(command: str, arguments: list[str]) -> subprocess.CompletedProcess:
        return fork_server.run_group(command, arguments, folder, env={"BENCHTRAIN_HOME": str(calibrated_home)})

    train = ["--data", str(heavy_tailed_jsonl), "--deadline", "30m", "--effective-batch", "4", "--no-report"]
    out = calibrated_home / "two"
    first = [*train, "--out", str(out), "--lr-scaling", "sqrt", "--base-batch", "2"]
    tokenized_by = calibrated_home / "tokenized-by.log"  # train.workload.data_cache.encode_range's trace
    result = run_process_group(
        torchrun("train", [*first, "--max-steps", "4"]),
        {**env, "BENCHTRAIN_TOKENIZE_LOG": str(tokenized_by)},
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("communication: predicted") == 1, result.stdout  # said once, by rank 0
    # The data was tokenized once, by rank 0 (rank 1 waited for the cache and mapped it).
    builders = [line.split() for line in tokenized_by.read_text().splitlines()]
    assert builders and {(rank, local) for rank, local, *_ in builders} == {("0", "0")}
    assert sum(int(stop) - int(start) for *_, start, stop in builders) == 300
    traced = {"BENCHTRAIN_HOME": str(calibrated_home), "BENCHTRAIN_TOKENIZE_LOG": str(tokenized_by)}
    pretend_interrupted(out, 6)
    result = fork_server.run_group("train", [*first, "--max-steps", "6", "--resume"], folder, env=traced)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(tokenized_by.read_text().splitlines()) == len(builders)  # the resume read the cache
    record = json.loads((out / "run.json").read_text())
    assert [entry["step"] for entry in record["losses"]] == list(range(1, 7))  # resumed under 2 processes
    plan = record["plan"]
    assert plan["world_size"] == 2 and plan["sharding"] == "ddp"
    assert plan["configuration"]["micro_batch_size"] * plan["configuration"]["grad_accum"] * 2 == 4
    assert plan["learning_rate"] == pytest.approx(3e-4 * (4 / 2) ** 0.5) and plan["lr_scaling"] == "sqrt"
    communication = plan["communication"]
    assert communication["source"] == "predicted" and communication["seconds_per_step"] > 0
    fit = communication["collectives"]["all_reduce"]["fit"]
    assert fit["world_size"] == 2 and fit["backend"] == "gloo"
    assert record["actual"]["steps"] == 6 and record["status"] == "step_limit"

    # LoRA + DDP (the users' 4×H200 recipe, in small): each process holds the frozen base; rank 0
    # exports the adapter and the base it points at.
    lora = calibrated_home / "lora"
    result = launch("train", [*train, "--out", str(lora), "--lora", "--max-steps", "2", "--force"])
    assert result.returncode == 0, result.stderr[-3000:]
    adapter = json.loads((lora / "final" / "adapter_config.json").read_text())
    # the base in final/: it goes where final/ goes
    assert adapter["base_model_name_or_path"] == "." and (lora / "final" / "model.safetensors").is_file()
    assert json.loads((lora / "run.json").read_text())["plan"]["sharding"] == "ddp"

    grid = [
        "--gpu",
        "cpu",
        "--batch-sizes",
        "1,2",
        "--seq-lens",
        "32,64",
        "--workers",
        "0",
        "--accum",
        "1",
        "--no-report",
        "--quiet",
    ]
    result = launch("bench", ["run", *grid])
    assert result.returncode == 0, result.stderr[-3000:]
    newest = max((calibrated_home / "calibrations").glob("*.json"), key=lambda path: path.stat().st_mtime)
    calibration = json.loads(newest.read_text())
    distributed = calibration["distributed"]
    assert distributed["world_size"] == 2 and distributed["backend"] == "gloo" and distributed["sharding"] == "ddp"
    assert distributed["comm"]["seconds_per_byte"] > 0 and len(distributed["all_reduce"]) >= 3
    assert all(row.get("ranks") == 2 for row in calibration["measurements"] if row["status"] == "ok")
    result = launch("train", [*train, "--use-calibration", calibration["id"], "--dry-run"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "communication: measured in the calibration's 2-process ddp step times" in result.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp_under_torchrun(calibrated_home: Path, heavy_tailed_jsonl: Path, fork_server) -> None:
    """`--sharding fsdp` under 2 processes: trains what DDP trains (same losses, same eval loss), plans its
    collectives from a 1-process calibration, resumes from its gathered checkpoint, and leaves a
    final/ that loads with the last checkpoint's weights. Then bench under FSDP stores an FSDP
    calibration, which an FSDP run plans from and a DDP run refuses. The DDP run is under torchrun
    itself; the others under the fork server's launch (as in test_two_processes_under_torchrun)."""
    import os

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    env = {**os.environ, "BENCHTRAIN_HOME": str(calibrated_home), "OMP_NUM_THREADS": "1"}
    train = ["--data", str(heavy_tailed_jsonl), "--deadline", "30m", "--effective-batch", "4", "--no-report"]
    folder = calibrated_home / "ranks"

    def launch(command: str, arguments: list[str]) -> subprocess.CompletedProcess:
        return fork_server.run_group(command, arguments, folder, env={"BENCHTRAIN_HOME": str(calibrated_home)})

    ddp, fsdp = calibrated_home / "ddp", calibrated_home / "fsdp"
    for out, sharding in ((ddp, "ddp"), (fsdp, "fsdp")):
        arguments = [*train, "--out", str(out), "--sharding", sharding, "--max-steps", "3", "--eval-split", "0.05"]
        result = (
            run_process_group(torchrun("train", arguments), env, timeout=240)
            if sharding == "ddp"
            else launch("train", arguments)
        )
        assert result.returncode == 0, result.stderr[-3000:]
    assert "fsdp collectives measured now among 2 processes" in result.stdout
    sharded = json.loads((fsdp / "run.json").read_text())
    assert sharded["plan"]["sharding"] == "fsdp" and sharded["plan"]["communication"]["seconds_per_micro_step"] > 0
    assert set(sharded["plan"]["communication"]["collectives"]) == {"all_gather", "reduce_scatter"}
    replicated = json.loads((ddp / "run.json").read_text())
    assert [e["loss"] for e in sharded["losses"]] == pytest.approx([e["loss"] for e in replicated["losses"]], rel=1e-4)
    # evaluation sharded too
    assert sharded["evals"][-1]["eval_loss"] == pytest.approx(replicated["evals"][-1]["eval_loss"], rel=1e-4)

    # The resume repeats the run's data options (its eval split too: a resume trains on the run's samples).
    resume = [*train, "--out", str(fsdp), "--sharding", "fsdp", "--max-steps", "5", "--eval-split", "0.05", "--resume"]
    pretend_interrupted(fsdp, 5)
    result = launch("train", resume)
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = json.loads((fsdp / "run.json").read_text())
    assert [entry["step"] for entry in resumed["losses"]] == list(range(1, 6)) and resumed["losses"][:3] == sharded[
        "losses"
    ]
    final = AutoModelForCausalLM.from_pretrained(fsdp / "final")
    saved = load_file(str(fsdp / "checkpoints" / "step-0000005" / "model.safetensors"))
    assert all(torch.equal(saved[name], tensor) for name, tensor in final.state_dict().items() if name in saved)
    assert sum(parameter.numel() for parameter in final.parameters()) == resumed["model"]["parameter_count"]

    grid = [
        "--gpu",
        "cpu",
        "--batch-sizes",
        "1,2",
        "--seq-lens",
        "32,64",
        "--workers",
        "0",
        "--accum",
        "1",
        "--no-report",
        "--quiet",
    ]
    result = launch("bench", ["run", *grid, "--sharding", "fsdp"])
    assert result.returncode == 0, result.stderr[-3000:]
    newest = max((calibrated_home / "calibrations").glob("*.json"), key=lambda path: path.stat().st_mtime)
    calibration = json.loads(newest.read_text())
    assert calibration["distributed"]["sharding"] == "fsdp" and calibration["training"]["sharding"] == "fsdp"
    assert set(calibration["distributed"]["collectives"]) == {"all_reduce", "all_gather", "reduce_scatter"}
    assert (
        calibration["overheads"]["checkpoint_extrapolated"] == 0
        and calibration["overheads"]["checkpoint_save_seconds"] > 0
    )
    from benchtrain.bench.cli import describe_calibration

    assert any(
        line.strip().startswith("processes: 2 (gloo, fsdp); all-reduce")
        for line in describe_calibration(calibration, str(newest))
    )
    planned = [*train, "--use-calibration", calibration["id"], "--dry-run"]
    result = launch("train", [*planned, "--sharding", "fsdp"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "measured in the calibration's 2-process fsdp step times" in result.stdout
    result = launch("train", planned)
    assert result.returncode != 0 and "measured with --sharding fsdp, this run uses ddp" in result.stderr


def test_resume_through_the_command_line(
    calibrated_home: Path,
    heavy_tailed_jsonl: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import os
    import signal

    from benchtrain.train.step.step import TrainingStep

    out = tmp_path / "run"
    common = [
        "--data",
        str(heavy_tailed_jsonl),
        "--deadline",
        "30m",
        "--effective-batch",
        "4",
        "--out",
        str(out),
        "--no-report",
        "--max-steps",
        "6",
    ]
    real_step, steps = TrainingStep.run, []

    def ctrl_c_after_the_third(self: TrainingStep, *args: object, **kwargs: object) -> object:
        result = real_step(self, *args, **kwargs)
        steps.append(1)
        if len(steps) == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return result

    monkeypatch.setattr(TrainingStep, "run", ctrl_c_after_the_third)
    code, _, err = run_main("train", common, capsys)
    assert code == 130, err
    monkeypatch.setattr(TrainingStep, "run", real_step)
    first = json.loads((out / "run.json").read_text())
    assert first["actual"]["steps"] == 3 and first["status"] == "interrupted"
    # FSDP checkpoints key the optimizer state by name: a run resumes with the sharding it had.
    original = (out / "run.json").read_text()
    (out / "run.json").write_text(json.dumps({**first, "plan": {**first["plan"], "sharding": "fsdp"}}))
    code, _, err = run_main("train", [*common, "--resume"], capsys)
    assert_one_line_error(code, err, "was trained with sharding fsdp; resume it with the same (now: none)")
    (out / "run.json").write_text(original)
    code, _, err = run_main("train", [*common, "--resume"], capsys)
    assert code == 0, err
    resumed = json.loads((out / "run.json").read_text())
    assert resumed["run_id"] == first["run_id"] and resumed["resumed"] == 1
    assert resumed["actual"]["steps"] == 6
    assert [entry["step"] for entry in resumed["losses"]] == list(range(1, 7))
    assert resumed["losses"][:3] == first["losses"][:3]
    assert any("resumed from step-0000003" in event for event in resumed["events"])


def test_an_out_of_memory_error_while_training_is_one_line(
    calibrated_home: Path, heavy_tailed_jsonl: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    from benchtrain.train.step.step import TrainingStep

    def out_of_memory(*_args: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")

    monkeypatch.setattr(TrainingStep, "run", out_of_memory)
    code, _, err = run_main(
        "train", ["--data", str(heavy_tailed_jsonl), "--deadline", "30m", "--effective-batch", "4"], capsys
    )
    assert_one_line_error(code, err, "out of memory training batch")


def test_a_cold_run_plans_from_a_sample_then_trains_on_every_record(
    calibrated_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """More records than the first sample: the plan comes from a sample (its interval said, the
    tokenizing predicted and counted), the run tokenizes every record once, plans the chosen
    configuration again on the exact profile, and records the sampled estimate against the exact
    total and the tokenizing predicted against measured; the next command plans exactly from the cache."""
    rng = random.Random(3)
    lines = []
    for _ in range(5000):
        answer = "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(60, 120)))
        lines.append(
            json.dumps({"conversations": [{"from": "human", "value": "question?"}, {"from": "gpt", "value": answer}]})
        )
    data = write_lines(tmp_path / "chats.jsonl", lines)
    out = tmp_path / "run"
    arguments = [
        "--data",
        str(data),
        "--deadline",
        "30m",
        "--effective-batch",
        "4",
        "--max-steps",
        "2",
        "--out",
        str(out),
    ]
    code, printed, err = run_main("train", [*arguments, "--dry-run"], capsys)
    assert code == 0, err
    assert "lengths from 4,096 of 5,000 records:" in printed and "tokens (95% interval)" in printed
    # an overhead of the plan
    assert "tokenizing all 5,000 records: ≈" in printed and "tokenizing " in printed.split("overheads")[1]
    assert "data: 5,000 samples, ≈" in printed
    code, printed, err = run_main("train", arguments, capsys)
    assert code == 0, err
    assert "tokenized all 5,000 records" in printed and "on the exact profile:" in printed
    record = json.loads((out / "run.json").read_text())
    preparation = record["data"]["preparation"]
    # assistant bytes: fewer than every token
    exact = sum(len(json.loads(line)["conversations"][1]["value"]) for line in lines)
    assert preparation["profiled_from"] == "sample" and preparation["sampled_estimate"]["sampled"] == 4096
    assert preparation["exact_total_tokens"] == record["data"]["profile"]["total_tokens"] > exact
    estimate = preparation["sampled_estimate"]
    assert abs(preparation["exact_total_tokens"] - estimate["total_tokens"]) <= 2 * estimate["half_width"]
    assert preparation["predicted_seconds"] > 0 and preparation["actual_seconds"] > 0
    report = (out / "report.html").read_text()
    assert "Data preparation" in report and "token total, exact" in report
    code, printed, err = run_main("train", [*arguments, "--dry-run"], capsys)
    assert code == 0, err
    assert "cached in" in printed and "exact profile of 5,000 records" in printed and "lengths from" not in printed
