"""Synthetic measurements and calibrations from known parameters (no torch needed)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import random
from collections.abc import Callable
from typing import Any

from calibration.fit import fit_measurements, throughput_features, throughput_terms
from calibration.memory_fit import linear_terms, memory_features
from calibration.schema import SCHEMA_VERSION
from calibration.step_config import StepConfig

TRUE_THROUGHPUT = {
    "fixed": 4e-3,
    "per_token": 2e-6,
    "attention": 1.5e-9,
    "optimizer_step": 6e-3,
    "serial_data": 3e-7,
    "worker_supply": 4e-7,
    "per_worker": 5e-4,
    "recompute_per_token": 6e-7,
    "recompute_attention": 4e-10,
}
TRUE_EVAL = {"fixed": 1e-3, "per_token": 6e-7, "attention": 4e-10}
TRUE_MEMORY = {"static": 2e9, "per_token": 4e5, "attention": 200.0, "per_token_checkpointed": 5e4, "attention_checkpointed": 20.0, "accumulated_gradients": 0.0}
GIB = 2**30


def micro_seconds(config: StepConfig, parameters: dict[str, float] = TRUE_THROUGHPUT) -> float:
    return float(sum(f * parameters[t] for f, t in zip(throughput_features(config), throughput_terms(), strict=True)))


def peak_bytes(config: StepConfig, parameters: dict[str, float] = TRUE_MEMORY) -> float:
    return float(sum(f * parameters[t] for f, t in zip(memory_features(config), linear_terms(), strict=True)))


def synthetic_rows(
    batch_sizes=(1, 2, 4, 8),
    workers=(0, 2),
    accums=(1, 2),
    seq_lens=(128, 256, 512),
    noise: float = 0.02,
    memory_limit: float | None = None,
    seed: int = 0,
    checkpointing=(0,),
) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for b, w, a, s, c in itertools.product(batch_sizes, workers, accums, seq_lens, checkpointing):
        config = StepConfig(micro_batch_size=b, num_workers=w, grad_accum=a, seq_len=s).switched(gradient_checkpointing=bool(c))
        peak = peak_bytes(config) * (1 + rng.gauss(0, noise / 2))
        row: dict[str, Any] = {"micro_batch_size": b, "num_workers": w, "grad_accum": a, "seq_len": s, "gradient_checkpointing": c}
        if memory_limit is not None and peak > memory_limit:
            rows.append({**row, "status": "oom", "error": "OutOfMemoryError: fake"})
            continue
        micro = micro_seconds(config)
        wait_parameters = {t: (v if t in ("serial_data", "worker_supply") else 0.0) for t, v in TRUE_THROUGHPUT.items()}
        wait_share = micro_seconds(config, wait_parameters) / micro
        step = micro * a * (1 + rng.gauss(0, noise))
        rows.append(
            {
                **row,
                "status": "ok",
                "step_seconds": step,
                "tokens_per_second": b * s * a / step,
                "peak_memory_bytes": peak,
                "data_wait_share": wait_share,
                "probe_seconds": 1.0,
                "warmup_seconds": 2 * step * 1.2,
            }
        )
    return rows


@functools.cache
def _default_rows_and_fit() -> tuple[list[dict[str, Any]], dict[str, Any]]:
    # Fitting takes about a second (the memory model's leave-one-out); most tests use the
    # default rows, so fit them once per test session and hand out copies.
    rows = synthetic_rows()
    return rows, fit_measurements(rows)


def synthetic_calibration(rows: list[dict[str, Any]] | None = None, memory_bytes: float = 80 * GIB, **overrides: Any) -> dict[str, Any]:
    if rows is None:
        rows, fit = copy.deepcopy(_default_rows_and_fit())
    else:
        fit = fit_measurements(rows)
    data = {
        "schema_version": SCHEMA_VERSION,
        "id": "test-tiny-20260101-000000",
        "created_at": "2026-01-01T00:00:00+00:00",
        "hardware": {"device_type": "cpu", "name": "Test CPU", "count": 1, "memory_bytes": memory_bytes},
        "software": {"torch": "test"},
        "model": {"name": "tiny", "parameter_count": 1000, "fingerprint": "abc"},
        "measurements": rows,
        "overheads": {
            "model_build_seconds": 1.0,
            "checkpoint_save_seconds": 0.5,
            "report_seconds": 2.0,
            "warmup_extra_seconds": 0.2,
        },
        "fit": fit,
        "eval": {"measurements": [], "fit": {"terms": ["fixed", "per_token", "attention"], "parameters": TRUE_EVAL}},
        "history": [],
        "warnings": [],
    }
    data.update(overrides)
    return data


def pretend_interrupted(out: Any, total_steps: int) -> None:
    """Make the finished run in `out` look like one stopped on its way to `total_steps` (its last
    checkpoint kept): a resume continues a run and never extends a finished one, so a test that
    resumes a short run for what it checks (checkpoints, calibrations, processes) starts from this."""
    import json
    from pathlib import Path

    path = Path(out) / "run.json"
    record = json.loads(path.read_text())
    record["status"] = "interrupted"
    record["plan"]["total_steps"] = total_steps
    path.write_text(json.dumps(record))


class FakeClock:
    """`time` as the training code sees it in a test (train.cli, train.planning.deadline,
    train.running.loop; the `clock` fixture in conftest.py puts it there): it stands still except
    while a step runs, and each step takes exactly `step_seconds` on it. A deadline then holds or
    passes by the code's arithmetic, never by how busy the machine is."""

    def __init__(self, step_seconds: float = 0.5) -> None:
        self.now = 1000.0
        self.step_seconds = step_seconds
        self.steps = 0
        self.on_step: Callable[[int], None] | None = None

    def monotonic(self) -> float:
        return self.now

    perf_counter = monotonic

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def step_done(self) -> None:
        """A step ran: its seconds pass, then `on_step` hears its number (counted from 1)."""
        self.now += self.step_seconds
        self.steps += 1
        if self.on_step is not None:
            self.on_step(self.steps)


def load_tokenized(path: str, tokenizer: Any, train_on: str = "assistant", schema: Any = None, split: str = "train") -> Any:
    """Every record of `path` tokenized through the product's own path (prepare_data, the cache
    included), exactly: the TokenizedData a run of that file trains on."""
    from common.console import say
    from train.workload.data import TokenizedData
    from train.workload.formats import DataSchema
    from train.workload.prepare import DataSpec, prepare_data

    prepared = prepare_data(DataSpec(path, train_on, schema or DataSchema(), split), tokenizer, say, exact=True)
    assert isinstance(prepared.view, TokenizedData)
    return prepared.view


def tokenized_from_samples(
    samples: list[Any], prompt_lengths: list[int] | None, format: str, source: str, loss_masks: list[Any] | None = None, loss_on: str = "all tokens"
) -> Any:
    """A TokenizedData in memory, from one array of token ids per sample."""
    import numpy as np

    from train.workload.data import TokenizedData

    lengths = np.fromiter((len(sample) for sample in samples), dtype=np.int64, count=len(samples))
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    tokens = np.concatenate(samples).astype(np.int32) if samples else np.zeros(0, np.int32)
    mask = np.concatenate(loss_masks).astype(np.uint8) if loss_masks is not None and samples else None
    prompts = np.asarray(prompt_lengths, dtype=np.int32) if prompt_lengths is not None else None
    data = TokenizedData(tokens, offsets, format, source, loss_on, mask, prompts)
    return dataclasses.replace(data, targets=data.document_targets())


def loaded_bytes(model: Any) -> int:
    """The bytes a loaded model holds, counted on the built model: its parameters and buffers at
    their storage dtype, and the quantization state bitsandbytes keeps beside its 4-bit weights
    (absmax, codes, offsets) and its 8-bit ones (row scales): the truth quantized_bytes predicts."""
    import torch

    def size(tensor: Any) -> int:
        return tensor.numel() * tensor.element_size() if torch.is_tensor(tensor) else 0

    total = sum(size(tensor) for tensor in (*model.parameters(), *model.buffers()))
    for parameter in model.parameters():
        state = getattr(parameter, "quant_state", None)
        while state is not None:
            total += size(state.absmax) + size(state.code) + size(getattr(state, "offset", None))
            state = getattr(state, "state2", None)
        total += size(getattr(parameter, "SCB", None))
    return int(total)
