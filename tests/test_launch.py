"""Rent it and run it: `train --dry-run --emit skypilot:FILE|dstack:FILE` writes the task that runs
the plan on the recommended machine, the other rows that meet the deadline as ordered fallbacks,
each with its own plan; the engines' own parsers load it (where the `launch` extra is installed);
its run script starts `train` under torchrun from the engine's node variables on two "nodes" of
this machine; and `--resume auto` continues a run killed with -9 to the same steps and
learning-rate schedule as an uninterrupted one.

Nothing here rents a machine or reaches a cloud: the engines only parse the files."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from helpers import (
    FIXTURE,
    MACHINES,
    PRICES,
    assert_one_line_error,
    kill_nodes,
    node_variables,
    run_consider,
    run_main,
    start_nodes,
    synthetic_calibration,
    wait_nodes,
)

from benchtrain.calibration.hardware import Hardware
from benchtrain.calibration.schema import read_calibration_file
from benchtrain.calibration.store import save_calibration
from benchtrain.common.errors import BenchtrainError
from benchtrain.train.planning.rental import PROVISION_SECONDS, SETUP_SECONDS, max_duration, spot_choice
from benchtrain.train.running.checkpoint import MARKER_FILE, PROGRESS_FILE, list_checkpoints
from benchtrain.train.running.resume import resume_command, what_to_continue

RUN_JSON_BEFORE = Path(__file__).parent / "fixtures" / "run-json-before-42.json"  # an interrupted run

TWO_NODES = f"{MACHINES},h100:16:2x8:nvlink+ib"  # one row on two nodes: not a fallback of a one-node task


def emit(capsys: pytest.CaptureFixture[str], chats: Path, target: str, *more: str) -> tuple[int, str, str]:
    argv = [
        "--dry-run",
        "--deadline",
        "12h",
        "--model",
        "llama-3.2-1b",
        "--use-calibration",
        "h100-llama-3.2-1b",
        "--no-report",
    ]
    return run_main(
        "train",
        [*argv, "--consider", TWO_NODES, "--price-per-hour", PRICES, "--data", str(chats), "--emit", target, *more],
        capsys,
    )


def comments(path: Path) -> str:
    return "\n".join(line for line in path.read_text().splitlines() if line.startswith("#"))


def test_skypilot_task_has_the_rows_that_meet_the_deadline_in_order(
    home: Path, chats: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "task.yaml"
    code, out, err = emit(capsys, chats, f"skypilot:{path}", "--json")
    assert code == 0, err
    rows = json.loads(out)["rows"]
    one_node = [row for row in rows if row.get("meets_deadline") and "2x8" not in row["machine"]]
    task = yaml.safe_load(path.read_text())
    ordered = task["resources"]["ordered"]
    # The comparison's order, the recommended first; each GPU count as planned for that row.
    assert [row["machine"].split(" ")[0] for row in one_node] == ["1×H100", "1×H200", "2×H100", "4×A100"]
    assert [entry["accelerators"] for entry in ordered] == ["H100:1", "H200:1", "H100:2", "A100:4"]
    assert task["num_nodes"] == 1
    assert all(entry["disk_size"] >= 30 for entry in ordered)
    # Spot where one preemption still meets the deadline: a few minutes of work in 12 hours.
    assert all(entry["use_spot"] for entry in ordered) and task["resources"]["job_recovery"]["strategy"] == "FAILOVER"
    assert task["file_mounts"][str(chats)] == str(chats)  # the data, uploaded to the same path
    assert task["file_mounts"]["/benchtrain/run"]["mode"] == "MOUNT_CACHED"  # the run folder on a bucket
    # the benchtrain that made the plan: the wheel written beside the task, uploaded with it
    wheel = "/benchtrain/benchtrain-0.1.0-py3-none-any.whl"
    assert "benchtrain==" not in task["setup"] and wheel.removeprefix("/benchtrain") in task["setup"]
    assert wheel in task["file_mounts"]
    run = task["run"]
    for variable in ("SKYPILOT_NODE_IPS", "SKYPILOT_NUM_NODES", "SKYPILOT_NODE_RANK", "SKYPILOT_NUM_GPUS_PER_NODE"):
        assert variable in run
    branches = re.findall(r"^  ([a-z0-9-]+:\d+)\)$", run, re.MULTILINE)
    assert run.count('--resume auto --out "$ROOT"/run') == len(
        branches
    )  # every branch's train continues a restarted task
    assert branches[:4] == ["h100:1", "h200:1", "h100:2", "a100-40gb-pcie:4"]  # each target on its own card, in order
    assert "--use-calibration h100-llama-3.2-1b" in run  # measured: its calibration
    assert "BENCH=(run --gpu h200 --model llama-3.2-1b --budget" in run  # translated: measured on the node first
    assert {"h100-pcie:1", "h100-nvl:1", "h100-pcie:2", "h100-nvl:2"} <= set(branches)
    assert "--dry-run" not in run and "--emit" not in run
    said = comments(path)
    for words in (
        "shared (measured by someone else)",
        "translated from another GPU",
        "predicted from a 1-GPU calibration",
        "Capacity: spot:",
        "no cloud",
    ):
        assert words in said, words
    assert "left out: 16×H100 SXM" in said and "2 node(s), the task has 1" in said
    assert "10m00s assumed" in said and "Python environment" in said


def test_dstack_task_lists_the_gpus_of_one_count(
    home: Path, chats: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / ".dstack.yml"
    code, _, err = emit(capsys, chats, f"dstack:{path}")
    assert code == 0, err
    task = yaml.safe_load(path.read_text())
    assert task["type"] == "task" and task["nodes"] == 1 and task["shell"] == "bash"
    # the 1-GPU targets; 2 and 4 GPUs left out
    assert task["resources"]["gpu"] == {
        "name": ["H100", "H200"],
        "count": 1,
    }
    assert task["spot_policy"] == "auto" and task["retry"]["on_events"] == ["interruption", "no-capacity"]
    assert task["max_duration"].endswith("s") and int(task["max_duration"][:-1]) > SETUP_SECONDS
    assert task["files"][0] == {"local_path": str(chats), "path": str(chats)}
    assert task["files"][1]["path"] == "/benchtrain/benchtrain-0.1.0-py3-none-any.whl" and len(task["files"]) == 2
    assert task["volumes"][0]["path"] == "/benchtrain/run"
    script = task["commands"][1]
    for variable in ("DSTACK_MASTER_NODE_IP", "DSTACK_NODE_RANK", "DSTACK_NODES_NUM", "DSTACK_GPUS_PER_NODE"):
        assert variable in script
    assert "h100:2" not in script  # what dstack cannot hold is not planned for either
    assert "2×H100 SXM over nvlink: 2 GPUs per node" in comments(path)


@pytest.mark.parametrize("engine", ["skypilot", "dstack"])
def test_the_engines_own_code_loads_the_task(
    engine: str, home: Path, chats: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Offline, no account: SkyPilot's sky.Task.from_yaml (its JSON schema and resource checks),
    dstack's configuration model (pydantic). Skipped where the `launch` extra is not installed."""
    path = tmp_path / f"{engine}.yaml"
    code, _, err = emit(capsys, chats, f"{engine}:{path}")
    assert code == 0, err
    if engine == "skypilot":
        sky = pytest.importorskip("sky")
        task = sky.Task.from_yaml(str(path))
        assert task.num_nodes == 1
        assert [(resources.accelerators, resources.use_spot) for resources in task.resources] == [
            ({"H100": 1}, True),
            ({"H200": 1}, True),
            ({"H100": 2}, True),
            ({"A100": 4}, True),
        ]
        assert isinstance(task.resources, list)  # ordered: tried in turn
        assert "/benchtrain/run" in task.storage_mounts and task.file_mounts == {str(chats): str(chats)}
    else:
        pytest.importorskip("dstack")
        from dstack._internal.core.models.configurations import TaskConfiguration, parse_run_configuration

        configuration = parse_run_configuration(yaml.safe_load(path.read_text()))
        assert isinstance(configuration, TaskConfiguration) and configuration.nodes == 1
        assert configuration.resources.gpu.name == ["H100", "H200"] and configuration.spot_policy.value == "auto"
        assert configuration.max_duration > SETUP_SECONDS and configuration.volumes[0].path == "/benchtrain/run"


def test_each_task_has_a_run_folder_of_its_own_named_per_plan(
    home: Path, chats: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Two tasks for the same model, one on other data: each names its bucket (or volume) after the model, the data's
    fingerprint, the deadline's start and a random part, so the second never finds the first's run.json. Every name is a
    valid S3 and GCS bucket name and a valid dstack resource name."""
    other = tmp_path / "other.jsonl"
    other.write_text(chats.read_text().replace("Measure first.", "Plan later."))
    names = []
    for data in (chats, chats, other):
        for engine in ("skypilot", "dstack"):
            path = tmp_path / f"{engine}.yaml"
            code, _, err = run_main(
                "train",
                [
                    "--dry-run",
                    "--deadline",
                    "12h",
                    "--model",
                    "llama-3.2-1b",
                    "--use-calibration",
                    "h100-llama-3.2-1b",
                    "--data",
                    str(data),
                    "--emit",
                    f"{engine}:{path}",
                ],
                capsys,
            )
            assert code == 0, err
            task = yaml.safe_load(path.read_text())
            storage = (
                task["file_mounts"]["/benchtrain/run"]["name"] if engine == "skypilot" else task["volumes"][0]["name"]
            )
            assert storage == f"{task['name']}-run"
            bucket_rule = r"^[a-z0-9][a-z0-9-]{1,61}[a-z0-9]$"
            assert re.match(bucket_rule, storage) and "goog" not in storage, storage
            assert re.match(r"^[a-z][a-z0-9-]{1,40}$", storage), storage  # dstack's resource names
            assert "llama-3-2-1b" in storage
            names.append(storage)
    assert len(set(names)) == len(names)  # each emit its own (the random part)
    data_part = [name.split("-")[-4] for name in names]
    assert data_part[0] == data_part[2] != data_part[4]  # the data's fingerprint differs with the data


def test_the_hub_token_reaches_the_nodes_as_a_reference_never_a_value(
    home: Path, chats: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A push to the hub (or a gated model) needs HF_TOKEN on every node: SkyPilot's `secrets` with no value, dstack's
    `env` with the name only; the token itself is never written into the file. A data path with a colon: dstack's
    mapping form (its short form splits at every colon)."""
    monkeypatch.setenv("HF_TOKEN", "hf_secretvalue123")
    colon = tmp_path / "data:v2"
    colon.mkdir()
    data = colon / "chats.jsonl"
    data.write_text(chats.read_text())
    for engine in ("skypilot", "dstack"):
        path = tmp_path / f"{engine}.yaml"
        code, _, err = emit(capsys, data, f"{engine}:{path}", "--push-to-hub", "my-org/tuned")
        assert code == 0, err
        text = path.read_text()
        assert "hf_secretvalue123" not in text
        task = yaml.safe_load(text)
        if engine == "skypilot":
            assert task["secrets"] == {"HF_TOKEN": None} and "--secret HF_TOKEN" in text
        else:
            assert task["env"] == ["HF_TOKEN"]
            assert {"local_path": str(data), "path": str(data)} in task["files"]
            dstack = pytest.importorskip("dstack")
            assert dstack is not None
            from dstack._internal.core.models.configurations import parse_run_configuration

            configuration = parse_run_configuration(task)
            assert next((one.local_path, one.path) for one in configuration.files) == (str(data), str(data))
            assert "HF_TOKEN" in configuration.env
    code, _, err = emit(capsys, chats, f"dstack:{tmp_path / 'public.yaml'}")
    assert code == 0, err
    assert "env" not in yaml.safe_load((tmp_path / "public.yaml").read_text())  # nothing asked of a public preset


def test_the_nodes_bench_takes_the_model_as_the_user_gave_it(
    home: Path, chats: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A model in a local folder (its name with a quote): the bench a node runs first names that folder, not the model's
    short name, which no node could resolve."""
    from benchtrain.train.workload.model import resolve_model
    from benchtrain.train.workload.tokenizer import byte_tokenizer

    folder = tmp_path / "my model's"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(resolve_model("llama-3.2-1b").config_dict))
    byte_tokenizer().save_pretrained(str(folder))
    path = tmp_path / "task.yaml"
    argv = ["--dry-run", "--deadline", "12h", "--model", str(folder), "--use-calibration", "h100-llama-3.2-1b"]
    code, _, err = run_main(
        "train", [*argv, "--consider", MACHINES, "--data", str(chats), "--emit", f"skypilot:{path}"], capsys
    )
    assert code == 0, err
    task = yaml.safe_load(path.read_text())
    benches = [line for line in task["run"].splitlines() if line.strip().startswith("BENCH=(run")]
    assert benches, task["run"]
    for line in benches:
        words = shlex.split(line.strip()[len("BENCH=(") : -1])
        assert words[words.index("--model") + 1] == str(folder)


def test_abbreviated_and_dry_run_only_options_never_reach_the_nodes(
    home: Path, chats: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`--dry` (argparse's abbreviation of --dry-run), `--ou` (of --out) and --for-trainer are the dry run's: the node's
    train command has none of them, and its own --out once."""
    path = tmp_path / "task.yaml"
    argv = ["--dry", "--for-trainer", "--deadline", "12h", "--model", "llama-3.2-1b", "--ou", str(tmp_path / "here")]
    code, _, err = run_main(
        "train",
        [*argv, "--use-calibration", "h100-llama-3.2-1b", "--data", str(chats), "--emit", f"skypilot:{path}"],
        capsys,
    )
    assert code == 0, err
    run = yaml.safe_load(path.read_text())["run"]
    trains = [line.strip() for line in run.splitlines() if line.strip().startswith("TRAIN=(")]
    assert trains
    for train in trains:
        words = shlex.split(train[len("TRAIN=(") : -1])
        assert not {"--dry", "--dry-run", "--for-trainer", "--ou"} & set(words), words
        assert words.count("--out") == 1 and str(tmp_path / "here") not in words


FAKE_PYTHON = """#!/bin/bash
# What the run script asks of python on a node: the card it landed on, and torchrun's command lines, logged.
if [ "$1" = "-c" ]; then echo "$FAKE_CARD"; exit 0; fi
echo "$*" >> "$FAKE_LOG"
"""


def test_a_fallback_card_benches_itself_and_plans_from_its_own_calibration(
    home: Path, chats: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The emitted run script on an H100 PCIe, rented for an H100 SXM row measured elsewhere (train refuses a calibration
    of another card): it benches the PCIe first, even though the run (its run.json) is already there from the SXM, then
    trains planning from `latest`; started again on the same card, it does not bench again."""
    path = tmp_path / "task.yaml"
    code, _, err = emit(capsys, chats, f"skypilot:{path}")
    assert code == 0, err
    script = tmp_path / "run.sh"
    script.write_text(yaml.safe_load(path.read_text())["run"])
    bin_dir, log, root = tmp_path / "bin", tmp_path / "python.log", tmp_path / "root"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(FAKE_PYTHON)
    (bin_dir / "python").chmod(0o755)
    (root / "run").mkdir(parents=True)
    (root / "run" / "run.json").write_text(json.dumps({"status": "interrupted"}))  # the SXM's run, preempted
    environment = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "BENCHTRAIN_TASK_ROOT": str(root),
        "FAKE_CARD": "h100-pcie",
        "FAKE_LOG": str(log),
        **node_variables("skypilot", 0),
        "SKYPILOT_NUM_NODES": "1",
        "SKYPILOT_NUM_GPUS_PER_NODE": "1",
    }
    for _ in range(2):
        done = subprocess.run(["bash", str(script)], env=environment, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    benches, trains = [], []
    for line in log.read_text().splitlines():
        (benches if " -m benchtrain.bench " in line else trains).append(line)
    assert len(benches) == 1 and "--gpu h100-pcie" in benches[0]  # once: the second start finds it measured
    assert len(trains) == 2 and all("--use-calibration latest" in line for line in trains)
    assert "h100-llama-3.2-1b" not in " ".join(trains)  # the SXM's calibration, which train refuses here


def test_train_takes_the_calibration_of_its_own_card(home: Path, tmp_path: Path) -> None:
    """`latest` prefers a calibration measured on this card over a newer one of the same run on another card; a resume
    planned with another card's calibration replans with this card's (a fallback took over) instead of refusing."""
    from benchtrain.calibration import load as load_reference
    from benchtrain.train.recipes.choice import calibration_preferences, load_calibration
    from benchtrain.train.running.resume import PlannedCalibration
    from benchtrain.train.step.hardware import detect_hardware, this_device
    from benchtrain.train.workload.method import MethodConfig
    from benchtrain.train.workload.model import resolve_model

    spec, method = resolve_model("tiny"), MethodConfig()
    model = {"name": "tiny", "parameter_count": 1, "fingerprint": spec.fingerprint}
    other_card = {**detect_hardware(), "name": "NVIDIA H100 PCIe", "device_type": "cuda"}
    save_calibration(synthetic_calibration(hardware=detect_hardware(), model=model, id="this-card"))
    save_calibration(
        synthetic_calibration(hardware=other_card, model=model, id="other-card", created_at="2030-01-01T00:00:00+00:00")
    )
    here = this_device()
    preferences = calibration_preferences(spec, method, (1, "none"), None, here.name)
    assert load_reference("latest", None, preferences).id == "this-card"
    assert load_reference("latest", None, calibration_preferences(spec, method, (1, "none"))).id == "other-card"

    config = SimpleNamespace(plan=SimpleNamespace(use_calibration="this-card"), force=False)
    planned = PlannedCalibration("other-card", None, ("other-card",))
    chosen = load_calibration(config, planned, spec, method, (1, "none"), None, here)  # type: ignore[arg-type]
    assert chosen.id == "this-card"
    mine = PlannedCalibration("this-card", None, ("this-card",))  # planned here: another is still refused
    config.plan.use_calibration = "other-card"
    with pytest.raises(BenchtrainError, match="planned with calibration this-card, not other-card"):
        load_calibration(config, mine, spec, method, (1, "none"), None, here)  # type: ignore[arg-type]


SKYPILOT_SCHEMA = Path(__file__).parent / "fixtures" / "skypilot-task-schema.json"


def test_the_skypilot_task_holds_skypilots_published_schema(
    home: Path, chats: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Where SkyPilot cannot be imported (its click pin conflicts with huggingface-hub's, so CI has
    it not), the task is checked against SkyPilot 0.14.1's own task schema
    (sky.utils.schemas.get_task_schema(), dumped into the fixture), as sky.Task.from_yaml checks it first."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(SKYPILOT_SCHEMA.read_text())["schema"]
    path = tmp_path / "skypilot.yaml"
    code, _, err = emit(capsys, chats, f"skypilot:{path}")
    assert code == 0, err
    task = yaml.safe_load(path.read_text())
    jsonschema.validate(task, schema)
    assert [entry["accelerators"] for entry in task["resources"]["ordered"]][:2] == ["H100:1", "H200:1"]
    broken = {**task, "num_nodes": "two"}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


# The accelerator names the emitted tasks have always used, by datasheet key: a datasheet row's launch name must not
# change what an existing task rents.
LAUNCH_NAMES_EMITTED = {
    "h100": "H100",
    "h100-pcie": "H100",
    "h100-nvl": "H100",
    "gh200": "GH200",
    "h200": "H200",
    "h200-nvl": "H200",
    "b200": "B200",
    "a100-40gb": "A100",
    "a100-40gb-pcie": "A100",
    "a100-80gb": "A100-80GB",
    "a100-80gb-pcie": "A100-80GB",
    "l40s": "L40S",
    "l40": "L40",
    "a10g": "A10G",
    "l4": "L4",
    "4090": "RTX4090",
    "mi300x": "MI300X",
}


def test_every_datasheet_gpu_has_a_launch_name_and_the_tasks_name_the_same_accelerators() -> None:
    """A GPU is added in one table (calibration.datasheets): its launch name is a column there, --emit reads it, and the
    run script's device check accepts every card rented under that name, the one the bare name means first."""
    from benchtrain.calibration.datasheets import SHEETS, sheet_for
    from benchtrain.train.recipes.launch_task import Target, accelerator_of, with_card_benches
    from benchtrain.train.workload.method import MethodConfig

    assert all(sheet.launch_name for sheet in SHEETS)
    for sheet in SHEETS:
        meant = sheet_for(sheet.launch_name)
        assert meant is not None and meant.launch_name == sheet.launch_name, sheet.launch_name
    cuda = Hardware("cuda", "", 1, 0)
    assert {sheet.key: accelerator_of(sheet.key, cuda) for sheet in SHEETS} == LAUNCH_NAMES_EMITTED
    assert accelerator_of("cpu", Hardware("cpu", "", 1, 0)) is None
    with pytest.raises(BenchtrainError, match="NVIDIA RTX A6000 has no accelerator name the engines know"):
        accelerator_of("rtx-a6000", Hardware("cuda", "NVIDIA RTX A6000", 1, 0))

    def pattern(key: str) -> str:
        fields: dict[str, Any] = dict.fromkeys(Target.__dataclass_fields__)
        row = SimpleNamespace(settle_arguments=("run", "--gpu", key))
        fields.update(row=row, device_key=key, accelerator=LAUNCH_NAMES_EMITTED[key], gpus_per_node=2, card_benches=())
        target = with_card_benches(Target(**fields), "m", MethodConfig())
        for bench in target.card_benches:  # each other card measured by its own bench
            assert bench.arguments == ("run", "--gpu", bench.card)
        return "|".join(f"{card}:2" for card in [key, *(bench.card for bench in target.card_benches)])

    # The cards the run scripts accept: the target's own, then its family as the bare name means it, each its own branch.
    assert pattern("h100") == "h100:2|h100-pcie:2|h100-nvl:2"
    assert pattern("h100-nvl") == "h100-nvl:2|h100:2|h100-pcie:2"
    assert pattern("h200-nvl") == "h200-nvl:2|h200:2"
    assert pattern("a100-40gb-pcie") == "a100-40gb-pcie:2|a100-40gb:2"
    assert pattern("a100-80gb") == "a100-80gb:2|a100-80gb-pcie:2"
    assert pattern("l4") == "l4:2"


def test_bad_emits_are_one_line(
    home: Path, chats: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code, _, err = emit(capsys, chats, "kubernetes:task.yaml")
    assert_one_line_error(code, err, "--emit 'kubernetes:task.yaml': ENGINE:FILE with ENGINE one of skypilot, dstack")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, _, err = emit(capsys, chats, f"skypilot:{blocker}/task.yaml")
    assert_one_line_error(code, err, f"--emit: cannot write {blocker}/task.yaml")
    assert not (tmp_path / "task.yaml").exists()
    monkeypatch.chdir(chats.parent)
    argv = [
        "--dry-run",
        "--deadline",
        "12h",
        "--model",
        "llama-3.2-1b",
        "--use-calibration",
        "h100-llama-3.2-1b",
        "--no-report",
        "--emit",
        "skypilot:t.yaml",
    ]
    code, _, err = run_main("train", [*argv, "--data", chats.name], capsys)
    assert_one_line_error(
        code, err, f"--emit: --data {chats.name} is a relative local path no node can see: give it as an absolute path"
    )
    assert not (chats.parent / "t.yaml").exists()
    # A row that cannot run: none meets the deadline at its upper end.
    code, _, err = emit(capsys, chats, f"skypilot:{tmp_path / 'late.yaml'}", "--deadline", "20s")
    assert (
        code == 3
        and len([line for line in err.splitlines() if line.startswith("error:")]) == 1
        and "Traceback" not in err
    )
    assert not (tmp_path / "late.yaml").exists()
    code, _, err = run_main(
        "train", ["--deadline", "1h", "--data", str(chats), "--emit", f"skypilot:{tmp_path / 'x.yaml'}"], capsys
    )
    assert_one_line_error(code, err, "which is a dry run: add --dry-run")


def test_spot_only_where_one_preemption_still_meets_the_deadline() -> None:
    comparison = run_consider("h100:1", [read_calibration_file(FIXTURE)])
    plan = comparison.recommended.run_plan.plan
    chosen = plan.chosen
    overheads = chosen.overheads
    startup = (
        overheads.model_build_seconds
        + overheads.warmup_seconds
        + overheads.compile_seconds
        + overheads.data_prep_seconds
    )
    training = chosen.total_seconds_promised - chosen.overheads.total_seconds
    interval = 600.0
    restart = min(interval, training) + PROVISION_SECONDS + startup
    roomy = spot_choice(plan, chosen.total_seconds_promised + restart + 1, interval)
    assert roomy.use and roomy.restart_seconds == pytest.approx(restart)
    tight = spot_choice(plan, chosen.total_seconds_promised + restart - 1, interval)
    assert not tight.use and tight.reason.startswith(
        "on-demand: with one preemption priced in it would miss the deadline"
    )
    # The lost work is at most one checkpoint interval: a shorter cadence makes room for spot.
    assert spot_choice(plan, chosen.total_seconds_promised + restart - 1, interval / 2).use == (
        min(interval / 2, training) < min(interval, training)
    )
    duration = max_duration(chosen.total_seconds_promised, roomy, 12 * 3600)
    assert duration.seconds == pytest.approx((chosen.total_seconds_promised + restart) * 1.2 + SETUP_SECONDS)
    assert "at most the deadline" in duration.basis
    capped = max_duration(chosen.total_seconds_promised, tight, chosen.total_seconds_promised).seconds
    assert capped == pytest.approx(chosen.total_seconds_promised + SETUP_SECONDS)  # never past the deadline (+ setup)


def test_resume_auto_finds_a_complete_checkpoint(
    tmp_path: Path, home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    own_start = time.monotonic()
    # nothing there: start
    fresh = what_to_continue("auto", str(out), False, own_start)
    assert (fresh.resuming, fresh.budget_used, fresh.out_dir) == (False, 0.0, out)
    out.mkdir()
    started = time.time() - 3600.0
    record = {**json.loads(RUN_JSON_BEFORE.read_text()), "deadline_started_at": started}
    (out / "run.json").write_text(json.dumps(record))
    partial = out / "checkpoints" / "step-0000004"
    partial.mkdir(parents=True)  # being written when the machine went: no marker
    (partial / PROGRESS_FILE).write_text(json.dumps({"step": 4}))
    # No complete checkpoint: the run starts again, its deadline still counted from its first start (an hour went).
    started_again = what_to_continue("auto", str(out), False, own_start)
    assert not started_again.resuming and started_again.budget_used == pytest.approx(3600.0, abs=60.0)
    (partial / MARKER_FILE).write_text("")
    found = what_to_continue("auto", str(out), False, own_start)
    assert found.resuming and found.completed == 4 and found.checkpoints == (partial,)
    assert found.budget_used == pytest.approx(3600.0, abs=60.0)
    # The same command after the run ended (an engine restarting a finished task): nothing to do, exit 0.
    (out / "run.json").write_text(json.dumps({"deadline_started_at": started, "status": "completed"}))
    code, _, err = run_main(
        "train", ["--data", "sample", "--deadline", "2h", "--resume", "auto", "--out", str(out)], capsys
    )
    assert code == 0 and "already ended (completed)" in err and "nothing to resume" in err
    command = resume_command(["--data", "x", "--deadline", "2h", "--resume", "auto", "--out", str(out)], out, 2)
    assert command is not None and command.endswith(f"--resume auto --out {out}")
    assert command.count("--resume") == 1 and " auto " not in command.replace("--resume auto", "")


# -- two nodes on this machine, and a kill -9 ----------------------------------------------


def two_node_calibration(home: Path) -> None:
    """A 2-process CPU calibration over ethernet (one process per node), as `bench run` under two
    torchrun agents with `--interconnect ethernet` would store it."""
    from benchtrain.train.step.hardware import detect_hardware
    from benchtrain.train.workload.model import resolve_model

    hardware = {**detect_hardware(), "interconnect": "ethernet"}
    model = {"name": "tiny", "parameter_count": 1, "fingerprint": resolve_model("tiny").fingerprint}
    save_calibration(
        synthetic_calibration(
            hardware=hardware,
            model=model,
            distributed={"world_size": 2, "sharding": "ddp", "backend": "gloo"},
            id="two-nodes",
        )
    )


def emitted_script(
    capsys: pytest.CaptureFixture[str], data: Path, folder: Path, *options: str
) -> tuple[Path, dict[str, Any]]:
    """The run script of the SkyPilot task a dry run emits for the 2-node calibration, and its plan."""
    task = folder / "task.yaml"
    argv = [
        "--dry-run",
        "--json",
        "--use-calibration",
        "two-nodes",
        "--data",
        str(data),
        "--deadline",
        "30m",
        "--effective-batch",
        "4",
        *options,
    ]
    code, out, err = run_main("train", [*argv, "--emit", f"skypilot:{task}"], capsys)
    assert code == 0, err
    loaded = yaml.safe_load(task.read_text())
    assert loaded["num_nodes"] == 2 and loaded["resources"]["cpus"] == "4+"
    script = folder / "run.sh"
    script.write_text(loaded["run"])
    return script, json.loads(out)


def mounted(home: Path, root: Path) -> None:
    """What the task's file_mounts put on every node: the calibration it names."""
    (root / "calibrations").mkdir(parents=True, exist_ok=True)
    (root / "calibrations" / "two-nodes.json").write_text((home / "calibrations" / "two-nodes.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_nodes_train_from_the_emitted_script_and_survive_a_kill(
    home: Path, heavy_tailed_jsonl: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Two torchrun agents (--nnodes 2, --node_rank 0|1, one gloo process each) run the emitted run
    script with SkyPilot's variables: rank 0 on node 0 plans, checkpoints and reports, once; the
    plan run is the 2-node plan the dry run made. Then the same task killed with -9 mid-way on both
    nodes and started again continues from its last complete checkpoint and ends with the steps
    and learning rates of the uninterrupted run."""
    two_node_calibration(home)
    steps = ["--max-steps", "12", "--checkpoint-interval", "0.2s", "--keep-checkpoints", "2"]
    script, planned = emitted_script(capsys, heavy_tailed_jsonl, tmp_path, *steps)
    chosen = planned["plan"]["chosen"]
    assert planned["world_size"] == 2 and chosen["world_size"] == 2

    whole = tmp_path / "whole"
    mounted(home, whole)
    wait_nodes(start_nodes(script, whole, tmp_path / "logs-whole"), tmp_path / "logs-whole")
    record = json.loads((whole / "run" / "run.json").read_text())
    plan = record["plan"]
    assert (plan["world_size"], plan["sharding"]) == (2, "ddp")
    assert (plan["configuration"]["micro_batch_size"], plan["configuration"]["grad_accum"]) == (
        chosen["micro_batch_size"],
        chosen["grad_accum"],
    )
    assert [entry["step"] for entry in record["losses"]] == list(range(1, 13)) and record["status"] == "step_limit"
    logs = tmp_path / "logs-whole"
    outputs = [(logs / f"node{rank}.out").read_text() for rank in (0, 1)]
    assert "run folder:" in outputs[0] and outputs[1].strip() == ""  # rank 0 is on node 0; node 1 says nothing
    assert outputs[0].count("report:") == 1 and (whole / "run" / "report.html").is_file()
    # --keep-checkpoints 2 and one writer: at most two, the last at step 12 (how many a 0.2-s interval
    # makes depends on the machine's speed: beside two CPU hogs the 12 steps fit in one interval).
    kept = sorted(path.name for path in (whole / "run" / "checkpoints").iterdir())
    assert 1 <= len(kept) <= 2 and kept[-1] == "step-0000012"

    killed = tmp_path / "killed"
    mounted(home, killed)
    nodes = start_nodes(script, killed, tmp_path / "logs-killed")
    checkpoints = killed / "run" / "checkpoints"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not list_checkpoints(checkpoints):
        time.sleep(0.02)
    kill_nodes(nodes)
    interrupted = json.loads((killed / "run" / "run.json").read_text())
    last = int(list_checkpoints(checkpoints)[-1].name.split("-")[1])
    assert interrupted["status"] != "step_limit" and last < 12, "the run finished before it was killed"
    wait_nodes(start_nodes(script, killed, tmp_path / "logs-again"), tmp_path / "logs-again")
    resumed = json.loads((killed / "run" / "run.json").read_text())
    assert resumed["resumed"] == 1 and resumed["status"] == "step_limit"
    assert [entry["step"] for entry in resumed["losses"]] == list(range(1, 13))
    assert [entry["learning_rate"] for entry in resumed["losses"]] == pytest.approx(
        [entry["learning_rate"] for entry in record["losses"]]
    )
    assert resumed["plan"]["total_steps"] == record["plan"]["total_steps"] == 12
    assert [entry["loss"] for entry in resumed["losses"]] == pytest.approx(
        [entry["loss"] for entry in record["losses"]], rel=1e-4
    )
    # The deadline stayed the first start's: the restart counted the time the kill lost.
    assert resumed["deadline_started_at"] == pytest.approx(interrupted["deadline_started_at"], abs=1.0)


def test_a_shared_calibrations_strings_never_leave_their_comment_line(
    home: Path, chats: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A calibration someone shared names its device, its software and its request in free text. Each of those strings
    here carries a line break (in the kinds bash and YAML read as one) and a command substitution: the emitted task and
    its run script keep each inside its comment, so neither bash on the rented node nor the engine runs it."""
    bundled = Path(__file__).parents[1] / "benchtrain" / "calibration" / "bundled" / "h100-llama-3.2-1b.json"
    data = json.loads(bundled.read_text())
    breaks = ["\n", "\r", "\u2028", "\x85"]

    def hostile(text: str, index: int) -> str:
        return f"{text}{breaks[index % len(breaks)]}name: $(touch PWNED){breaks[(index + 1) % len(breaks)]}#"

    for index, key in enumerate(("name", "compute_capability", "cuda_version")):
        data["hardware"][key] = hostile(str(data["hardware"][key]), index)
    for index, key in enumerate(sorted(data["software"])):
        data["software"][key] = hostile(str(data["software"][key]), index)
    data["requested_device"] = hostile(str(data["requested_device"]), 1)
    shared = tmp_path / "shared.json"
    shared.write_text(json.dumps(data))
    for engine in ("skypilot", "dstack"):
        path = tmp_path / f"{engine}.yaml"
        argv = ["--dry-run", "--use-calibration", str(shared), "--force", "--model", "llama-3.2-1b"]
        code, _, err = run_main(
            "train", [*argv, "--data", str(chats), "--deadline", "12h", "--emit", f"{engine}:{path}"], capsys
        )
        assert code == 0, err
        text = path.read_text()
        assert "touch PWNED" in text  # the device's words are still said, in a comment
        loaded = yaml.safe_load(text)
        script = loaded["run"] if engine == "skypilot" else "\n".join(loaded["commands"])
        for document in (text, script):
            for line in document.splitlines():
                assert "PWNED" not in line or line.lstrip().startswith("#"), line
        assert "PWNED" not in json.dumps(
            {key: value for key, value in loaded.items() if key not in ("run", "commands")}
        )
