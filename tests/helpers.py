"""What the test files share (a test file never imports another): synthetic measurements and
calibrations from known parameters, and the helpers several files call. Importing it loads no torch
(what needs torch imports it inside the function): conftest.py sets the threads before torch loads."""

from __future__ import annotations

import copy
import functools
import itertools
import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchtrain.calibration.comm import CommModel
from benchtrain.calibration.fit import fit_measurements
from benchtrain.calibration.hardware import Hardware
from benchtrain.calibration.schema import SCHEMA_VERSION, read_calibration_file
from benchtrain.calibration.step_config import StepConfig
from benchtrain.calibration.topology import Link
from benchtrain.common.errors import BenchtrainError, guard_cli
from benchtrain.train.step.hardware import detect_hardware
from benchtrain.train.workload.model import resolve_model

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
TRUE_MEMORY = {
    "static": 2e9,
    "per_token": 4e5,
    "attention": 200.0,
    "per_token_checkpointed": 5e4,
    "attention_checkpointed": 20.0,
    "accumulated_gradients": 0.0,
}
GIB = 2**30


def micro_seconds(config: StepConfig, parameters: dict[str, float] = TRUE_THROUGHPUT) -> float:
    """The true seconds of one micro-step, written out here rather than taken from the fit's own
    features (calibration.fit.throughput_features), so a fit that recovers `parameters` from rows
    made with it shows that its features are right: a fixed cost; a cost per token and per token
    per token of context (attention); the optimizer step shared by the micro-steps of a step; the
    batches built in the training process (no workers) or supplied by the workers, each worker
    costing a little; and, with gradient checkpointing, the forward computed again."""
    tokens = config.micro_batch_size * config.seq_len
    workers = config.num_workers
    seconds = parameters["fixed"] + parameters["per_token"] * tokens + parameters["attention"] * tokens * config.seq_len
    seconds += parameters["optimizer_step"] / config.grad_accum
    seconds += parameters["serial_data"] * tokens if workers == 0 else parameters["worker_supply"] * tokens / workers
    seconds += parameters["per_worker"] * workers
    if config.gradient_checkpointing:
        seconds += (
            parameters["recompute_per_token"] * tokens + parameters["recompute_attention"] * tokens * config.seq_len
        )
    return float(seconds)


def peak_bytes(config: StepConfig, parameters: dict[str, float] = TRUE_MEMORY) -> float:
    """The true peak bytes of a step, written out here (not calibration.memory_fit.memory_features):
    the static bytes; the activations per token and per token of context, kept for backward or,
    with gradient checkpointing, only the checkpointed ones; and the gradients held between the
    micro-steps of an accumulating step."""
    tokens = config.micro_batch_size * config.seq_len
    if config.gradient_checkpointing:
        activations = (
            parameters["per_token_checkpointed"] * tokens
            + parameters["attention_checkpointed"] * tokens * config.seq_len
        )
    else:
        activations = parameters["per_token"] * tokens + parameters["attention"] * tokens * config.seq_len
    held = parameters["accumulated_gradients"] if config.grad_accum > 1 else 0.0
    return float(parameters["static"] + activations + held)


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
        config = StepConfig(micro_batch_size=b, num_workers=w, grad_accum=a, seq_len=s).switched(
            gradient_checkpointing=bool(c)
        )
        peak = peak_bytes(config) * (1 + rng.gauss(0, noise / 2))
        row: dict[str, Any] = {
            "micro_batch_size": b,
            "num_workers": w,
            "grad_accum": a,
            "seq_len": s,
            "gradient_checkpointing": c,
        }
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


def synthetic_calibration(
    rows: list[dict[str, Any]] | None = None, memory_bytes: float = 80 * GIB, **overrides: Any
) -> dict[str, Any]:
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


def lora_calibration(rank: int, **overrides: Any) -> dict[str, Any]:
    """A calibration of the tiny model measured here as a LoRA run of `rank` (train plans a LoRA run from it)."""
    return synthetic_calibration(
        synthetic_rows(),
        hardware=detect_hardware(),
        model={"name": "tiny", "parameter_count": 1, "fingerprint": resolve_model("tiny").fingerprint},
        training={"method": "lora", "lora": {"rank": rank}, "trainable_parameters": 10},
        id="test-lora",
        **overrides,
    )


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


def load_tokenized(
    path: str, tokenizer: Any, train_on: str = "assistant", schema: Any = None, split: str = "train"
) -> Any:
    """Every record of `path` tokenized through the product's own path (prepare_data, the cache
    included), exactly: the TokenizedData a run of that file trains on."""
    from benchtrain.common.console import say
    from benchtrain.train.workload.formats import DataSchema
    from benchtrain.train.workload.prepare import DataSpec, prepare_data
    from benchtrain.train.workload.tokens import TokenizedData

    prepared = prepare_data(DataSpec(path, train_on, schema or DataSchema(), split), tokenizer, say, exact=True)
    assert isinstance(prepared.view, TokenizedData)
    return prepared.view


def tokenized_from_samples(
    samples: list[Any],
    prompt_lengths: list[int] | None,
    format: str,
    source: str,
    loss_masks: list[Any] | None = None,
    loss_on: str = "all tokens",
) -> Any:
    """A TokenizedData in memory, from one array of token ids per sample."""
    from benchtrain.train.workload.tokens import TokenizedData, document_targets

    lengths = np.fromiter((len(sample) for sample in samples), dtype=np.int64, count=len(samples))
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    tokens = np.concatenate(samples).astype(np.int32) if samples else np.zeros(0, np.int32)
    mask = np.concatenate(loss_masks).astype(np.uint8) if loss_masks is not None and samples else None
    prompts = np.asarray(prompt_lengths, dtype=np.int32) if prompt_lengths is not None else None
    return TokenizedData(
        tokens, offsets, format, source, loss_on, mask, prompts, document_targets(lengths, mask, prompts)
    )


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


# -- shared by several test files (a test file never imports another) ----------------------------

# Enough probes for a fit (8), for tests that check what bench records rather than how well it fits.
TINY_GRID = [
    "--batch-sizes",
    "1,2",
    "--workers",
    "0",
    "--accum",
    "1,2",
    "--seq-lens",
    "32,64",
    "--max-probe-seconds",
    "0.2",
    "--quiet",
]
FIXTURE = Path(__file__).parent / "fixtures" / "h100-llama-3.2-1b-fullgrid.json"
DISTRIBUTED_CHECKS = Path(__file__).with_name("distributed_checks.py")
MACHINES = "h100:1,h100:2:nvlink,h200:1,a100-40gb:4:pcie,mi300x:1"
PRICES = "h100=2.5,h200=3.8,a100=1.2,mi300x=3"
CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]
PROMPT_IDS = [[5, 17, 99, 42, 7, 250, 3, 64]]
PEAK = 1e-3


def run_main(module: str, argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    package = {"report": "reports"}.get(module, module)
    main = __import__(f"benchtrain.{package}.cli", fromlist=["main"]).main
    code = guard_cli(main, argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(code: int, err: str, fragment: str, expected_code: int = 2) -> None:
    assert code == expected_code, err
    lines = [line for line in err.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and fragment in lines[0], err
    assert "Traceback" not in err


def dry_run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    return run_main("train", ["--dry-run", "--deadline", "12h", *argv], capsys)


def train_arguments(data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--data",
        str(data),
        "--effective-batch",
        "4",
        "--max-length",
        "64",
        "--workers",
        "0",
        "--out",
        str(out),
        *extra,
    ]


def h100_data() -> dict[str, Any]:
    return read_calibration_file(FIXTURE)


def cpu_calibration(
    identifier: str, processes: int = 1, fingerprint: str | None = None, **overrides: Any
) -> dict[str, Any]:
    """A synthetic calibration of this machine (fitted once per test session: fitting takes a second)."""
    return copy.deepcopy(_cpu_calibration(identifier, processes, fingerprint, json.dumps(overrides, sort_keys=True)))


@functools.cache
def _cpu_calibration(identifier: str, processes: int, fingerprint: str | None, overrides_json: str) -> dict[str, Any]:
    from benchtrain.train.step.hardware import detect_hardware
    from benchtrain.train.workload.model import resolve_model

    overrides = json.loads(overrides_json)
    distributed = None
    if processes > 1:
        comm = {"world_size": processes, "backend": "gloo", "latency_seconds": 0.002, "seconds_per_byte": 1e-9}
        distributed = {"world_size": processes, "backend": "gloo", "sharding": "ddp", "comm": comm}
    model = {"name": "tiny", "parameter_count": 1, "fingerprint": fingerprint or resolve_model("tiny").fingerprint}
    data = synthetic_calibration(id=identifier, hardware=detect_hardware(), model=model, **overrides)
    if distributed:
        data["distributed"] = distributed
    return data


def tokenized(lengths: list[int], fmt: str = "messages", prompt: int = 0) -> Any:
    rng = np.random.default_rng(0)
    samples = [rng.integers(3, 200, size=n).astype(np.int32) for n in lengths]
    return tokenized_from_samples(samples, [prompt] * len(lengths), fmt, "test")


def heavy_tailed(count: int = 400, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(min(2000, max(8, x))) for x in rng.lognormal(4.5, 0.8, size=count)]


def run_consider(machines: str, calibrations: list[dict[str, Any]], **options: Any) -> Any:
    from benchtrain.calibration.model import Calibration
    from benchtrain.train.recipes.config import TrainConfig
    from benchtrain.train.recipes.machines import consider, parse_machines
    from benchtrain.train.recipes.run_plan import PlanContext
    from benchtrain.train.step.hardware import detect_hardware
    from benchtrain.train.workload.data import length_profile
    from benchtrain.train.workload.method import MethodConfig
    from benchtrain.train.workload.model import resolve_model

    config = TrainConfig.of(
        data="test", dry_run=True, **{"deadline": "12h", "price_per_hour": PRICES, "model": "llama-3.2-1b", **options}
    )
    data = tokenized(heavy_tailed(400))
    loaded = [Calibration(copy.deepcopy(item)) for item in calibrations]
    context = PlanContext(config, resolve_model("llama-3.2-1b"), data, None, 0.0)
    return consider(
        context,
        MethodConfig(),
        loaded,
        Hardware.from_record(detect_hardware()),
        length_profile(data.lengths),
        parse_machines(machines),
    )


def chat_file(tmp_path: Path, count: int = 1) -> Path:
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps({"messages": CONVERSATION}) for _ in range(count)) + "\n")
    return path


def trained_text(tokenizer: Any, data: Any) -> str:
    """The text of the tokens that carry loss, as the DataLoader labels them."""
    from benchtrain.train.workload.batching import IGNORE_INDEX, PaddedBatches

    item = PaddedBatches(data, [[0]], 512, 0)[0]
    labels = item["labels"][0]
    return tokenizer.decode(item["input_ids"][0][labels != IGNORE_INDEX].tolist())


def local_calibration() -> Any:
    """A calibration for the tiny model on this machine, from synthetic (fast) measurements."""
    from benchtrain.calibration.model import Calibration
    from benchtrain.train.step.hardware import detect_hardware
    from benchtrain.train.workload.model import resolve_model

    spec = resolve_model("tiny")
    hardware = detect_hardware()
    rows = synthetic_rows(seq_lens=(32, 64, 128))
    data = synthetic_calibration(
        rows, hardware=hardware, model={"name": "tiny", "parameter_count": 1, "fingerprint": spec.fingerprint}
    )
    return Calibration(data)


def guard_checkpointing_every(seconds: float, on_overrun: str = "stop", keep: int = 2) -> Any:
    """A guard section that checkpoints every `seconds` (0: after every step, which no
    --checkpoint-interval can ask)."""
    from benchtrain.train.running.guard import GuardSection

    section = GuardSection(on_overrun=on_overrun, keep_checkpoints=keep)
    object.__setattr__(section, "checkpoint_interval", f"{seconds}s")
    object.__setattr__(section, "checkpoint_interval_seconds", float(seconds))
    return section


def make_run(
    tmp_path: Path,
    data_path: Path,
    tokenizer: Any,
    *,
    deadline: float,
    steps: int | None = None,
    resume: bool = False,
    hook: Any = None,
    on_overrun: str = "stop",
    out: str = "run",
    method: Any = None,
    checkpointing: bool = False,
    max_length: int = 64,
    clock: FakeClock | None = None,
) -> Any:
    """A TrainingRun of the tiny model on `data_path`, planned from local_calibration()."""
    import time
    from dataclasses import replace

    from benchtrain.train.planning.deadline import Deadline
    from benchtrain.train.planning.planner import make_plan
    from benchtrain.train.planning.types import PlanRequest
    from benchtrain.train.running.checkpoint import checkpoints_to_resume
    from benchtrain.train.running.loop import LoopHooks, LoopSettings, ModelToTrain, TrainingData, TrainingRun
    from benchtrain.train.workload.method import MethodConfig
    from benchtrain.train.workload.model import resolve_model

    calibration = local_calibration()
    data = load_tokenized(str(data_path), tokenizer)
    plan = make_plan(
        calibration,
        data,
        PlanRequest(
            epochs=1,
            deadline=Deadline.with_margin_share(1e6, 0.05),
            effective_batch=4,
            max_length=max_length,
            num_workers=0,
            max_steps=steps,
        ),
    )
    settings = LoopSettings(
        deadline=Deadline(deadline, 0.5, started_at=clock.now if clock else time.monotonic()),
        guard=guard_checkpointing_every(1e6, on_overrun=on_overrun),
        epochs=1,
        step_limit=steps,
        checkpoints=tuple(checkpoints_to_resume(tmp_path / out)) if resume else (),
        log_interval_seconds=0.5,
    )
    plan.chosen = replace(plan.chosen, config=plan.chosen.config.switched(gradient_checkpointing=checkpointing))
    return TrainingRun(
        calibration=calibration,
        chosen=plan.chosen,
        model=ModelToTrain(resolve_model("tiny"), method or MethodConfig()),
        data=TrainingData(data, tokenizer.pad_token_id),
        out_dir=tmp_path / out,
        settings=settings,
        hooks=LoopHooks(step_hook=hook),
    )


def trained(tmp_path: Path, data: Path, tokenizer: Any, method: Any) -> tuple[Any, Path]:
    """The tiny model after 3 steps on `data`, and its run folder."""
    run = make_run(tmp_path, data, tokenizer, deadline=1e6, steps=3, method=method)
    run.run()
    return run.accelerator.unwrap_model(run.engine.model), tmp_path / "run"


def logits(model: Any) -> Any:
    """The model's logits for PROMPT_IDS, in eval mode."""
    import torch

    model.eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor(PROMPT_IDS)).logits


def configs() -> dict[str, object]:
    from transformers import GPT2Config, LlamaConfig

    return {
        # gpt2's layers (Conv1D, a tied head), two blocks of them.
        "gpt2": GPT2Config(n_layer=2, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024),
        # Llama's (nn.Linear, an untied head, no biases), odd sizes: blocks that do not divide.
        "llama": LlamaConfig(
            hidden_size=200,
            intermediate_size=530,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=1003,
            tie_word_embeddings=False,
        ),
    }


def hide_bitsandbytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if bitsandbytes were not installed (its version unknown to importlib.metadata)."""
    import importlib.metadata

    real_version = importlib.metadata.version

    def without_bitsandbytes(name: str) -> str:
        if name == "bitsandbytes":
            raise importlib.metadata.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(importlib.metadata, "version", without_bitsandbytes)


def tiny_engine(settings: Any, optimizer: str = "adamw", total_steps: int | None = 4) -> Any:
    import torch
    from accelerate import Accelerator

    from benchtrain.train.step.engine import Optimization, StepOptions, engine_from_options
    from benchtrain.train.workload.method import MethodConfig
    from benchtrain.train.workload.model import resolve_model

    torch.manual_seed(0)
    options = StepOptions(compile="off", loss="plain")
    method = MethodConfig(optimizer=optimizer)
    return engine_from_options(
        resolve_model("tiny"),
        method,
        Accelerator(cpu=True),
        options,
        optimization=Optimization(PEAK, settings, total_steps),
    )


def batches(steps: int = 4) -> Any:
    from benchtrain.train.workload.batching import SyntheticBatches
    from benchtrain.train.workload.model import resolve_model

    return iter(SyntheticBatches(steps, 2, 16, resolve_model("tiny").config_dict["vocab_size"]))


def kernel(name: str, start_us: float, end_us: float) -> Any:
    """A device kernel as torch.profiler reports it (torch.autograd.profiler._parse_kineto_results)."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    return FunctionEvent(
        id=0, name=name, thread=7, start_us=start_us, end_us=end_us, device_type=DeviceType.CUDA, use_device="cuda"
    )


def link_from_all_reduce(model: CommModel) -> Link:
    """The link a measured all-reduce among `model.world_size` processes implies, by the ring
    formula backwards: latency per step = latency / 2(n−1), bandwidth = 2(n−1)/n / seconds per byte."""
    n = model.world_size
    if n < 2:
        raise BenchtrainError("an all-reduce of one process measures no link")
    steps = 2 * (n - 1)
    bandwidth = steps / n / model.seconds_per_byte if model.seconds_per_byte > 0 else float("inf")
    return Link(
        "loopback",
        bandwidth,
        model.latency_seconds / steps,
        0.0,
        f"measured: {model.backend} all-reduce among {n} processes",
    )


# -- nodes of a launched task, on this machine (tests/test_launch.py, tests/test_launch_phases.py) --------------


def free_port() -> int:
    """A port nobody listens on now (the rendezvous store's, on node 0)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def node_variables(engine: str, rank: int) -> dict[str, str]:
    """What the engine sets on node `rank` of two, both on this machine."""
    if engine == "skypilot":
        shared = {
            "SKYPILOT_NODE_IPS": "127.0.0.1\n127.0.0.1",
            "SKYPILOT_NUM_NODES": "2",
            "SKYPILOT_NUM_GPUS_PER_NODE": "0",
        }
        return {**shared, "SKYPILOT_NODE_RANK": str(rank)}
    shared = {"DSTACK_MASTER_NODE_IP": "127.0.0.1", "DSTACK_NODES_NUM": "2", "DSTACK_GPUS_PER_NODE": "0"}
    return {**shared, "DSTACK_NODE_RANK": str(rank)}


def start_nodes(script: Path, root: Path, logs: Path, engine: str = "skypilot") -> list[subprocess.Popen]:
    """The script on two nodes, each with the engine's variables as the engine sets them."""
    environment = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "OMP_NUM_THREADS": "1",
        "BENCHTRAIN_TASK_ROOT": str(root),  # the mounts' root (/benchtrain on a rented node)
        "BENCHTRAIN_MASTER_PORT": str(free_port()),
    }
    logs.mkdir(parents=True, exist_ok=True)
    nodes = []
    for rank in (0, 1):
        out, err = open(logs / f"node{rank}.out", "w"), open(logs / f"node{rank}.err", "w")
        node_environment = {**environment, **node_variables(engine, rank)}
        nodes.append(
            subprocess.Popen(
                ["bash", str(script)], env=node_environment, stdout=out, stderr=err, start_new_session=True
            )
        )
    return nodes


def wait_nodes(nodes: list[subprocess.Popen], logs: Path, timeout: float = 240) -> None:
    try:
        for node in nodes:
            node.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_nodes(nodes)
        pytest.fail(f"the nodes did not finish: {(logs / 'node0.err').read_text()[-3000:]}")
    for rank, node in enumerate(nodes):
        assert node.returncode == 0, (logs / f"node{rank}.err").read_text()[-3000:]


def kill_nodes(nodes: list[subprocess.Popen]) -> None:
    """The machines go: every process of every node (torchrun starts its workers in sessions of
    their own, so the whole tree, gathered first), at once, with no chance to save."""
    import psutil

    processes = []
    for node in nodes:
        try:
            root = psutil.Process(node.pid)
            processes += [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    for process in processes:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(processes, timeout=30)
    for node in nodes:
        node.wait()
