"""Pre-tokenized corpora (train.workload.tokens): raw .bin/.npy token files and a datasets
folder with input_ids are planned and trained without tokenizing and without loading them into
memory; a token file larger than the memory limit the test sets trains."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import synthetic_calibration

from benchtrain.calibration.store import save_calibration
from benchtrain.common.errors import BenchtrainError
from benchtrain.train.workload.formats import DataSchema
from benchtrain.train.workload.prepare import DataSpec, prepare_data
from benchtrain.train.workload.tokenizer import byte_tokenizer
from benchtrain.train.workload.tokens import TokenShards, scan_documents, token_files

ROOT = Path(__file__).resolve().parent.parent
SEPARATOR = 2  # the byte tokenizer's <|eos|>


def documents(seed: int, count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.append(rng.integers(10, 250, rng.integers(5, 90)), SEPARATOR).astype(np.uint16) for _ in range(count)]


def test_shards_are_one_stream_of_their_documents(home: Path, tmp_path: Path) -> None:
    """Three .bin shards read back to back: each document found by its separator, the ids
    mapped from the files as written (nothing copied into the cache)."""
    folder = tmp_path / "shards"
    folder.mkdir()
    written = [documents(seed, 40) for seed in range(3)]
    for index, docs in enumerate(written):
        np.concatenate(docs).tofile(folder / f"train-{index:03d}.bin")
    (folder / "benchtrain.json").write_text(json.dumps({"dtype": "uint16", "separator": SEPARATOR}))
    prepared = prepare_data(DataSpec(str(folder)), byte_tokenizer(), print)
    data = prepared.view
    flat = [doc for docs in written for doc in docs]
    assert prepared.exact and data.format == "tokens" and data.packing and len(data) == len(flat)
    assert data.lengths.tolist() == [len(doc) for doc in flat]
    assert all(data.sample(i).tolist() == flat[i].tolist() for i in (0, 39, 40, 119))
    assert data.stream_take(np.arange(data.stream_length)).tolist() == np.concatenate(flat).tolist()
    assert data.real_tokens(64) == sum(len(doc) for doc in flat)  # packing: the loss on every token
    assert not (prepared.folder / "tokens.bin").exists()  # the ids stay in the user's files


def test_a_token_file_needs_its_dtype_and_ids_of_the_tokenizer(home: Path, tmp_path: Path) -> None:
    path = tmp_path / "train.bin"
    ids = np.concatenate(documents(0, 5))
    ids[: len(ids) - (1 - len(ids) % 2)].tofile(path)  # an odd count of uint16 ids: not a whole number of uint32
    with pytest.raises(BenchtrainError, match="needs its dtype: pass --token-dtype"):
        prepare_data(DataSpec(str(path)), byte_tokenizer(), print)
    with pytest.raises(BenchtrainError, match="not a whole number of uint32 ids"):
        prepare_data(DataSpec(str(path), schema=DataSchema(token_dtype="uint32")), byte_tokenizer(), print)
    wide = tmp_path / "wide.npy"
    np.save(wide, np.array([5, 9, 70000], dtype=np.uint32))
    with pytest.raises(BenchtrainError, match="token id 70,000 is outside the tokenizer's"):
        prepare_data(DataSpec(str(wide)), byte_tokenizer(), print)
    data = prepare_data(DataSpec(str(path), schema=DataSchema(token_dtype="uint16")), byte_tokenizer(), print).view
    assert len(data) == 1  # no separator: the file is one document


def test_token_shards_take_positions_across_their_borders() -> None:
    shards = TokenShards([np.arange(0, 5), np.arange(5, 12), np.arange(12, 13)])
    assert len(shards) == 13
    assert shards[3:9].tolist() == list(range(3, 9))
    assert shards[np.array([12, 0, 5, 4])].tolist() == [12, 0, 5, 4]


def test_the_scan_finds_documents_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    import benchtrain.train.workload.tokens as tokens

    monkeypatch.setattr(tokens, "SCAN_CHUNK", 7)  # separators on both sides of chunk borders
    ids = np.array([1, 2, 3, 9, 9, 2, 2, 4, 5, 6, 7, 8, 9, 10, 2, 11], dtype=np.uint16)
    lengths, largest = scan_documents(ids, 2)
    assert lengths.tolist() == [2, 4, 1, 8, 1] and largest == 11
    assert token_files("/nonexistent") is None


def test_a_datasets_folder_of_input_ids_is_packed_as_is(home: Path, tmp_path: Path) -> None:
    import datasets

    rows = [doc.tolist() for doc in documents(4, 60)]
    datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(str(tmp_path / "ids"))
    data = prepare_data(DataSpec(str(tmp_path / "ids")), byte_tokenizer(), print, exact=True).view
    assert data.format == "tokens" and data.packing and data.loss_on == "all tokens"
    assert [data.sample(i).tolist() for i in range(len(data))] == rows  # no EOS added, nothing re-tokenized


BIG = """
import atexit, resource, sys
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
# Its own peak (RUSAGE_CHILDREN in the test would count every child the test worker ever ran).
atexit.register(lambda: print(f"maxrss={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}", file=sys.stderr))
from benchtrain.train.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.slow
def test_a_token_file_larger_than_the_memory_limit_trains(home: Path, tmp_path: Path) -> None:
    """A 2 GiB file of ids (a sparse file: zeros, then a document of real ids at its end) under a
    1.5 GiB limit on the process's private memory (RLIMIT_DATA: heap and anonymous maps; a
    read-only file map does not count, so loading the file into memory would fail where mapping
    it does not). Planned and trained for two steps."""
    from benchtrain.train.step.hardware import detect_hardware
    from benchtrain.train.workload.model import resolve_model

    save_calibration(
        synthetic_calibration(
            hardware=detect_hardware(),
            model={"name": "tiny", "parameter_count": 1, "fingerprint": resolve_model("tiny").fingerprint},
        )
    )
    path = tmp_path / "corpus.bin"
    size = 2 << 30
    with path.open("wb") as handle:
        handle.truncate(size)
        tail = np.concatenate(documents(1, 50))
        handle.seek(size - tail.nbytes)
        handle.write(tail.tobytes())
    limit = 3 << 29  # 1.5 GiB < the file's 2 GiB
    whole = f"{BIG.split('from benchtrain.train')[0]}\nimport numpy; numpy.fromfile({str(path)!r}, numpy.uint16)"
    loading = subprocess.run([sys.executable, "-c", whole, str(limit)], capture_output=True, text=True)
    # what loading it whole does under the same limit
    assert loading.returncode != 0 and "MemoryError" in loading.stderr
    command = [
        sys.executable,
        "-c",
        BIG,
        str(limit),
        "--data",
        str(path),
        "--token-dtype",
        "uint16",
        "--document-separator",
        str(SEPARATOR),
    ]
    command += ["--deadline", "5m", "--max-steps", "2", "--no-report", "--out", str(tmp_path / "run")]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env={**_env(home)}, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["actual"]["steps"] == 2 and record["data"]["format"] == "tokens"
    assert record["data"]["profile"]["total_tokens"] == size // 2
    peak = int(result.stderr.rsplit("maxrss=", 1)[1].split()[0]) * 1024
    assert peak < limit  # the ids were never all resident


def _env(home: Path) -> dict[str, str]:
    import os

    return {**os.environ, "BENCHTRAIN_HOME": str(home), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
