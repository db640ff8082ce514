"""THE training step: what `bench` measures and what `train` runs, one function for both, with one
host synchronisation per optimizer step. Design: docs/design.md#the-training-step"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from benchtrain.train.workload.batching import Batch, count_targets, to_device

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator
    from torch.optim.lr_scheduler import LRScheduler


@dataclass(frozen=True)
class StepResult:
    seconds: float
    data_wait_seconds: float
    loss: float
    tokens: int  # token positions computed, padding included
    target_tokens: int  # tokens that carry loss
    micro_batches: int
    shapes: tuple[tuple[int, ...], ...] = ()  # each micro-batch's (rows, length): a new one compiles
    learning_rate: float = 0.0  # what this step's optimizer step used
    # Each micro-step's seconds (its forward and backward, not its wait), on CPU only, where the
    # host's clock times the work; on a GPU it would take a synchronisation per micro-step.
    micro_step_seconds: tuple[float, ...] = ()


class StepTimer:
    """Wall time of a region, closed by a device synchronise (CUDA events on GPU)."""

    def __init__(self, device: torch.device) -> None:
        import torch

        self._cuda = device.type == "cuda"
        self._device = device
        if self._cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self._cuda:
            import torch

            # On this process's own device's stream (named, not whichever device is current).
            self._start.record(torch.cuda.current_stream(self._device))
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        if self._cuda:
            import torch

            self._end.record(torch.cuda.current_stream(self._device))
            torch.cuda.synchronize(self._device)  # the step's one wait for the GPU
            return self._start.elapsed_time(self._end) / 1000.0
        return time.perf_counter() - self._t0


@contextlib.contextmanager
def without_packed_sequence_check() -> Iterator[None]:
    """Skip transformers' search for several documents per row in the position ids (a host sync every
    forward without a mask): our rows never carry position ids, so it can only answer "none"."""
    import transformers.masking_utils as masking

    original = masking.find_packed_sequence_indices
    masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


class StepEngine(Protocol):
    """What the step runs on, as its engine (train.step.engine.Engine) owns it: the step reads it there at each run."""

    # Read-only here (properties), so that the engine's narrower types (a LambdaLR) satisfy it.
    @property
    def accelerator(self) -> Accelerator: ...
    @property
    def model(self) -> torch.nn.Module: ...
    @property
    def optimizer(self) -> torch.optim.Optimizer: ...
    @property
    def scheduler(self) -> LRScheduler: ...


class TrainingStep:
    def __init__(self, engine: StepEngine, max_grad_norm: float) -> None:
        self.engine = engine
        self.max_grad_norm = max_grad_norm
        device = engine.accelerator.device
        self.timer = StepTimer(device)
        # On CPU the host runs the work as it is issued: its clock times each micro-step for free.
        self.host_timed = device.type == "cpu"
        # Under DDP with gradient_as_bucket_view the gradients are views into its buckets and must stay so.
        self.bucket_views = bool(getattr(engine.model, "gradient_as_bucket_view", False))
        if self.bucket_views:
            settle_gradient_buckets(engine.accelerator, engine.model, engine.optimizer)

    def clear_gradients(self) -> None:
        """Gradients zeroed for the next step: in place under DDP's bucket views (docs/design.md#the-training-step), else freed."""
        self.engine.optimizer.zero_grad(set_to_none=not self.bucket_views)

    def run(self, batches: Iterator[Batch], grad_accum: int, synchronize: bool = True) -> StepResult:
        """One optimizer step over the next `grad_accum` micro-batches of `batches`. With `synchronize` False no micro-step all-reduces gradients (DDP): a step
        with no collective in it, whose failure on one process cannot leave the others waiting (bench.probe)."""
        import torch

        accelerator, model, optimizer = self.engine.accelerator, self.engine.model, self.engine.optimizer
        model.train()
        device = accelerator.device
        loss_sum = torch.zeros((), device=device)
        wait = 0.0
        tokens = target_tokens = 0
        shapes = []
        micro_seconds: list[float] = []
        self.timer.start()
        for index in range(grad_accum):
            waited_from = time.perf_counter()
            batch = next(batches)
            started = time.perf_counter()
            wait += started - waited_from
            # Counted by the DataLoader worker (count_targets); host tensors only, no device sync.
            counted = batch.get("target_tokens")
            target_tokens += int(counted) if counted is not None else count_targets(batch["labels"])
            tokens += batch["input_ids"].numel()
            shapes.append(tuple(batch["input_ids"].shape))
            batch = to_device(batch, device)
            last = index == grad_accum - 1
            # Gradients are all-reduced once, on the last micro-step.
            sync = contextlib.nullcontext() if last and synchronize else accelerator.no_sync(model)
            with sync, without_packed_sequence_check():
                # No attention mask: right-padded rows under causal attention never see padding, and
                # without one SDPA takes its causal fast path with no host sync on the mask.
                outputs = model(input_ids=batch["input_ids"], labels=batch["labels"])
                loss = outputs.loss / grad_accum
                accelerator.backward(loss)
            loss_sum += loss.detach()
            if self.host_timed:
                micro_seconds.append(time.perf_counter() - started)
        if self.max_grad_norm:
            accelerator.clip_grad_norm_(model.parameters(), self.max_grad_norm)
        learning_rate = float(optimizer.param_groups[0]["lr"])  # a host float: no sync
        optimizer.step()
        self.engine.scheduler.step()  # once per optimizer step, whatever the number of processes
        self.clear_gradients()
        seconds = self.timer.stop()
        return StepResult(
            seconds,
            wait,
            float(loss_sum.item()),
            tokens,
            target_tokens,
            grad_accum,
            tuple(shapes),
            learning_rate,
            micro_step_seconds=tuple(micro_seconds),
        )


def settle_gradient_buckets(accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Make a DDP model's gradients views into its buckets, and let DDP rebuild them, before the first
    real step: one fp32 copy of the gradients, not two (docs/design.md#the-training-step)."""
    import torch

    device = accelerator.device
    tokens = torch.zeros((1, 8), dtype=torch.long, device=device)
    with (
        torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
        torch.compiler.set_stance("force_eager"),
    ):
        for _ in range(2):  # the first records the order gradients become ready; the second's forward rebuilds
            with without_packed_sequence_check():
                loss = model(input_ids=tokens, labels=tokens).loss
                accelerator.backward(loss * 0.0)
    optimizer.zero_grad(set_to_none=False)
