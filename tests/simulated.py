"""A simulated GPU for tests and budget benchmarks: `bench run` at 8B/12B scale on a virtual clock.

Our users calibrate 7–12B models on an H100, where one probe costs seconds to minutes; CI has no
GPU. This device answers the coordinator's tasks (probe, eval, checkpoint, compile_cache) as an
H100 would, from the real H100 measurements of this project (calibration/bundled, llama-3.2-1b
full fine-tuning, 48 probes) scaled to the target model by its FLOPs, on a virtual clock, so that a
5-minute budget runs in a second. Everything above the device (budget, prices, probe choice,
timing loop, fit, record) is the code a real run takes.

From the measurements:
- a micro-step takes the longer of the host's launch time (measured at the smallest probes, per
  decoder layer) and the device's compute (the FLOPs over the FLOP/s the largest probes reached);
  the optimizer step adds its measured time per trainable parameter;
- peak memory = the bytes the model keeps (exact, from the `meta` device) + activations per token
  (measured per layer × hidden unit; with checkpointing only each layer's bf16 input plus one layer)
  + the gradients held while accumulating;
- model build seconds per byte of weights, checkpoint write bandwidth, DataLoader start-up.

Not measured on a GPU by this project, so set here (and said so in tests): a compilation of a new
shape (COMPILE_SECONDS) and step-to-step noise (NOISE).
"""

from __future__ import annotations

import json
import math
import random
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from benchtrain.bench.timing import ProbeSettings, time_steps
from benchtrain.calibration.step_config import StepConfig
from benchtrain.train.step.step import StepResult

# The real H100 calibration that ships with the package (also tests/fixtures).
FIXTURE = Path(__file__).resolve().parent.parent / "benchtrain" / "calibration" / "bundled" / "h100-llama-3.2-1b.json"
COMPILE_SECONDS = 40.0  # torch.compile of one decoder block of a 7-12B model, per new shape
NOISE = 0.004  # relative step-to-step spread of a steady GPU step


class VirtualClock:
    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self) -> float:
        return self.seconds

    def advance(self, seconds: float) -> None:
        self.seconds += max(0.0, seconds)


@dataclass(frozen=True)
class H100Measurements:
    """What the real H100 grid says, per unit that scales to another model."""

    host_seconds_per_layer: float  # per micro-step, where the host bounds the step
    flops_per_second: float  # what the largest probes reached
    optimizer_seconds_per_parameter: float
    activation_bytes_per_layer_unit: float  # per token, per layer × hidden unit
    build_seconds_per_byte: float
    disk_bytes_per_second: float
    start_seconds: float  # DataLoader and probe start-up outside the steps
    hardware: dict[str, Any]

    @classmethod
    def load(cls, path: Path = FIXTURE) -> H100Measurements:
        data = json.loads(path.read_text())
        model, overheads = data["model"], data["overheads"]
        rows = [row for row in data["measurements"] if row["status"] == "ok"]
        layers, hidden = model["layers"], model["heads"] * model["head_dim"]
        parameters = model["parameter_count"]
        flops_per_token = 6 * model["matmul_parameter_count"] + 12 * layers * hidden  # per unit of length, below

        def micro(row: dict[str, Any]) -> float:
            return row["step_seconds"] / row["grad_accum"]

        def compute(row: dict[str, Any]) -> float:
            tokens = row["micro_batch_size"] * row["seq_len"]
            return tokens * (6 * model["matmul_parameter_count"] + 12 * layers * hidden * row["seq_len"])

        assert flops_per_token > 0
        small = sorted(rows, key=lambda row: row["micro_batch_size"] * row["seq_len"])[:8]
        large = sorted(rows, key=lambda row: -row["micro_batch_size"] * row["seq_len"])[:8]
        by_accum = {a: statistics.median(micro(row) for row in large if row["grad_accum"] == a) for a in (1, 4)}
        # Accumulation 1 pays the whole optimizer step per micro-step, 4 a quarter of it.
        optimizer = max(0.0, (by_accum[1] - by_accum[4]) / (1 - 1 / 4))
        one = [row for row in rows if row["grad_accum"] == 1]
        two_sizes = sorted(one, key=lambda row: row["micro_batch_size"] * row["seq_len"])
        low, high = two_sizes[0], two_sizes[-1]
        per_token = (high["peak_memory_bytes"] - low["peak_memory_bytes"]) / (
            high["micro_batch_size"] * high["seq_len"] - low["micro_batch_size"] * low["seq_len"]
        )
        start = statistics.median(
            row["probe_seconds"] - row["warmup_seconds"] - row["step_seconds"] * row["timed_steps"] for row in rows
        )
        return cls(
            host_seconds_per_layer=statistics.median(micro(row) for row in small) / layers,
            flops_per_second=statistics.median(
                compute(row) / (micro(row) - optimizer / row["grad_accum"]) for row in large
            ),
            optimizer_seconds_per_parameter=optimizer / parameters,
            activation_bytes_per_layer_unit=per_token / (layers * hidden),
            build_seconds_per_byte=overheads["model_build_seconds"] / (parameters * 4),
            disk_bytes_per_second=overheads["checkpoint_bytes"] / overheads["checkpoint_save_seconds"],
            start_seconds=max(0.0, start),
            hardware=data["hardware"],
        )


@dataclass
class SimulatedDevice:
    """One H100 running the target model's step (bench.calibrate's coordinator interface)."""

    measured: H100Measurements
    flops_per_token: Any  # StepConfig -> FLOPs per token (the target's, recompute included)
    forward_flops_per_token: float
    layers: int
    hidden: int
    static_bytes: float
    trainable_parameters: int
    weight_bytes: float
    checkpoint_bytes: int
    clock: VirtualClock = field(default_factory=VirtualClock)
    seed: int = 0
    world_size: int = 1
    leads: bool = True
    compile_seconds: float = COMPILE_SECONDS  # per new shape of a compiled step (0: eager)
    log: list[dict[str, Any]] = field(default_factory=list)  # every probe: when, how long, predicted peak

    def __post_init__(self) -> None:
        self.random = random.Random(self.seed)
        self.compiled_shapes: set[Any] = set()

    @property
    def hardware(self) -> dict[str, Any]:
        return self.measured.hardware

    @property
    def build_seconds(self) -> float:
        return self.weight_bytes * self.measured.build_seconds_per_byte

    # -- the device's physics ---------------------------------------------------------------
    def micro_seconds(self, config: StepConfig) -> float:
        tokens = config.micro_batch_size * config.seq_len
        device = tokens * self.flops_per_token(config) / self.measured.flops_per_second
        return max(self.layers * self.measured.host_seconds_per_layer, device)

    def step_seconds(self, config: StepConfig) -> float:
        optimizer = self.trainable_parameters * self.measured.optimizer_seconds_per_parameter
        return config.grad_accum * self.micro_seconds(config) + optimizer

    def peak_bytes(self, config: StepConfig) -> float:
        tokens = config.micro_batch_size * config.seq_len
        unit = self.measured.activation_bytes_per_layer_unit
        if config.gradient_checkpointing:
            per_token = self.layers * self.hidden * 2 + unit * self.hidden  # bf16 layer inputs + one layer
        else:
            per_token = unit * self.layers * self.hidden
        accumulating = 4 * self.trainable_parameters if config.grad_accum > 1 else 0
        return self.static_bytes + per_token * tokens + accumulating

    # -- the coordinator's interface --------------------------------------------------------
    def run(self, task: str, payload: dict[str, Any]) -> dict[str, Any]:
        return getattr(self, f"_{task}")(payload)

    def finish(self) -> None:
        return None

    def _probe(self, payload: dict[str, Any]) -> dict[str, Any]:
        from benchtrain.bench.probe import finish_row

        config = StepConfig.from_row(payload["config"])
        settings = ProbeSettings(**payload["settings"])
        started = self.clock()
        row: dict[str, Any] = {**config.to_row(), "status": "ok"}
        shape = (config.micro_batch_size, config.seq_len, config.switches)  # bench.space.shape_of
        row["new_shape"] = shape not in self.compiled_shapes
        peak = self.peak_bytes(config)
        self.clock.advance(self.measured.start_seconds)
        if peak > self.hardware["memory_bytes"]:
            # Out of memory in the first step, after compiling it.
            self.clock.advance(self.compile_seconds if row["new_shape"] else 0.0)
            row.update(
                status="oom",
                error="OutOfMemoryError: CUDA out of memory (simulated)",
                probe_seconds=self.clock() - started,
            )
            self._log(row, started, peak)
            return row
        first = [True]

        def step() -> StepResult:
            seconds = self.step_seconds(config) * (1 + self.random.gauss(0, NOISE))
            if first[0] and row["new_shape"]:
                seconds += self.compile_seconds
            first[0] = False
            self.clock.advance(seconds)
            return StepResult(seconds, 0.0, 1.0, 0, 0, config.grad_accum)

        timing = time_steps(step, settings, self.clock)
        self.compiled_shapes.add(shape)
        row["probe_seconds"] = self.clock() - started
        finish_row(row, config, timing, int(peak), self.flops_per_token(config), self.hardware["peak_bf16_flops"])
        self._log(row, started, peak)
        return row

    def _log(self, row: dict[str, Any], started: float, peak: float) -> None:
        self.log.append(
            {
                "config": StepConfig.from_row(row),
                "status": row["status"],
                "started": started,
                "ended": self.clock(),
                "peak_bytes": peak,
            }
        )

    def _eval(self, payload: dict[str, Any]) -> dict[str, Any]:
        config = StepConfig.from_row(payload)
        tokens = config.micro_batch_size * config.seq_len
        batch = max(
            self.layers * self.measured.host_seconds_per_layer / 3,
            tokens * self.forward_flops_per_token / self.measured.flops_per_second,
        )
        self.clock.advance(5 * batch)
        return {
            "micro_batch_size": config.micro_batch_size,
            "seq_len": config.seq_len,
            "status": "ok",
            "batch_seconds": batch,
            "tokens_per_second": tokens / batch,
        }

    def _checkpoint(self, payload: dict[str, Any]) -> dict[str, Any]:
        written = min(self.checkpoint_bytes, payload["max_bytes"])
        self.clock.advance(written / self.measured.disk_bytes_per_second)
        seconds = self.checkpoint_bytes / self.measured.disk_bytes_per_second
        return {
            "checkpoint_save_seconds": round(seconds, 4),
            "checkpoint_bytes": self.checkpoint_bytes,
            "disk_write_bytes_per_second": round(self.measured.disk_bytes_per_second),
            "checkpoint_extrapolated": int(written < self.checkpoint_bytes),
        }

    def _compile_cache(self, payload: dict[str, Any]) -> dict[str, Any]:
        config = StepConfig.from_row({**payload["row"], "grad_accum": 1, "num_workers": 0})
        step = self.step_seconds(config)
        cached = self.compile_seconds / 4  # from inductor's on-disk cache: no autotuning, no codegen
        self.clock.advance(self.build_seconds + cached + 4 * step)
        return {"first_step_seconds": step + cached, "step_seconds": step}


@dataclass
class ReplayedDevice(SimulatedDevice):
    """The real H100 grid itself (llama-3.2-1b, full fine-tuning, not compiled): each probe's step
    and peak are what that probe measured on the H100; what ran out of memory there (or was
    skipped as larger than an OOM) runs out of memory here."""

    measured_rows: dict[StepConfig, dict[str, Any]] = field(default_factory=dict)

    def _row(self, config: StepConfig) -> dict[str, Any] | None:
        row = self.measured_rows.get(config.switched(gradient_checkpointing=False))
        return row if row is not None and row["status"] == "ok" else None

    def step_seconds(self, config: StepConfig) -> float:
        row = self._row(config)
        return float(row["step_seconds"]) if row else math.inf

    def peak_bytes(self, config: StepConfig) -> float:
        row = self._row(config)
        return float(row["peak_memory_bytes"]) if row else math.inf


def simulated_h100(
    model: Any, lora: bool, seed: int = 0, replay: bool = False
) -> tuple[SimulatedDevice, Any, Any, Any]:
    """(device, spec, method, memory need) for a preset on a simulated H100 80 GB."""
    from benchtrain.train.planning.memory_check import compute_bytes, memory_need, meta_model
    from benchtrain.train.workload.method import MethodConfig
    from benchtrain.train.workload.model import model_shape, resolve_model

    measured = H100Measurements.load()
    # a preset name, or a spec (a layer slice: bench.layer_slices)
    spec = resolve_model(model) if isinstance(model, str) else model
    method = MethodConfig(method="lora") if lora else MethodConfig()
    need = memory_need(spec, method, "cuda")
    shape = model_shape(meta_model(spec, method))
    hidden = int(spec.config_dict.get("hidden_size") or spec.config_dict["n_embd"])
    device = SimulatedDevice(
        measured=measured,
        flops_per_token=lambda config: shape.flops_per_token(config.seq_len, lora=lora, switches=config.switches),
        forward_flops_per_token=shape.forward_flops_per_token(1024, lora),
        layers=shape.layers,
        hidden=hidden,
        static_bytes=float(need.total_bytes),
        trainable_parameters=need.trainable_parameters,
        weight_bytes=float(need.weights_bytes),
        checkpoint_bytes=need.trainable_parameters * 12,
        seed=seed,
    )
    if replay:
        rows = json.loads(FIXTURE.read_text())["measurements"]
        fields = {
            name: value for name, value in device.__dict__.items() if name in SimulatedDevice.__dataclass_fields__
        }
        device = ReplayedDevice(
            **{**fields, "compile_seconds": 0.0, "measured_rows": {StepConfig.from_row(row): row for row in rows}}
        )
    assert compute_bytes("cuda") == 2
    return device, spec, method, need


def simulate_bench(
    model: Any,
    lora: bool,
    budget: float | str | None,
    checkpointing: tuple[int, ...] = (0,),
    seed: int = 0,
    say: Any = lambda line: None,
    replay: bool = False,
) -> tuple[dict[str, Any], SimulatedDevice]:
    """`bench run --gpu h100 --model MODEL [--lora] --checkpointing … --budget …` on the simulated
    H100: the same planner, budget, runner, timing loop, evaluation/checkpoint/compile timings and
    fit as a real run (bench.variant_measurement); the device and the clock are simulated."""
    bench = simulated_setup(model, lora, budget, checkpointing, seed, replay)
    return run_simulated(bench, budget, say), bench.device


@dataclass
class SimulatedBench:
    """A simulated `bench run` planned, not yet run: its device, task and probe planner (what
    bench.layer_slices prices each slice depth with before running any)."""

    device: SimulatedDevice
    task: Any  # bench.calibrate.BenchTask
    planner: Any  # bench.choose.ProbePlanner


def simulated_setup(
    model: Any,
    lora: bool,
    budget: float | str | None,
    checkpointing: tuple[int, ...] = (0,),
    seed: int = 0,
    replay: bool = False,
) -> SimulatedBench:
    """The device, the task and the planner of a simulated bench, as `bench run` has them before
    building the model."""

    from benchtrain.bench.calibrate import BenchTask, plan_probes
    from benchtrain.bench.space import default_space
    from benchtrain.train.planning.memory_check import meta_model
    from benchtrain.train.step.engine import StepOptions
    from benchtrain.train.step.hardware import detect_software
    from benchtrain.train.workload.method import method_record
    from benchtrain.train.workload.model import model_record, model_shape

    device, spec, method, need = simulated_h100(model, lora, seed, replay)
    hardware = device.hardware
    space = default_space("cuda", hardware["memory_bytes"]).with_axes(checkpointing=checkpointing)
    compiled = not replay  # the real grid was measured eager
    meta = meta_model(spec, method)
    task = BenchTask(
        space=space,
        settings=ProbeSettings.for_device("cuda").for_budget(budget if isinstance(budget, (int, float)) else None),
        hardware=hardware,
        software={**detect_software(), "simulated": "tests/simulated.py (H100 measurements scaled by FLOPs)"},
        model=model_record(spec, model_shape(meta)),
        training={
            **method_record(method, meta),
            "compile": compiled,
            "loss": "liger",
            "sharding": "ddp",
            "flops_terms": model_shape(meta).flops_terms(lora),
        },
        device_label="h100",
        requested_device="h100",
        compiled=compiled,
        budget_auto=budget == "auto",
    )
    planner, prices = plan_probes(task, spec, method, need, StepOptions(compile="on" if compiled else "off"))
    # The disk's speed is the measured H100 host's, not this machine's.
    task = replace(task, prices=replace(prices, disk_bytes_per_second=device.measured.disk_bytes_per_second))
    return SimulatedBench(device, task, planner)


def run_simulated(bench: SimulatedBench, budget: float | str | None, say: Any = lambda line: None) -> dict[str, Any]:
    """The planned bench run on its device's clock, from the clock's time now."""
    from benchtrain.bench.calibrate import BenchRun, after_probes_seconds, calibrate
    from benchtrain.bench.outlook import outlook, refuse_if_too_small, settle_budget
    from benchtrain.bench.runner import Budget

    device, task, planner = bench.device, bench.task, bench.planner
    started = device.clock()
    # A second for imports, hardware detection and the meta model, as on a real machine.
    device.clock.advance(1.0)
    seconds = settle_budget(planner, budget, device.clock() - started, after_probes_seconds(task, planner), say)
    device.clock.advance(device.build_seconds)
    refuse_if_too_small(outlook(planner, seconds, device.clock() - started, after_probes_seconds(task, planner)))
    record, _ = calibrate(BenchRun(task, device, planner, Budget(seconds, started, device.clock)), device.build_seconds)
    return record
