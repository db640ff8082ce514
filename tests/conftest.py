from __future__ import annotations

import hashlib
import json
import os
import random
import tempfile
from pathlib import Path

import pytest
from helpers import FakeClock, synthetic_calibration

FIXTURE_DIGESTS = pytest.StashKey[dict[str, str]]()

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Test workers share the cores (scripts/test.sh runs one per core): one thread each, or
    # OpenMP's spinning threads fight over them (a test's CPU time tripled when they did).
    os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Keep datasets' cache out of the user's ~/.cache, and the tokenized-data cache (and anything else
# a test writes without its own `home`) out of ~/.benchtrain.
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="benchtrain-tests-hf-"))
os.environ.setdefault("BENCHTRAIN_HOME", tempfile.mkdtemp(prefix="benchtrain-tests-home-"))
# A bench on a CPU measures its step again in two fresh interpreters (bench.fresh_process): seconds
# each, in every bench the suite runs. tests/test_fresh_process.py turns it on where it is the subject.
os.environ.setdefault("BENCHTRAIN_FRESH_PROCESSES", "0")


FIXTURES = Path(__file__).resolve().parent / "fixtures"


def fixture_digests() -> dict[str, str]:
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(FIXTURES.glob("*"))
        if path.is_file()
    }


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[FIXTURE_DIGESTS] = fixture_digests()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A test that trains from a fixture calibration feeds its run back into that file: the suite fails
    when one did (plan from a copy in tmp_path), so that no run ever changes what the next one reads."""
    before = session.config.stash.get(FIXTURE_DIGESTS, {})
    changed = sorted(name for name, digest in fixture_digests().items() if before.get(name) != digest)
    if before and changed and not hasattr(session.config, "workerinput"):
        print(f"\nerror: the suite changed tests/fixtures: {', '.join(changed)} (a test wrote into a fixture)")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
    # The slow tests first (longest first is the classic schedule): under xdist the workers then
    # end on short tests together, not one on a two-minute test while the other idles.
    items.sort(key=lambda item: "slow" not in item.keywords)


@pytest.fixture(scope="session")
def fork_server():
    """Starts `train` and `bench` as real processes in a second, not eight (tests/forkserver.py)."""
    from forkserver import ForkServer

    with ForkServer({**os.environ, "OMP_NUM_THREADS": "1"}) as server:
        yield server


@pytest.fixture()
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh BENCHTRAIN_HOME for each test."""
    folder = tmp_path / "home"
    monkeypatch.setenv("BENCHTRAIN_HOME", str(folder))
    return folder


@pytest.fixture()
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """The training code's clock made a FakeClock (tests/helpers.py): every step of THE step takes
    `clock.step_seconds` on it, and nothing else takes any time."""
    import dataclasses

    from benchtrain.train.step.step import TrainingStep

    fake = FakeClock()
    for module in ("benchtrain.train.cli", "benchtrain.train.planning.deadline", "benchtrain.train.running.loop"):
        monkeypatch.setattr(f"{module}.time", fake)
    real_step = TrainingStep.run

    def step_of_known_length(self: TrainingStep, batches: object, grad_accum: int) -> object:
        result = real_step(self, batches, grad_accum)
        fake.step_done()
        return dataclasses.replace(result, seconds=fake.step_seconds)

    monkeypatch.setattr(TrainingStep, "run", step_of_known_length)
    return fake


@pytest.fixture()
def heavy_tailed_jsonl(tmp_path: Path) -> Path:
    """A few hundred text samples with log-normal (heavy-tailed) lengths."""
    rng = random.Random(7)
    path = tmp_path / "data.jsonl"
    with path.open("w") as handle:
        for _ in range(300):
            length = min(900, max(10, int(rng.lognormvariate(4.2, 0.8))))
            handle.write(json.dumps({"text": "".join(rng.choice("abcdefgh ") for _ in range(length))}) + "\n")
    return path


@pytest.fixture()
def calibrated_home(home: Path) -> Path:
    """`home` holding a synthetic calibration of the tiny model on this machine (tests/helpers.py)."""
    from benchtrain.calibration.store import save_calibration
    from benchtrain.train.step.hardware import detect_hardware
    from benchtrain.train.workload.model import resolve_model

    save_calibration(
        synthetic_calibration(
            hardware=detect_hardware(),
            model={"name": "tiny", "parameter_count": 1, "fingerprint": resolve_model("tiny").fingerprint},
        )
    )
    return home


@pytest.fixture()
def chats(tmp_path: Path) -> Path:
    """150 short chats (messages format)."""
    path = tmp_path / "chats.jsonl"
    with path.open("w") as handle:
        for index in range(150):
            question = "How do I plan a run? " * (1 + index % 7)
            answer = "Measure first. " * (3 + index % 11)
            handle.write(
                json.dumps(
                    {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}
                )
                + "\n"
            )
    return path


@pytest.fixture(scope="module")
def tokenizer():
    """The byte tokenizer (no download)."""
    from benchtrain.train.workload.tokenizer import byte_tokenizer

    return byte_tokenizer()


@pytest.fixture()
def offline_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """HF_HOME in tmp_path and HF_HUB_OFFLINE=1, as a user sets them (huggingface_hub read both at
    import, so its constants follow too). Returns the hub cache folder."""
    from huggingface_hub import constants

    hub = tmp_path / "hf" / "hub"
    hub.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """With BENCHTRAIN_TEST_CPU_LOG=path, append each test's CPU seconds (this process and the
    processes it waited for): what a test costs on a shared machine, where wall time misleads."""
    log = os.environ.get("BENCHTRAIN_TEST_CPU_LOG")
    if not log:
        yield
        return
    import resource

    def cpu_seconds() -> float:
        return sum(
            usage.ru_utime + usage.ru_stime
            for usage in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))
        )

    before = cpu_seconds()
    yield
    with open(log, "a") as handle:
        handle.write(f"{cpu_seconds() - before:.2f} {item.nodeid}\n")
