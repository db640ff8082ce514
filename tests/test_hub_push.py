"""`--push-to-hub`: checked before any training step, final/ and a model card sent after, the upload
priced in the plan, a failure that keeps final/ and says the retry. The hub's HTTP side is replaced
at huggingface_hub's own API object (HfApi), so what would be sent is what these tests read."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import assert_one_line_error, run_main

from benchtrain.common.errors import EXIT_PUSH_FAILED
from benchtrain.train.step.step import TrainingStep


class FakeHub:
    """HfApi's calls as the hub would receive them; `fail`: what upload_folder raises."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.sent: dict[str, bytes] = {}
        self.fail: Exception | None = None
        self.whoami_error: Exception | None = None

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from huggingface_hub import HfApi

        hub = self

        def whoami(self: HfApi, token: Any = None, **_: Any) -> dict[str, Any]:
            hub.calls.append(("whoami", {"token": token}))
            if hub.whoami_error is not None:
                raise hub.whoami_error
            return {"name": "tester"}

        def create_repo(self: HfApi, repo_id: str, **kwargs: Any) -> str:
            hub.calls.append(("create_repo", {"repo_id": repo_id, **kwargs}))
            return f"https://huggingface.co/{repo_id}"

        def create_branch(self: HfApi, repo_id: str, **kwargs: Any) -> None:
            hub.calls.append(("create_branch", {"repo_id": repo_id, **kwargs}))

        def upload_folder(self: HfApi, **kwargs: Any) -> Any:
            hub.calls.append(("upload_folder", kwargs))
            if hub.fail is not None:
                raise hub.fail
            folder = Path(kwargs["folder_path"])
            hub.sent = {
                str(path.relative_to(folder)): path.read_bytes() for path in folder.rglob("*") if path.is_file()
            }
            return type("CommitInfo", (), {"commit_url": f"https://huggingface.co/{kwargs['repo_id']}/commit/abc"})()

        for name, method in {
            "whoami": whoami,
            "create_repo": create_repo,
            "create_branch": create_branch,
            "upload_folder": upload_folder,
        }.items():
            monkeypatch.setattr(HfApi, name, method)

    def called(self, name: str) -> list[dict[str, Any]]:
        return [kwargs for call, kwargs in self.calls if call == name]


@pytest.fixture()
def hub(monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    fake = FakeHub()
    fake.install(monkeypatch)
    return fake


def train_args(data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--data",
        str(data),
        "--deadline",
        "30m",
        "--effective-batch",
        "4",
        "--max-steps",
        "3",
        "--no-report",
        "--out",
        str(out),
        *extra,
    ]


def digest(folder: Path) -> dict[str, str]:
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def test_a_lora_run_pushes_its_adapter_tokenizer_and_a_model_card(
    calibrated_home: Path, heavy_tailed_jsonl: Path, tmp_path: Path, hub: FakeHub, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    argv = train_args(
        heavy_tailed_jsonl,
        out,
        "--lora",
        "--force",
        "--push-to-hub",
        "my-org/tiny-chat",
        "--hub-private",
        "--hub-revision",
        "v1",
    )
    code, stdout, err = run_main("train", argv, capsys)
    assert code == 0, err
    record = json.loads((out / "run.json").read_text())
    # The token was checked before the run, then the repository made private, the branch, the upload.
    assert [call for call, _ in hub.calls] == ["whoami", "create_repo", "create_branch", "upload_folder"]
    assert hub.called("whoami")[0]["token"] == "hf_test_token"
    assert hub.called("create_repo")[0]["private"] is True
    assert hub.called("create_branch")[0]["branch"] == "v1"
    upload = hub.called("upload_folder")[0]
    assert (
        upload["repo_id"] == "my-org/tiny-chat"
        and upload["revision"] == "v1"
        and Path(upload["folder_path"]) == out / "final"
    )
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer_config.json", "README.md"} <= set(hub.sent)
    card = hub.sent["README.md"].decode()
    assert "library_name: peft" in card and "base_model: tiny" in card
    assert record["calibration_id"] in card and "## Loss curve" in card and "## The plan against what happened" in card
    assert f"| {record['losses'][-1]['step']} | {record['losses'][-1]['loss']:.4f} |" in card
    push = record["push"]
    assert (
        push["status"] == "pushed"
        and push["repo_id"] == "my-org/tiny-chat"
        and push["bytes"] == sum(len(data) for name, data in hub.sent.items() if name != "README.md")
    )
    assert "pushed" in err and "tiny-chat" in err
    assert "hub: https://huggingface.co/my-org/tiny-chat/tree/v1:" in stdout  # the run's summary says where it went
    # The upload was part of the plan: its seconds in the overheads the guard keeps in reserve.
    overheads = record["estimate"]["overheads"]
    assert overheads["upload_seconds"] > 0
    assert any(
        "my-org/tiny-chat" in note and "branch v1" in note and "private" in note for note in record["plan"]["notes"]
    )


@pytest.mark.parametrize(
    ("setting", "fragment"),
    [
        ("offline", "HF_HUB_OFFLINE is set"),
        ("no token", "no Hugging Face token"),
        ("bad name", "is not a hub repository name"),
        ("unreachable", "cannot reach the hub"),
        ("rejected", "rejects this token"),
    ],
)
def test_a_push_that_cannot_happen_is_refused_before_any_training_step(
    calibrated_home: Path,
    heavy_tailed_jsonl: Path,
    tmp_path: Path,
    hub: FakeHub,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    setting: str,
    fragment: str,
) -> None:
    name = "my-org/tiny-chat"
    if setting == "offline":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    elif setting == "no token":
        from huggingface_hub import constants

        monkeypatch.delenv("HF_TOKEN")
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))  # no stored token either
    elif setting == "bad name":
        name = "my org/tiny..chat"
    elif setting == "unreachable":
        hub.whoami_error = httpx.ConnectError("[Errno -3] Temporary failure in name resolution")
    else:
        request = httpx.Request("GET", "https://huggingface.co/api/whoami-v2")
        hub.whoami_error = httpx.HTTPStatusError(
            "401 Unauthorized", request=request, response=httpx.Response(401, request=request)
        )

    def no_step(*_: Any, **__: Any) -> Any:
        raise AssertionError("a training step ran before the push was checked")

    monkeypatch.setattr(TrainingStep, "run", no_step)
    out = tmp_path / "run"
    code, _, err = run_main("train", train_args(heavy_tailed_jsonl, out, "--push-to-hub", name), capsys)
    assert_one_line_error(code, err, fragment)
    assert not out.exists()  # nothing written: no run folder, no run.json
    assert hub.called("upload_folder") == []


def test_a_failed_push_keeps_final_and_the_printed_command_retries_it(
    calibrated_home: Path, heavy_tailed_jsonl: Path, tmp_path: Path, hub: FakeHub, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    hub.fail = httpx.ConnectError("connection reset by peer")
    code, _, err = run_main("train", train_args(heavy_tailed_jsonl, out, "--push-to-hub", "my-org/tiny"), capsys)
    assert code == EXIT_PUSH_FAILED, err
    record = json.loads((out / "run.json").read_text())
    assert record["status"] == "step_limit" and record["push"]["status"] == "failed"
    assert "ConnectError: connection reset by peer" in record["push"]["error"]
    # run.json keeps the retry from inside the run folder (nothing a move breaks); the line says it for here.
    assert record["push"]["retry"] == "train --out . --push-to-hub my-org/tiny --push-only"
    retry = f"train --out {out} --push-to-hub my-org/tiny --push-only"
    assert f"retry with `{retry}`" in err
    before = digest(out / "final")
    assert (out / "final" / "model.safetensors").is_file()

    # The retry, as printed: the same files go up (with the card), final/'s model untouched.
    hub.fail = None
    code, _, err = run_main("train", retry.split()[1:], capsys)
    assert code == 0, err
    assert json.loads((out / "run.json").read_text())["push"]["status"] == "pushed"
    assert {name: sha for name, sha in digest(out / "final").items() if name != "README.md"} == {
        name: sha for name, sha in before.items() if name != "README.md"
    }
    assert "model.safetensors" in hub.sent and "base_model: tiny" in hub.sent["README.md"].decode()

    code, _, err = run_main(
        "train", ["--out", str(tmp_path / "nowhere"), "--push-to-hub", "my-org/tiny", "--push-only"], capsys
    )
    assert_one_line_error(code, err, "has no run.json")


def test_the_upload_is_planned_at_the_last_measured_bandwidth_else_a_stated_default(home: Path) -> None:
    from benchtrain.train.recipes.hub_push import DEFAULT_UPLOAD_BYTES_PER_SECOND, remember_rate, upload_rate

    rate, source = upload_rate()
    assert rate == DEFAULT_UPLOAD_BYTES_PER_SECOND and "a default" in source
    remember_rate(1_000_000, 0.1)  # too small to say anything about the bandwidth
    assert upload_rate()[0] == DEFAULT_UPLOAD_BYTES_PER_SECOND
    remember_rate(400_000_000, 4.0)
    rate, source = upload_rate()
    assert rate == pytest.approx(1e8) and "measured by the push of 400 MB" in source
