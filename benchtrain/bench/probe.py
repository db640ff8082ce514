"""One probe: the trainer's own step at one configuration, warmed up, then timed for as long as the
statistics need and the budget allows (bench.timing). Out of memory is a result, not a crash.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

from benchtrain.bench.space import Shape, shape_of
from benchtrain.bench.timing import ProbeSettings, StepTiming, spread, time_steps
from benchtrain.calibration.step_config import StepConfig
from benchtrain.common.heap import collect_everything
from benchtrain.common.json_types import JsonDict
from benchtrain.train.step.compile import eager_region
from benchtrain.train.step.engine import StepOptions, engine_from_options
from benchtrain.train.step.metrics import data_wait_share, step_figures
from benchtrain.train.step.peak_memory import PeakMemory
from benchtrain.train.step.runtime import agree, is_out_of_memory, make_accelerator, pin_memory
from benchtrain.train.step.step import StepResult, StepTimer, without_packed_sequence_check
from benchtrain.train.workload.batching import (
    Batch,
    PackedBatches,
    SyntheticBatches,
    make_loader,
    plan_packed_batches,
    to_device,
)
from benchtrain.train.workload.method import MethodConfig, method_record, unwrap
from benchtrain.train.workload.model import ModelShape, ModelSpec, model_shape
from benchtrain.train.workload.tokens import TokenizedData

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator, PartialState


class Workload:
    """Model, optimizer and step built once per benchmark, exactly as `train` builds them."""

    def __init__(
        self,
        spec: ModelSpec,
        data: TokenizedData | None = None,
        method: MethodConfig | None = None,
        options: StepOptions | None = None,
    ) -> None:
        started = time.perf_counter()
        self.spec = spec
        self.data = data
        self.method = method or MethodConfig()
        self.accelerator = make_accelerator()
        # The model, optimizer and step: the engine's, switched to each probe's mode (Engine.switch).
        self.engine = engine_from_options(spec, self.method, self.accelerator, options or StepOptions())
        model = self.engine.model
        self.shape: ModelShape = model_shape(model)
        self.training = {**method_record(self.method, model), **self.engine.record()}
        self.vocab_size = int(unwrap(model).config.vocab_size)
        self.pin_memory = pin_memory(self.accelerator)
        # (rows, length, switches) already run: with a compiled step, a new one compiles.
        self.seen_shapes: set[Shape] = set()
        self.build_seconds = time.perf_counter() - started

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def release(self) -> None:
        """Drop the model, optimizer and step and give their device memory back, before another
        process builds the same model on this device. No probe runs after."""
        self.engine = None  # type: ignore[assignment]
        self.accelerator.free_memory()  # accelerate keeps references to what it prepared
        collect_everything()  # the model may sit in the collector's frozen generation (common.heap)
        if self.device.type == "cuda":
            import torch

            torch.cuda.empty_cache()

    def set_loss(self, kind: str) -> None:
        """Compute the loss with `kind` from now on, through the engine (the step keeps train's precision)."""
        self.engine.use_loss(kind)
        self.training["loss"] = kind

    def flops_per_token(self, config: StepConfig) -> float:
        return self.shape.flops_per_token(config.seq_len, lora=self.method.is_lora, switches=config.switches)

    def batches(self, config: StepConfig, count: int) -> SyntheticBatches | PackedBatches:
        """`count` micro-batches: real tokens packed at seq_len with --data, else synthetic."""
        if self.data is None:
            return SyntheticBatches(count, config.micro_batch_size, config.seq_len, self.vocab_size)
        rows = count * config.micro_batch_size
        plan = plan_packed_batches(rows, config.micro_batch_size, seed=0, epoch=0)
        return PackedBatches(self.data, plan, config.seq_len)


def run_probe(
    workload: Workload, config: StepConfig, settings: ProbeSettings, peak_flops: float | None = None
) -> JsonDict:
    """A measurement row (status ok / oom / error / skipped) for one configuration."""
    row: dict[str, Any] = {**config.to_row(), "status": "ok"}
    started = time.perf_counter()
    workload.engine.switch(config.switches)
    shape = shape_of(config)
    # The first probe of a shape pays its compilation in the warm-up (bench.calibrate.warmup_costs).
    row["new_shape"] = shape not in workload.seen_shapes
    workload.seen_shapes.add(shape)
    steps_needed = settings.warmup_steps + settings.max_steps
    loader = make_loader(
        workload.batches(config, steps_needed * config.grad_accum), config.num_workers, workload.pin_memory
    )
    iterator = iter(loader)
    timing = None
    try:
        with PeakMemory(workload.device) as memory:
            # Under several processes every rank runs the same steps (each one all-reduces):
            # a stop decision on any rank stops them all.
            timing = time_steps(
                partial(agreed_step, workload, partial(workload.engine.step.run, iterator, config.grad_accum)),
                settings,
                time.perf_counter,
                lambda flag: agree(workload.accelerator, flag, "max"),
                first_step=partial(first_step_agreed, workload, iterator, config.grad_accum),
            )
    except Exception as error:  # a failed probe is data, not a crash
        mark_failed(row, error)
    finally:
        del iterator, loader
    row["probe_seconds"] = round(time.perf_counter() - started, 4)
    if row["status"] != "ok":
        # Outside the except block: the exception's traceback no longer pins the step's tensors.
        recover_after_failure(workload)
        return row
    assert timing is not None
    row["loss"] = workload.engine.setup.loss
    row.update(memory.record())  # on CUDA: reserved, device used, outside PyTorch (beside the allocated peak)
    return finish_row(row, config, timing, int(memory.peak_bytes), workload.flops_per_token(config), peak_flops)


def finish_row(
    row: JsonDict,
    config: StepConfig,
    timing: StepTiming,
    peak_bytes: int,
    flops_per_token: float,
    peak_flops: float | None,
) -> JsonDict:
    """The row's figures from the timed steps (a real probe's and a simulated one's alike): the
    median step, which a step slowed by other work does not move, and the mean (a run lasts the sum
    of its steps), which the fit relates to the median with a factor measured over probes."""
    row["first_step_seconds"] = timing.first_step_seconds
    row["warmup_seconds"] = timing.warmup_seconds
    row.update(timing.record())
    if not timing.complete:
        # The budget ended before a timed step: what the warm-up cost is kept for planning.
        row["status"] = "skipped"
        row["error"] = "skipped: the budget ended before a timed step"
        return row
    steps = timing.step_seconds
    median_seconds = statistics.median(steps)
    tokens = config.micro_batch_size * config.seq_len * config.grad_accum
    figures = step_figures(tokens, median_seconds, statistics.median(timing.wait_seconds), flops_per_token, peak_flops)
    row.update(
        tokens_per_second=figures["computed_tokens_per_second"],
        step_seconds=median_seconds,
        step_seconds_mean=statistics.fmean(timing.raw_step_seconds or steps),  # as timed: a run lasts their sum
        step_seconds_median=median_seconds,
        step_seconds_spread=spread(steps),
        step_seconds_min=min(steps),
        step_seconds_max=max(steps),
        data_wait_share=data_wait_share(sum(timing.wait_seconds), sum(steps)),  # over all timed steps
        peak_memory_bytes=peak_bytes,
        load_average=machine_load(),
        mfu=figures["mfu"],
        tflops=figures["tflops"],
    )
    return row


class FailedOnAnotherProcess(RuntimeError):
    """This process's step went well; another's did not (that one's row says how)."""


def first_step_agreed(workload: Workload, batches: Iterator[Batch], grad_accum: int) -> None:
    """The probe's first step without DDP's gradient all-reduce, then every process's outcome agreed:
    a configuration runs out of memory in its first step, and an OOM on one process alone would leave
    the others in the all-reduce until the watchdog kills the job. (Under FSDP the forward gathers.)"""
    agreed_step(workload, partial(workload.engine.step.run, batches, grad_accum, synchronize=False))


def agreed_step(workload: Workload, run_step: Callable[[], StepResult]) -> Any:
    """`run_step()`, then every process's outcome agreed (one small all-reduce, outside the step's
    timer): a failure on one process after its step's last collective (the optimizer's step, the
    scheduler) raises on every process, so none goes on into the next step's collectives alone."""
    return agreed_outcome(workload.accelerator, run_step)


def agreed_outcome(accelerator: Accelerator | PartialState, run_step: Callable[[], StepResult]) -> StepResult | None:
    """`run_step()` on every process of `accelerator`'s job, its outcome agreed: a failure on one raises on all."""
    failure: Exception | None = None
    result = None
    try:
        result = run_step()
    except Exception as error:  # reported after every process has said how its step went
        failure = error
    if agree(accelerator, int(failure is not None), "max"):
        raise failure or FailedOnAnotherProcess("the probe failed on another process")
    return result


EVAL_STEPS = 4  # timed forward batches per eval probe (one more as warm-up)


def run_eval_probe(workload: Workload, config: StepConfig, steps: int = EVAL_STEPS) -> JsonDict:
    """Forward passes only (no gradients), as `train` evaluates: seconds per micro-batch."""
    import torch

    row: dict[str, Any] = {"micro_batch_size": config.micro_batch_size, "seq_len": config.seq_len, "status": "ok"}
    loader = make_loader(workload.batches(config, steps + 1), 0, workload.pin_memory)
    timer = StepTimer(workload.device)
    seconds: list[float] = []
    model = workload.engine.model
    model.eval()
    try:
        with (
            torch.no_grad(),
            workload.accelerator.autocast(),
            eager_region(workload.engine.setup.compiled),
            without_packed_sequence_check(),
        ):
            for index, batch in enumerate(loader):
                batch = to_device(batch, workload.device)
                timer.start()
                model(input_ids=batch["input_ids"], labels=batch["labels"])
                elapsed = timer.stop()
                if index:  # the first is warm-up
                    seconds.append(elapsed)
    except Exception as error:
        mark_failed(row, error)
    finally:
        model.train()
        del loader
    if row["status"] != "ok":
        recover_after_failure(workload)
        return row
    row["batch_seconds"] = statistics.median(seconds)
    row["tokens_per_second"] = config.micro_batch_size * config.seq_len / row["batch_seconds"]
    return row


def machine_load() -> float | None:
    """The 1-minute load average: how busy this machine was (other work included)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def error_text(error: BaseException) -> str:
    """An error in one line of a row: its type and its message's first line."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def mark_failed(row: JsonDict, error: BaseException) -> None:
    row["status"] = "oom" if is_out_of_memory(error) else "error"
    row["error"] = error_text(error)


def recover_after_failure(workload: Workload) -> None:
    """Drop half-built gradients and cached blocks so the next probe starts clean."""
    workload.engine.step.clear_gradients()
    gc.collect()
    if workload.device.type == "cuda":
        import torch

        torch.cuda.empty_cache()
