"""benchtrain from where a user stands: their own folder, which holds a `train.py` (the most common
name of a fine-tuning script) beside a `bench.py`, `common.py`, `reports.py` and `calibration.py`.
Python puts that folder first on `sys.path`, so each of those files would stand in for a top-level
package of the same name. benchtrain installs one package, `benchtrain`, and the three commands:
nothing of the user's is imported in its place, under plain `python`, `python -m` or torchrun.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "cpu-tiny-fullgrid.json"

# A file of the user's that is imported as a module (not run as their script) says so and stops.
DECOY = 'raise SystemExit("the user\'s {name}.py was imported in place of a package of benchtrain")\n'

# The user's own script: a two-layer llama from a config, token ids made here (no hub), the
# Trainer with DeadlineCallback. Imported as a module instead of run, it stops at once.
USER_TRAIN = """
import json
import sys

if __name__ != "__main__":
    raise SystemExit("the user's train.py was imported in place of a package of benchtrain")

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from benchtrain import DeadlineCallback


def collate(rows):
    longest = max(len(row["input_ids"]) for row in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for index, row in enumerate(rows):
        ids[index, : len(row["input_ids"])] = torch.tensor(row["input_ids"])
        mask[index, : len(row["input_ids"])] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


torch.manual_seed(0)
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
rows = [{"input_ids": [1 + (index * 7 + position) % 60 for position in range(8 + index % 9)]} for index in range(32)]
out = sys.argv[1]
arguments = TrainingArguments(output_dir=out, per_device_train_batch_size=4, max_steps=4, logging_steps=1, save_strategy="no",
                              report_to=[], use_cpu=True, dataloader_num_workers=0)
callback = DeadlineCallback(deadline="1h", report=False)
trainer = Trainer(model=LlamaForCausalLM(config), args=arguments, train_dataset=rows, data_collator=collate, callbacks=[callback])
trainer.train()
print(json.dumps({"steps": trainer.state.global_step}))
"""


def user_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "my-project"
    folder.mkdir()
    (folder / "train.py").write_text(USER_TRAIN)
    for name in ("bench", "common", "reports", "calibration"):
        (folder / f"{name}.py").write_text(DECOY.format(name=name))
    return folder


def user_environment(home: Path) -> dict[str, str]:
    """The user's shell: benchtrain installed, nothing of this repository on PYTHONPATH."""
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return {**environment, "BENCHTRAIN_HOME": str(home), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.mark.slow
def test_the_users_own_train_py_imports_benchtrain_and_trains_with_the_callback(tmp_path: Path) -> None:
    folder = user_folder(tmp_path)
    done = subprocess.run(
        [sys.executable, "train.py", str(tmp_path / "out")],
        cwd=folder,
        env=user_environment(tmp_path / "home"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"steps": 4}
    record = json.loads((tmp_path / "out" / "benchtrain" / "run.json").read_text())
    assert record["status"] == "completed" and record["actual"]["steps"] == 4


@pytest.mark.slow
def test_the_readmes_multi_process_train_runs_from_the_users_folder(tmp_path: Path) -> None:
    """The README's `… -m benchtrain.train …` line under torchrun with 2 processes (gloo), started in
    the folder whose train.py, bench.py and common.py would stand in for a top-level package."""
    folder = user_folder(tmp_path)
    out = tmp_path / "run"
    # A copy: train feeds the run's speed back into the calibration it planned with.
    calibration = tmp_path / FIXTURE.name
    shutil.copy2(FIXTURE, calibration)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "benchtrain.train", "--use-calibration", str(calibration), "--force", "--data", "sample",
        "--deadline", "1h", "--max-steps", "2", "--out", str(out), "--no-report",
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=folder, env=user_environment(tmp_path / "home"), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    record = json.loads((out / "run.json").read_text())
    assert record["plan"]["world_size"] == 2 and record["actual"]["steps"] == 2
    assert (out / "final" / "config.json").is_file()


@pytest.mark.slow
def test_a_wheel_installs_one_package_and_the_three_commands(tmp_path: Path) -> None:
    """The wheel built from the repository holds `benchtrain/` and its metadata, nothing at the top
    level beside it, and the commands bench, train and report."""
    pytest.importorskip("setuptools")
    tracked = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split("\0")
    source = tmp_path / "source"
    for name in filter(None, tracked):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(tmp_path / "wheel"),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    [wheel] = (tmp_path / "wheel").glob("benchtrain-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert tops == {"benchtrain", next(top for top in tops if top.endswith(".dist-info"))}
    for module in (
        "benchtrain/__init__.py",
        "benchtrain/bench/cli.py",
        "benchtrain/train/cli.py",
        "benchtrain/reports/cli.py",
        "benchtrain/trainer/callback.py",
    ):
        assert module in names
    assert (
        "benchtrain/train/sample_data/sample.jsonl" in names
        and "benchtrain/calibration/bundled/h100-llama-3.2-1b.json" in names
    )
    assert not [name for name in names if "__pycache__" in name or name.endswith(".pyc")]
    entry_points = next(name for name in names if name.endswith("entry_points.txt"))
    scripts = zipfile.ZipFile(wheel).read(entry_points).decode()
    commands = dict(
        line.split(" = ") for line in scripts.split("[console_scripts]")[1].strip().splitlines() if " = " in line
    )
    assert commands == {
        "bench": "benchtrain.bench.cli:entry_point",
        "train": "benchtrain.train.cli:entry_point",
        "report": "benchtrain.reports.cli:entry_point",
    }
