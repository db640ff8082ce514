"""Calibrations people share (issue 41): `bench push ORG/NAME` uploads calibrations to a dataset
repository on the hub with a card, `--use-calibration hub:ORG/NAME[/ID]` reads them back through
huggingface_hub's cache, checked, and a comparison row says whose measurement it rests on.

The hub's HTTP side is replaced at huggingface_hub's own API object (HfApi), as tests/test_hub_push.py
does for a model: what would be sent is what these tests read. The pull reads a cache these tests
write in huggingface_hub's layout (file_download.py: blobs/<hash>, snapshots/<commit>/<path> linking
to its blob, refs/main naming the commit), with HF_HUB_OFFLINE=1, through huggingface_hub's real
snapshot_download."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import assert_one_line_error, cpu_calibration, run_main

from benchtrain.calibration.step_config import StepConfig
from benchtrain.calibration.store import save_calibration
from benchtrain.common.errors import BenchtrainError, CalibrationFileError

REPO = "my-org/cals"


def write_cache(cache: Path, repo: str, files: dict[str, bytes], commit: str) -> Path:
    """`files` as huggingface_hub's cache keeps a download of `repo` at `commit`: each in
    blobs/<hash>, linked (relative symlink) from snapshots/<commit>/<path>; refs/main the commit."""
    root = cache / f"datasets--{repo.replace('/', '--')}"
    for name, content in files.items():
        blob = root / "blobs" / hashlib.sha256(content).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(content)
        link = root / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    return root / "snapshots" / commit


class FakeHub:
    """One dataset repository as the hub would keep it: HfApi's calls recorded, each commit
    applied to `files`; a download writes the file into the cache as huggingface_hub would."""

    def __init__(self, cache: Path) -> None:
        self.cache = cache
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.files: dict[str, bytes] = {".gitattributes": b"*.json text\n"}
        self.head = hashlib.sha1(b"initial").hexdigest()
        self.commit_error: Exception | None = None

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from huggingface_hub import HfApi

        hub = self

        def whoami(self: HfApi, token: Any = None, **_: Any) -> dict[str, Any]:
            hub.calls.append(("whoami", {"token": token}))
            return {"name": "tester"}

        def create_repo(self: HfApi, repo_id: str, **kwargs: Any) -> str:
            hub.calls.append(("create_repo", {"repo_id": repo_id, **kwargs}))
            return f"https://huggingface.co/datasets/{repo_id}"

        def list_repo_files(self: HfApi, repo_id: str, **kwargs: Any) -> list[str]:
            hub.calls.append(("list_repo_files", {"repo_id": repo_id, **kwargs}))
            return sorted(hub.files)

        def hf_hub_download(self: HfApi, repo_id: str, filename: str, **kwargs: Any) -> str:
            hub.calls.append(("hf_hub_download", {"repo_id": repo_id, "filename": filename, **kwargs}))
            return str(write_cache(hub.cache, repo_id, {filename: hub.files[filename]}, hub.head) / filename)

        def create_commit(self: HfApi, repo_id: str, operations: Any, **kwargs: Any) -> Any:
            operations = list(operations)
            hub.calls.append(("create_commit", {"repo_id": repo_id, "operations": operations, **kwargs}))
            if hub.commit_error is not None:
                raise hub.commit_error
            for operation in operations:
                hub.files[operation.path_in_repo] = operation.path_or_fileobj
            hub.head = hashlib.sha1(hub.head.encode() + b"next").hexdigest()
            return type(
                "CommitInfo",
                (),
                {"commit_url": f"https://huggingface.co/datasets/{repo_id}/commit/{hub.head}", "oid": hub.head},
            )()

        methods = {
            "whoami": whoami,
            "create_repo": create_repo,
            "list_repo_files": list_repo_files,
            "hf_hub_download": hf_hub_download,
        }
        for name, method in {**methods, "create_commit": create_commit}.items():
            monkeypatch.setattr(HfApi, name, method)

    def called(self, name: str) -> list[dict[str, Any]]:
        return [kwargs for call, kwargs in self.calls if call == name]

    def sent(self, commit: int = -1) -> dict[str, bytes]:
        return {
            operation.path_in_repo: operation.path_or_fileobj
            for operation in self.called("create_commit")[commit]["operations"]
        }


@pytest.fixture()
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """huggingface_hub's cache in tmp_path (it reads HF_HUB_CACHE at import: its constant follows)."""
    from huggingface_hub import constants

    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


@pytest.fixture()
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


@pytest.fixture()
def hub(hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    fake = FakeHub(hub_cache)
    fake.install(monkeypatch)
    return fake


def shared(identifier: str, created_at: str, **overrides: Any) -> dict[str, Any]:
    """A synthetic calibration of this machine and the tiny model (tests/helpers.py cpu_calibration)."""
    return cpu_calibration(identifier, created_at=created_at, **overrides)


def as_bytes(data: dict[str, Any]) -> bytes:
    return json.dumps(data).encode()


# -- push -----------------------------------------------------------------------------------------


def test_push_sends_each_calibration_and_a_card_then_a_second_push_merges(
    home: Path, hub: FakeHub, capsys: pytest.CaptureFixture[str]
) -> None:
    save_calibration(
        shared(
            "cpu-a", "2026-11-01T10:00:00+00:00", data={"source": "/home/alice/secret/chats.jsonl", "format": "chat"}
        )
    )
    save_calibration(shared("cpu-b", "2026-11-02T10:00:00+00:00", measured_by="bob"))
    code, out, err = run_main("bench", ["push", REPO], capsys)
    assert code == 0, err
    assert [call for call, _ in hub.calls] == ["whoami", "create_repo", "list_repo_files", "create_commit"]
    assert hub.called("whoami")[0]["token"] == "hf_test_token"
    assert hub.called("create_repo")[0] == {"repo_id": REPO, "repo_type": "dataset", "exist_ok": True}
    assert hub.called("create_commit")[0]["repo_type"] == "dataset"
    sent = hub.sent()
    assert set(sent) == {"calibrations/cpu-a.json", "calibrations/cpu-b.json", "README.md"}
    first, second = json.loads(sent["calibrations/cpu-a.json"]), json.loads(sent["calibrations/cpu-b.json"])
    assert first["measured_by"] == "tester" and second["measured_by"] == "bob"  # whoever measured it first stays
    assert first["data"]["source"] == "chats.jsonl"  # a local path goes up as its name only
    assert first["measurements"] == cpu_calibration("cpu-a")["measurements"]
    card = sent["README.md"].decode()
    assert (
        "| id | device | interconnect | model | method | quantization | processes | software | created | measured by |"
        in card
    )
    row_a = next(line for line in card.splitlines() if line.startswith("| cpu-a |"))
    assert "| tiny | full | none | 1 |" in row_a and "2026-11-01T10:00:00+00:00 | tester |" in row_a
    assert card.index("| cpu-b |") < card.index("| cpu-a |")  # newest first
    assert (
        f"hub:{REPO}" in card and "pushed 2 calibration(s)" in out and f"https://huggingface.co/datasets/{REPO}" in out
    )

    # Another machine pushes one more: those already there are read (through the cache) and listed too.
    save_calibration(shared("cpu-c", "2026-11-03T10:00:00+00:00"))
    code, out, err = run_main("bench", ["push", REPO, "cpu-c"], capsys)
    assert code == 0, err
    assert sorted(call["filename"] for call in hub.called("hf_hub_download")) == [
        "calibrations/cpu-a.json",
        "calibrations/cpu-b.json",
    ]
    sent = hub.sent()
    assert set(sent) == {"calibrations/cpu-c.json", "README.md"}
    card = sent["README.md"].decode()
    assert all(f"| {name} |" in card for name in ("cpu-a", "cpu-b", "cpu-c")) and "(3 there now)" in out
    assert "| bob |" in card  # read back from the file already there


def test_pushed_calibrations_come_back_through_the_cache_with_their_source(
    home: Path, hub: FakeHub, hub_cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchtrain import calibration
    from benchtrain.calibration.hub import shared_calibrations

    save_calibration(shared("cpu-a", "2026-11-01T10:00:00+00:00"))
    save_calibration(shared("cpu-b", "2026-11-02T10:00:00+00:00"))
    code, _, err = run_main("bench", ["push", REPO], capsys)
    assert code == 0, err
    # What the hub now holds, as a download would have left it in the cache; then offline.
    write_cache(hub_cache, REPO, {name: data for name, data in hub.files.items() if name != ".gitattributes"}, hub.head)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    entries = shared_calibrations(f"hub:{REPO}")
    assert [data["id"] for _, data, _ in entries] == ["cpu-b", "cpu-a"]  # newest first
    for path, data, _ in entries:
        assert data["source"] == {
            "kind": "hub",
            "repo": REPO,
            "file": f"calibrations/{data['id']}.json",
            "revision": hub.head,
            "measured_by": "tester",
        }
        assert path.is_relative_to(hub_cache)
    one = calibration.load(f"hub:{REPO}/cpu-a")
    assert one.id == "cpu-a" and one.provenance == f"hub:{REPO} (by tester)" and one.path is not None
    assert one.predict(StepConfig(2, 0, 1, 64)).tokens_per_second > 0
    # Named by its path in the cache (a resumed run's calibration_path), it still says where it came from.
    assert calibration.load(str(one.path)).provenance == f"hub:{REPO} (by tester)"
    # `hub:ORG/NAME` alone, outside a comparison, is the newest there, as `latest` chooses.
    assert calibration.load(f"hub:{REPO}").id == "cpu-b"


@pytest.mark.parametrize(
    ("setting", "fragment"),
    [
        ("offline", "bench push: HF_HUB_OFFLINE is set, so nothing can be pushed"),
        ("no token", "bench push: no Hugging Face token: run `hf auth login` or set HF_TOKEN, then push again"),
        ("bad name", "bench push 'my org/cals..x' is not a hub repository name (ORG/NAME)"),
        ("nothing stored", "bench push: no calibration in"),
        ("refused", f"bench push {REPO}: the hub refused dataset {REPO}: 403 Forbidden"),
        (
            "unreachable",
            f"bench push {REPO}: cannot reach the hub (ConnectError: Name or service not known): check the network",
        ),
    ],
)
def test_a_push_that_cannot_happen_is_one_line(
    home: Path,
    hub: FakeHub,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    setting: str,
    fragment: str,
) -> None:
    import httpx2
    from huggingface_hub import constants, errors

    if setting != "nothing stored":
        save_calibration(shared("cpu-a", "2026-11-01T10:00:00+00:00"))
    name = REPO
    request = httpx2.Request("POST", f"https://huggingface.co/api/datasets/{REPO}/commit/main")
    if setting == "offline":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    elif setting == "no token":
        monkeypatch.delenv("HF_TOKEN")
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    elif setting == "bad name":
        name = "my org/cals..x"
    elif setting == "refused":
        hub.commit_error = errors.HfHubHTTPError(
            "403 Forbidden: you cannot write to my-org", response=httpx2.Response(403, request=request)
        )
    elif setting == "unreachable":
        hub.commit_error = httpx2.ConnectError("Name or service not known", request=request)
    code, _, err = run_main("bench", ["push", name], capsys)
    assert_one_line_error(code, err, fragment)
    assert "hf_test_token" not in err


# -- pull -----------------------------------------------------------------------------------------


def test_a_damaged_file_is_refused_in_one_line_and_the_others_used(
    home: Path, hub_cache: Path, offline: None, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchtrain import calibration
    from benchtrain.calibration.hub import shared_calibrations

    good = shared("cpu-good", "2026-11-01T10:00:00+00:00", measured_by="alice")
    wrong_type = {**shared("cpu-typed", "2026-11-02T10:00:00+00:00"), "measurements": "many"}
    files = {
        "calibrations/cpu-good.json": as_bytes(good),
        "calibrations/cpu-cut.json": as_bytes(good)[:200],  # a download cut short
        "calibrations/cpu-typed.json": as_bytes(wrong_type),
        "calibrations/cpu-renamed.json": as_bytes(good),  # says it is cpu-good
        "calibrations/evil.pkl": b"\x80\x04cos\nsystem\n",  # never read: only calibrations/*.json is
        "calibrations/deeper/cpu-x.json": as_bytes(good),
        "README.md": b"# card\n",
    }
    write_cache(hub_cache, "org/mixed", files, "a" * 40)
    skipped: list[str] = []
    entries = shared_calibrations("hub:org/mixed", on_skip=skipped.append)
    assert [data["id"] for _, data, _ in entries] == ["cpu-good"]
    assert entries[0][1]["source"]["measured_by"] == "alice" and entries[0][1]["source"]["revision"] == "a" * 40
    assert len(skipped) == 3 and all(
        "\n" not in line and line.startswith("hub:org/mixed: calibrations/") for line in skipped
    )
    assert any("cpu-cut.json" in line and "not valid JSON" in line for line in skipped)
    assert any("cpu-typed.json" in line and "'measurements'" in line for line in skipped)
    assert any("cpu-renamed.json" in line and "'cpu-good'" in line for line in skipped)
    # Named on its own, a damaged file is an error, in one line, through the CLI too.
    with pytest.raises(CalibrationFileError, match=r"^hub:org/mixed: calibrations/cpu-cut.json refused"):
        calibration.load("hub:org/mixed/cpu-cut")
    code, _, err = run_main("bench", ["show", "hub:org/mixed/cpu-typed"], capsys)
    assert_one_line_error(code, err, "hub:org/mixed: calibrations/cpu-typed.json refused")
    # One picked by its id: hub:ORG/NAME/ID.
    code, out, err = run_main("bench", ["show", "hub:org/mixed/cpu-good", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["id"] == "cpu-good"


@pytest.mark.parametrize(
    ("reference", "fragment"),
    [
        ("hub:org", "is not a hub calibration: hub:ORG/NAME"),
        ("hub:org/cals/a/b", "is not a hub calibration"),
        ("hub:org/cals/..", "'..' is not a calibration id"),
        ("hub:org/ca ls", "is not a hub repository name"),
        ("hub:org/cals/cpu-none", "calibrations/cpu-none.json is not in the hub cache"),
    ],
)
def test_hub_references_that_name_nothing_usable_are_one_line(
    hub_cache: Path, offline: None, reference: str, fragment: str
) -> None:
    from benchtrain import calibration

    write_cache(
        hub_cache,
        "org/cals",
        {"calibrations/cpu-good.json": as_bytes(shared("cpu-good", "2026-11-01T10:00:00+00:00"))},
        "b" * 40,
    )
    with pytest.raises(BenchtrainError) as raised:
        calibration.load(reference)
    assert fragment in str(raised.value) and "\n" not in str(raised.value)


def test_bench_push_help_has_examples() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchtrain.bench", "push", "--help"], capture_output=True, text=True, timeout=60
    )
    assert (
        done.returncode == 0
        and "examples:" in done.stdout
        and "--use-calibration hub:my-org/gpu-calibrations" in done.stdout
    )


def test_offline_and_not_cached_is_one_line_in_a_fresh_process(tmp_path: Path) -> None:
    """As a user runs it: HF_HOME and HF_HUB_OFFLINE from the environment."""
    env = {
        **os.environ,
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_OFFLINE": "1",
        "BENCHTRAIN_HOME": str(tmp_path / "home"),
    }
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, "-m", "benchtrain.bench", "show", "hub:org/absent"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().count("\n") == 0 and "Traceback" not in done.stderr
    assert (
        "hub:org/absent: dataset org/absent is not in the hub cache" in done.stderr
        and str(tmp_path / "hf" / "hub") in done.stderr
    )
    assert "HF_HUB_OFFLINE is set" in done.stderr and "`hf download org/absent --repo-type dataset`" in done.stderr


@pytest.mark.parametrize("kind", ["offline", "unreachable", "not found"])
def test_train_with_a_hub_calibration_it_cannot_get_is_one_line(
    home: Path,
    hub_cache: Path,
    chats: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    kind: str,
) -> None:
    import httpx2
    from huggingface_hub import HfApi, constants, errors

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", kind == "offline")
    request = httpx2.Request("GET", "https://huggingface.co/api/datasets/org/absent/revision/main")

    def repo_info(*_: Any, **__: Any) -> Any:
        if kind == "unreachable":
            raise httpx2.ConnectError("Name or service not known", request=request)
        raise errors.RepositoryNotFoundError("404 Not Found", response=httpx2.Response(404, request=request))

    monkeypatch.setattr(HfApi, "repo_info", repo_info)
    fragment = {
        "offline": "dataset org/absent is not in the hub cache",
        "unreachable": "cannot reach the hub for dataset org/absent (Name or service not known) and it is not in the hub cache",
        "not found": "no dataset org/absent on the hub",
    }[kind]
    save_calibration(cpu_calibration("cpu-one"))
    for reference in ("hub:org/absent/cpu-one", "all,hub:org/absent"):
        argv = ["--dry-run", "--use-calibration", reference, "--data", str(chats), "--deadline", "12h", "--no-report"]
        code, _, err = run_main("train", argv, capsys)
        assert_one_line_error(code, err, fragment)
        assert err.startswith(f"error: {reference.split(',')[-1]}: ")  # the reference it could not get, first


def test_a_hub_calibration_is_never_written_by_a_run(hub_cache: Path, offline: None) -> None:
    from benchtrain.calibration.hub import shared_calibrations
    from benchtrain.calibration.store import is_read_only, update_calibration

    write_cache(
        hub_cache,
        "org/cals",
        {"calibrations/cpu-good.json": as_bytes(shared("cpu-good", "2026-11-01T10:00:00+00:00"))},
        "c" * 40,
    )
    ((path, _, _),) = shared_calibrations("hub:org/cals")
    before = path.read_bytes()
    assert is_read_only(path)
    with pytest.raises(BenchtrainError, match="was downloaded from the hub and is not changed"):
        update_calibration(path, lambda data: data.setdefault("history", []).append({}))
    assert path.read_bytes() == before and path.is_symlink()


# -- the comparison ----------------------------------------------------------------------------


def test_a_comparison_row_says_whose_measurement_it_rests_on(
    home: Path, hub_cache: Path, offline: None, chats: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save_calibration(cpu_calibration("cpu-mine"))
    theirs = shared("cpu-theirs", "2026-11-02T10:00:00+00:00", measured_by="alice")
    other_model = {
        **shared("cpu-gpt2", "2026-11-03T10:00:00+00:00"),
        "model": {"name": "gpt2", "parameter_count": 1, "fingerprint": "another"},
    }
    files = {"calibrations/cpu-theirs.json": as_bytes(theirs), "calibrations/cpu-gpt2.json": as_bytes(other_model)}
    write_cache(hub_cache, "org/shared", files, "d" * 40)
    common = ["--data", str(chats), "--deadline", "12h", "--no-report"]

    code, out, err = run_main(
        "train", ["--dry-run", "--use-calibration", "all,hub:org/shared", *common, "--json"], capsys
    )
    assert code == 0, err
    rows = {row["reference"]: row for row in json.loads(out)["rows"]}
    assert set(rows) == {"cpu-mine", "hub:org/shared/cpu-theirs"}  # the other model's is left out, as `all` leaves it
    assert rows["hub:org/shared/cpu-theirs"]["provenance"] == "hub:org/shared (by alice)"
    assert rows["cpu-mine"]["provenance"] == "measured here"
    assert rows["hub:org/shared/cpu-theirs"]["plan"] is not None

    code, out, err = run_main("train", ["--dry-run", "--use-calibration", "hub:org/shared", *common], capsys)
    assert code == 0, err
    assert "hub:org/shared/cpu-theirs" in out and "(by alice)" in out
    assert "train it there with: train --use-calibration hub:org/shared/cpu-theirs" in out
    # The row's plan is the one a single dry run of that reference makes.
    code, single, err = run_main(
        "train", ["--dry-run", "--use-calibration", "hub:org/shared/cpu-theirs", *common, "--json"], capsys
    )
    assert code == 0, err
    assert json.loads(single)["plan"]["chosen"] == rows["hub:org/shared/cpu-theirs"]["plan"]["chosen"]
    # Every calibration of a repository is a comparison, hence a dry run.
    code, _, err = run_main(
        "train", ["--use-calibration", "hub:org/shared", "--data", str(chats), "--deadline", "12h"], capsys
    )
    assert_one_line_error(code, err, "compares calibrations, which is a dry run: add --dry-run")


# -- the card ----------------------------------------------------------------------------------


def test_the_card_says_what_each_measured_and_escapes_what_it_holds() -> None:
    from benchtrain.calibration.hub import card_text

    lora = shared(
        "cpu-lora",
        "2026-11-01T10:00:00+00:00",
        measured_by="eve | <script>",
        training={"method": "lora", "lora": {"rank": 16}, "quantization": "4bit"},
    )
    lora["hardware"] = {
        **lora["hardware"],
        "name": "GPU | with\na newline",
        "interconnect": {"kind": "nvlink", "links": 18},
        "cuda_version": "13.0",
    }
    lora["software"] = {"torch": "2.13.0", "transformers": "5.24.0"}
    lora["distributed"] = {"world_size": 2, "sharding": "fsdp"}
    card = card_text("org/cals", {"calibrations/cpu-lora.json": lora, "calibrations/broken.json": None})
    (row,) = [line for line in card.splitlines() if line.startswith("| cpu-lora |")]
    cells = [cell.strip() for cell in row.strip("|").replace("\\|", "¦").split("|")]
    assert cells == [
        "cpu-lora",
        "GPU ¦ with a newline",
        "nvlink",
        "tiny",
        "LoRA r16",
        "4bit",
        "2 (fsdp)",
        "torch 2.13.0, transformers 5.24.0, CUDA 13.0",
        "2026-11-01T10:00:00+00:00",
        "eve ¦ &lt;script&gt;",
    ]
    assert "`calibrations/broken.json`" in card and "cannot be read" in card
    bare = {"device_type": "cpu", "name": "Test CPU", "count": 1, "memory_bytes": 2**30}  # no interconnect recorded
    plain = card_text(
        "org/cals", {"calibrations/a.json": {**shared("a", "2026-11-01T10:00:00+00:00"), "hardware": bare}}
    )
    assert "| a | " in plain and "| – |" in plain and "| unknown |" in plain  # no interconnect recorded, nobody named
