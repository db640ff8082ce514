"""The probe workload of `benchtrain.calibrate(trainer)`: THE USER'S Trainer step at one configuration. Batches of
their train dataset (their columns, cut where the probe's length ends) through their data collator in a DataLoader
with the probe's workers; their `training_step` (their loss, under their precision's autocast) for each micro-batch,
gradients all-reduced on the last one under several processes; clipping as their arguments say and a step of an
optimizer built as their Trainer builds it, never kept. Timed by bench's probe loop (bench.timing), a failure (an
out-of-memory) a row. Why: docs/design.md#calibrate-a-trainer"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

from benchtrain.bench.probe import EVAL_STEPS, agreed_outcome, finish_row, mark_failed
from benchtrain.bench.timing import ProbeSettings, time_steps
from benchtrain.calibration.step_config import Mode, StepConfig
from benchtrain.common.errors import BenchtrainError
from benchtrain.common.json_types import JsonDict
from benchtrain.train.planning.comm import measure_collectives
from benchtrain.train.step.peak_memory import PeakMemory
from benchtrain.train.step.runtime import agree
from benchtrain.train.step.step import StepResult, StepTimer
from benchtrain.train.step.switches import set_switches
from benchtrain.train.workload.model import ModelShape, model_shape

if TYPE_CHECKING:
    import torch

# Rows read from the train dataset to learn its lengths and draw the probes' samples from (evenly spaced).
SAMPLED_ROWS = 1024
# Shortest length probed: shorter steps time the host, not the model.
MIN_PROBE_LENGTH = 16


class TrainerWorkload:
    """A user's Trainer as bench's probes run it (the tasks of `handlers`)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.accelerator = trainer.accelerator
        self.model: torch.nn.Module = trainer.model
        self.shape: ModelShape = model_shape(self.model)
        self.lora = hasattr(self.model, "peft_config")
        self.samples = sampled_rows(trainer)
        self.lengths = [len(sample["input_ids"]) for sample in self.samples]
        self.switches_on: Mode = tuple(
            name for name in ("gradient_checkpointing",) if getattr(self.model, "is_activation_checkpointing", False)
        )
        self.stepped = self.model  # what the step runs: the model, or DDP around it under several processes
        self.optimizer: torch.optim.Optimizer | None = None
        self.timer = StepTimer(self.device)

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    # -- what the planner prices ------------------------------------------------------------------
    def flops_per_token(self, config: StepConfig) -> float:
        return self.shape.flops_per_token(config.seq_len, lora=self.lora, switches=config.switches)

    # -- the probes' state, made once and taken down after ----------------------------------------
    def start(self) -> None:
        """The optimizer the Trainer would build (its class and groups: `create_optimizer`), left off the Trainer, and
        DDP around the model under several processes (what the Trainer's accelerator would wrap it in)."""
        trainer = self.trainer
        given = trainer.optimizer
        if given is not None:  # the user's own optimizer: one of its class with its settings, never theirs
            groups = [{**group, "params": list(group["params"])} for group in given.param_groups]
            self.optimizer = type(given)(groups, **given.defaults)
        else:
            self.optimizer = trainer.create_optimizer()
            trainer.optimizer = None
        if self.accelerator.num_processes > 1:
            from torch.nn.parallel import DistributedDataParallel

            cuda = self.device.type == "cuda"
            self.stepped = DistributedDataParallel(
                self.model,
                device_ids=[self.device.index] if cuda else None,
                find_unused_parameters=bool(trainer.args.ddp_find_unused_parameters),
            )

    def stop(self) -> None:
        self.optimizer = None
        self.stepped = self.model
        set_switches(self.model, (), self.switches_on)
        self.switches_on = ()

    def switch(self, config: StepConfig) -> None:
        set_switches(self.model, config.switches, self.switches_on)
        self.switches_on = config.switches

    # -- batches ----------------------------------------------------------------------------------
    def loader(self, config: StepConfig, count: int) -> Any:
        """`count` micro-batches of `config`'s rows, each row a sample of at least its length cut there, collated by the
        Trainer's collator in a DataLoader with its workers (as the Trainer's own loader collates)."""
        from torch.utils.data import DataLoader

        pool = [sample for sample in self.samples if len(sample["input_ids"]) >= config.seq_len]
        rows = [cut(pool[index % len(pool)], config.seq_len) for index in range(count * config.micro_batch_size)]
        args = self.trainer.args
        return DataLoader(
            rows,  # type: ignore[arg-type]  # a list is a map-style dataset
            batch_size=config.micro_batch_size,
            shuffle=False,
            collate_fn=self.trainer.data_collator,
            num_workers=config.num_workers,
            pin_memory=bool(args.dataloader_pin_memory) and self.device.type == "cuda",
            drop_last=True,
        )

    # -- the step ---------------------------------------------------------------------------------
    def step(self, batches: Iterator[JsonDict], grad_accum: int, synchronize: bool = True) -> StepResult:
        """One optimizer step of the Trainer's over the next `grad_accum` micro-batches."""
        import torch

        trainer, model, optimizer = self.trainer, self.stepped, self.optimizer
        assert optimizer is not None
        wait = 0.0
        micro_seconds: list[float] = []
        tokens = 0
        loss_sum = 0.0
        self.timer.start()
        waited_from = time.perf_counter()
        micro_batches = [next(batches) for _ in range(grad_accum)]
        wait = time.perf_counter() - waited_from
        # The Trainer counts the targets of the whole accumulation once, before its micro-steps.
        items = trainer._get_num_items_in_batch(micro_batches, self.device)
        trainer.current_gradient_accumulation_steps = grad_accum
        for index, batch in enumerate(micro_batches):
            started = time.perf_counter()
            tokens += int(batch["input_ids"].numel())
            last = index == grad_accum - 1
            sync = contextlib.nullcontext() if last and synchronize else self.accelerator.no_sync(model)
            with sync, self.accelerator.autocast():
                loss = trainer.training_step(model, batch, items)
            loss_sum += float(loss.detach())
            if self.device.type == "cpu":
                micro_seconds.append(time.perf_counter() - started)
        if trainer.args.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), trainer.args.max_grad_norm)
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        self.model.zero_grad(set_to_none=True)
        seconds = self.timer.stop()
        return StepResult(
            seconds, wait, loss_sum, tokens, tokens, grad_accum, (), micro_step_seconds=tuple(micro_seconds)
        )

    def agreed(self, run_step: Callable[[], StepResult]) -> StepResult | None:
        """`run_step()`, then every process's outcome agreed: a failure on one raises on all (bench.probe)."""
        return agreed_outcome(self.accelerator, run_step)

    def clear(self) -> None:
        """After a failed probe: gradients dropped, memory given back."""
        self.model.zero_grad(set_to_none=True)
        gc.collect()
        if self.device.type == "cuda":
            import torch

            torch.cuda.empty_cache()

    # -- the tasks --------------------------------------------------------------------------------
    def probe(self, config: StepConfig, settings: ProbeSettings, peak_flops: float | None) -> JsonDict:
        """A measurement row (status ok / oom / error / skipped) for one configuration, as bench.probe.run_probe makes it."""
        row: dict[str, Any] = {**config.to_row(), "status": "ok", "new_shape": False}
        started = time.perf_counter()
        timing = None
        try:
            self.switch(config)
            iterator = iter(self.loader(config, (settings.warmup_steps + settings.max_steps) * config.grad_accum))
            with PeakMemory(self.device) as memory:
                timing = time_steps(
                    partial(self.agreed, partial(self.step, iterator, config.grad_accum)),  # type: ignore[arg-type]
                    settings,
                    time.perf_counter,
                    lambda flag: agree(self.accelerator, flag, "max"),
                    first_step=partial(self.agreed, partial(self.step, iterator, config.grad_accum, synchronize=False)),
                )
            del iterator
        except Exception as error:  # a failed probe is data, not a crash
            mark_failed(row, error)
        row["probe_seconds"] = round(time.perf_counter() - started, 4)
        if row["status"] != "ok":
            self.clear()
            return row
        assert timing is not None
        row["loss"] = "trainer"
        row.update(memory.record())
        return finish_row(row, config, timing, int(memory.peak_bytes), self.flops_per_token(config), peak_flops)

    def evaluate(self, config: StepConfig, steps: int = EVAL_STEPS) -> JsonDict:
        """Forward passes only, as the Trainer evaluates (its loss, no gradients): seconds per micro-batch."""
        import torch

        row: dict[str, Any] = {"micro_batch_size": config.micro_batch_size, "seq_len": config.seq_len, "status": "ok"}
        seconds: list[float] = []
        model = self.model
        model.eval()
        try:
            self.switch(config.switched(gradient_checkpointing=False))
            with torch.no_grad(), self.accelerator.autocast():
                for index, batch in enumerate(self.loader(config.switched(gradient_checkpointing=False), steps + 1)):
                    inputs = self.trainer._prepare_inputs(batch)
                    self.timer.start()
                    self.trainer.compute_loss(model, inputs)
                    elapsed = self.timer.stop()
                    if index:  # the first is warm-up
                        seconds.append(elapsed)
        except Exception as error:
            mark_failed(row, error)
        finally:
            model.train()
        if row["status"] != "ok" or not seconds:
            self.clear()
            row.setdefault("error", "no batch timed")
            row["status"] = "error" if row["status"] == "ok" else row["status"]
            return row
        row["batch_seconds"] = statistics.median(seconds)
        row["tokens_per_second"] = config.micro_batch_size * config.seq_len / row["batch_seconds"]
        return row

    def handlers(self, peak_flops: float | None) -> dict[str, Callable[[JsonDict], JsonDict]]:
        """The tasks bench.calibrate asks of every process (bench.probe_tasks.Coordinator)."""
        return {
            "probe": lambda task: self.probe(
                StepConfig.from_row(task["config"]), ProbeSettings(**task["settings"]), peak_flops
            ),
            "eval": lambda task: self.evaluate(StepConfig.from_row(task)),
            "comm": lambda task: measure_collectives(self.device, ("all_reduce", "all_gather", "reduce_scatter")),
        }


def sampled_rows(trainer: Any) -> list[JsonDict]:
    """Up to SAMPLED_ROWS rows of the Trainer's train dataset, evenly spaced, with the columns its model is given (the
    Trainer's own choice of columns), as dicts of lists."""
    dataset = trainer.train_dataset
    try:
        import datasets

        if isinstance(dataset, datasets.Dataset):
            dataset = trainer._remove_unused_columns(dataset, description="training")
    except ImportError:  # without the datasets library a dataset is the user's own torch Dataset
        pass
    size = len(dataset)
    stride = max(1, size // SAMPLED_ROWS)
    rows = []
    for index in range(0, size, stride):
        row = dict(dataset[index])
        if "input_ids" not in row:
            raise BenchtrainError(
                f"calibrate: the Trainer's train dataset has no input_ids (its row has {', '.join(sorted(row))}): "
                "tokenize it first, as the Trainer's model reads it"
            )
        rows.append({key: as_list(value) for key, value in row.items()})
    return rows


def as_list(value: Any) -> Any:
    tolist = getattr(value, "tolist", None)
    return tolist() if tolist is not None else value


def cut(sample: JsonDict, length: int) -> JsonDict:
    """The sample with every per-token column (as long as its input_ids) cut to `length`."""
    size = len(sample["input_ids"])
    return {
        key: value[:length] if isinstance(value, list) and len(value) == size else value
        for key, value in sample.items()
    }


def probe_lengths(lengths: list[int], limit: int | None) -> tuple[int, ...]:
    """The lengths to probe: the longest sample (at the Trainer's truncation `limit`), and a half and a quarter of it,
    multiples of 8 from MIN_PROBE_LENGTH (the rows' lengths the data holds)."""
    longest = max(lengths)
    if limit:
        longest = min(longest, limit)
    chosen = {longest}
    for share in (2, 4):
        value = longest // share // 8 * 8
        if value >= MIN_PROBE_LENGTH:
            chosen.add(value)
    return tuple(sorted(chosen))
