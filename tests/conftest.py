from __future__ import annotations

import json
import os
import random
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Keep datasets' tokenization cache out of the user's ~/.cache during tests.
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="benchtrain-tests-hf-"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


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
def heavy_tailed_jsonl(tmp_path: Path) -> Path:
    """A few hundred text samples with log-normal (heavy-tailed) lengths."""
    rng = random.Random(7)
    path = tmp_path / "data.jsonl"
    with path.open("w") as handle:
        for _ in range(300):
            length = min(900, max(10, int(rng.lognormvariate(4.2, 0.8))))
            handle.write(json.dumps({"text": "".join(rng.choice("abcdefgh ") for _ in range(length))}) + "\n")
    return path
