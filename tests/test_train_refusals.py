"""No silent successes (issue 22): what cannot train, a resume of something else, and a resumed plan
that does not fit are each refused with one line and a non-zero exit."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import FakeClock, assert_one_line_error, pretend_interrupted, run_main


def long_prompt_chats(path: Path, count: int = 40) -> Path:
    """Chats whose assistant turns all start past token 200: `--max-length 64` keeps none of them."""
    with path.open("w") as handle:
        for index in range(count):
            messages = [
                {"role": "user", "content": f"question {index} " + "why " * 50},
                {"role": "assistant", "content": "because " * 4},
            ]
            handle.write(json.dumps({"messages": messages}) + "\n")
    return path


def test_a_max_length_that_leaves_no_trainable_token_is_refused(
    calibrated_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It planned "tokens: 0 real of 512,000 computed", trained at "loss 0.000, 0 tok/s, on track" and exited 0."""
    data = long_prompt_chats(tmp_path / "chats.jsonl")
    code, _, err = run_main(
        "train", ["--data", str(data), "--deadline", "10m", "--max-length", "64", "--effective-batch", "4"], capsys
    )
    assert_one_line_error(code, err, "--max-length 64 leaves 0 of ")
    line = next(line for line in err.splitlines() if line.startswith("error:"))
    assert "trainable tokens (0.0%; the loss is on assistant turns): 100.0% of samples are truncated" in line
    needed = int(re.search(r"--max-length (\d+) keeps 100\.0% of them", line).group(1))
    assert needed > 200
    assert not (calibrated_home / "runs").exists()
    # That length trains (the plan is made; a dry run stops there).
    code, out, err = run_main(
        "train",
        ["--data", str(data), "--deadline", "10m", "--max-length", str(needed), "--effective-batch", "4", "--dry-run"],
        capsys,
    )
    assert code == 0, err
    assert "tokens: 0 real" not in out


def test_a_resume_of_another_run_is_refused_unless_forced(
    calibrated_home: Path,
    heavy_tailed_jsonl: Path,
    tmp_path: Path,
    clock: FakeClock,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--resume with other data was accepted without a word; a resumed plan that did not fit said
    "DOES NOT fit" and trained on with exit 0. (The clock double keeps loading time out of the plan.)"""
    out = tmp_path / "run"
    common = ["--effective-batch", "4", "--max-length", "64", "--workers", "0", "--out", str(out), "--no-report"]
    code, _, err = run_main(
        "train", ["--data", str(heavy_tailed_jsonl), "--deadline", "30m", "--max-steps", "2", *common], capsys
    )
    assert code == 0, err
    run_id = json.loads((out / "run.json").read_text())["run_id"]
    pretend_interrupted(out, 6)
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"text": f"another sample {index} " * 20}) + "\n" for index in range(200)))
    resume = ["--deadline", "30m", "--max-steps", "6", "--resume", "--dry-run", *common]

    code, _, err = run_main("train", ["--data", str(other), *resume], capsys)
    assert_one_line_error(code, err, f"--resume: run {run_id} trained on {heavy_tailed_jsonl} (300 samples")
    assert f"not {other} (200 samples" in err and "or --force to continue on this data" in err
    code, _, err = run_main("train", ["--data", str(heavy_tailed_jsonl), "--model", "gpt2", *resume], capsys)
    assert_one_line_error(code, err, f"--resume: run {run_id} trained model tiny, this command names gpt2")
    code, _, err = run_main("train", ["--data", str(heavy_tailed_jsonl), "--lora", *resume], capsys)
    assert_one_line_error(code, err, "trained full fine-tuning, this command asks for LoRA rank 16")
    code, _, err = run_main(
        "train", ["--data", str(heavy_tailed_jsonl), *[a if a != "64" else "128" for a in resume]], capsys
    )
    assert_one_line_error(code, err, "trained with max length 64, this command asks for --max-length 128")

    code, out_text, err = run_main("train", ["--data", str(other), *resume, "--force"], capsys)
    assert code == 0, err
    assert "warning: --resume: run" in err and "resuming from step 2" in out_text

    # A resumed plan that does not fit is refused like a fresh one (exit 3), or follows --fit-deadline:
    # every step of the epoch left, in 3 s of which the overheads take 2.2 s.
    pretend_interrupted(out, 100000)  # every step of the epoch
    tight = ["--data", str(heavy_tailed_jsonl), "--deadline", "3s", "--resume", "--dry-run", *common]
    code, _, err = run_main("train", tight, capsys)
    assert_one_line_error(code, err, "the steps left need up to", expected_code=3)
    assert "--epochs" not in err and "--max-steps" in err
    code, out_text, err = run_main("train", [*tight, "--fit-deadline"], capsys)
    assert code == 0, err
    assert "--fit-deadline: limited to" in out_text


def test_a_lora_resume_matches_the_runs_resolved_targets_unless_others_are_named() -> None:
    """run.json keeps LoRA's targets as the module names they resolved to; `--lora` alone means the same."""
    from benchtrain.train.running.resume import same_method
    from benchtrain.train.workload.method import MethodConfig

    run = MethodConfig(method="lora", lora_rank=8, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    assert same_method(run, MethodConfig(method="lora", lora_rank=8))
    assert same_method(
        run, MethodConfig(method="lora", lora_rank=8, lora_targets=("v_proj", "q_proj", "o_proj", "k_proj"))
    )
    assert not same_method(run, MethodConfig(method="lora", lora_rank=8, lora_targets=("q_proj",)))
    assert not same_method(run, MethodConfig(method="lora", lora_rank=16))
    assert not same_method(run, MethodConfig())
