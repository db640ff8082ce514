"""Our step against what users already have, on the same device, model shape and configuration,
in one process: HF Trainer (bf16, SDPA, fused AdamW; peft for LoRA), a plain PyTorch loop (eager
and `torch.compile`d), Unsloth where it installs (LoRA), and THE step of benchtrain, eager and
compiled. One table: tokens/s, MFU (device table), peak memory, and the ratio to HF Trainer.

    python benchmarks/peers.py                                    # tiny model on CPU: a smoke run
    python benchmarks/peers.py --model llama-3.2-1b --micro-batch 8 --seq-len 2048
    python benchmarks/peers.py --model llama-3.1-8b --lora --checkpointing --micro-batch 4 --seq-len 2048

Each loop trains on the same synthetic batches (random token ids, every position a target), runs
`--warmup` steps (compilation included) and then times `--steps` optimizer steps, each closed by a
device synchronise; tokens/s is that of the median step, as bench's probes do, so that another
job's burst on a shared machine moves it less than a total would. Loops run in the order given (Liger's kernels stay on our own model: train.step.loss puts
back what Liger patches in transformers' modules).
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LOOPS = ("hf-trainer", "plain", "plain-compiled", "unsloth", "ours-compiled", "ours-eager")


@dataclass
class Setup:
    model: str
    lora: bool
    rank: int
    checkpointing: bool
    micro_batch: int
    seq_len: int
    steps: int
    warmup: int

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch * self.seq_len


@dataclass
class Result:
    loop: str
    tokens_per_second: float | None = None
    mfu: float | None = None
    peak_memory_bytes: int | None = None
    note: str = ""


def device() -> Any:
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def batches(setup: Setup, vocab: int) -> list[dict[str, Any]]:
    from benchtrain.train.workload.batching import SyntheticBatches

    data = SyntheticBatches(setup.warmup + setup.steps, setup.micro_batch, setup.seq_len, vocab)
    return [{key: value for key, value in data[i].items() if key != "target_tokens"} for i in range(len(data))]


def fresh_model(setup: Setup) -> Any:
    from benchtrain.train.workload.method import MethodConfig, set_gradient_checkpointing
    from benchtrain.train.workload.model import build_model, resolve_model

    method = MethodConfig(method="lora", lora_rank=setup.rank) if setup.lora else MethodConfig()
    model = build_model(resolve_model(setup.model), device(), method)
    if setup.checkpointing:
        set_gradient_checkpointing(model, True)
    return model


def synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(setup: Setup, run_step: Callable[[dict[str, Any]], None], data: list[dict[str, Any]]) -> list[float]:
    """Seconds of each timed step after the warm-up ones."""
    for batch in data[: setup.warmup]:
        run_step(batch)
    synchronize()
    seconds = []
    for batch in data[setup.warmup :]:
        started = time.perf_counter()
        run_step(batch)
        synchronize()
        seconds.append(time.perf_counter() - started)
    return seconds


def plain_loop(setup: Setup, compiled: bool) -> list[float]:
    import torch

    from benchtrain.train.step.hyperparameters import make_optimizer

    model = fresh_model(setup)
    optimizer = make_optimizer(model)
    forward = torch.compile(model) if compiled else model
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device().type == "cuda")

    def step(batch: dict[str, Any]) -> None:
        batch = {key: value.to(device(), non_blocking=True) for key, value in batch.items()}
        with autocast:
            loss = forward(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return timed(setup, step, batches(setup, model.config.vocab_size))


def ours(setup: Setup, compiled: bool, loss: str = "auto") -> list[float]:
    from accelerate import Accelerator  # noqa: F401  (make_accelerator imports it)

    from benchtrain.train.step.engine import StepOptions, engine_from_options
    from benchtrain.train.step.runtime import make_accelerator
    from benchtrain.train.workload.method import MethodConfig
    from benchtrain.train.workload.model import resolve_model

    method = MethodConfig(method="lora", lora_rank=setup.rank) if setup.lora else MethodConfig()
    options = StepOptions(compile="on" if compiled else "off", loss=loss)
    engine = engine_from_options(
        resolve_model(setup.model),
        method,
        make_accelerator(),
        options,
        ("gradient_checkpointing",) if setup.checkpointing else (),
    )
    data = batches(setup, engine.model.config.vocab_size)
    return timed(setup, lambda batch: engine.step.run(iter([batch]), 1), data)


def hf_trainer(setup: Setup) -> list[float]:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator

    cuda = device().type == "cuda"
    model = fresh_model(setup)
    data = batches(setup, model.config.vocab_size)
    rows = [
        {"input_ids": batch["input_ids"][r], "labels": batch["labels"][r]}
        for batch in data
        for r in range(setup.micro_batch)
    ]
    times: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            synchronize()
            self.began = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            synchronize()
            times.append(time.perf_counter() - self.began)

    with tempfile.TemporaryDirectory() as output:
        arguments = TrainingArguments(
            output_dir=output,
            per_device_train_batch_size=setup.micro_batch,
            gradient_accumulation_steps=1,
            max_steps=setup.warmup + setup.steps,
            learning_rate=3e-4,
            bf16=cuda,
            optim="adamw_torch_fused" if cuda else "adamw_torch",
            logging_steps=10_000,
            save_strategy="no",
            report_to=[],
            dataloader_num_workers=0,
            dataloader_pin_memory=cuda,
            max_grad_norm=1.0,
            disable_tqdm=True,
        )
        trainer = Trainer(
            model=model,
            args=arguments,
            train_dataset=rows,
            data_collator=default_data_collator,
            callbacks=[StepClock()],
        )
        trainer.train()
    del trainer
    torch.cuda.empty_cache() if cuda else None
    return times[setup.warmup :]


def unsloth(setup: Setup) -> list[float]:
    """Unsloth's FastLanguageModel + its LoRA, trained with the plain loop (GPU only). The preset is
    saved to a folder first: nothing can be downloaded where the benchmark runs."""
    import torch
    from unsloth import FastLanguageModel  # ImportError: not installed here

    from benchtrain.train.step.hyperparameters import make_optimizer

    if not setup.lora:
        raise RuntimeError("Unsloth is compared on LoRA runs (--lora)")
    with tempfile.TemporaryDirectory() as folder:
        base = fresh_model(Setup(**{**setup.__dict__, "lora": False, "checkpointing": False}))
        base.to(torch.bfloat16).save_pretrained(folder)
        del base
        model, _ = FastLanguageModel.from_pretrained(
            folder, max_seq_length=setup.seq_len, dtype=torch.bfloat16, load_in_4bit=False
        )
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = FastLanguageModel.get_peft_model(
        model,
        r=setup.rank,
        lora_alpha=2 * setup.rank,
        target_modules=targets,
        use_gradient_checkpointing="unsloth" if setup.checkpointing else False,
    )
    optimizer = make_optimizer(model)

    def step(batch: dict[str, Any]) -> None:
        batch = {key: value.to(device(), non_blocking=True) for key, value in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return timed(setup, step, batches(setup, model.config.vocab_size))


RUNNERS: dict[str, Callable[[Setup], list[float]]] = {
    "hf-trainer": hf_trainer,
    "plain": lambda setup: plain_loop(setup, compiled=False),
    "plain-compiled": lambda setup: plain_loop(setup, compiled=True),
    "unsloth": unsloth,
    "ours-eager": lambda setup: ours(setup, compiled=False),
    "ours-compiled": lambda setup: ours(setup, compiled=True),
    # THE step (eager) with each loss of --loss: the loss comparison (benchmarks/gpu_check.py).
    "ours-chunked-loss": lambda setup: ours(setup, compiled=False, loss="chunked"),
    "ours-plain-loss": lambda setup: ours(setup, compiled=False, loss="plain"),
    "ours-liger-loss": lambda setup: ours(setup, compiled=False, loss="liger"),
}


def flops_per_token(setup: Setup) -> float:
    from benchtrain.train.workload.model import model_shape

    model = fresh_model(Setup(**{**setup.__dict__, "checkpointing": False}))
    shape = model_shape(model)
    del model
    return shape.flops_per_token(
        setup.seq_len, lora=setup.lora, switches=("gradient_checkpointing",) if setup.checkpointing else ()
    )


def measure(loop: str, setup: Setup, flops: float, peak_flops: float | None) -> Result:
    import torch

    from benchtrain.train.step.metrics import mfu, tokens_per_second
    from benchtrain.train.step.peak_memory import PeakMemory

    gc.collect()
    torch._dynamo.reset()
    try:
        with PeakMemory(device()) as memory:
            step_seconds = RUNNERS[loop](setup)
    except ImportError as error:
        return Result(loop, note=f"not installed ({error.name})")
    except Exception as error:  # one loop failing (OOM, a missing kernel) still prints the table
        return Result(loop, note=f"{type(error).__name__}: {str(error).splitlines()[0][:100] if str(error) else ''}")
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    rate = tokens_per_second(setup.tokens_per_step, statistics.median(step_seconds))
    return Result(loop, rate, mfu(rate, flops, peak_flops), int(memory.peak_bytes))


def table(results: list[Result]) -> list[str]:
    hf = next((r.tokens_per_second for r in results if r.loop == "hf-trainer" and r.tokens_per_second), None)
    lines = [f"{'loop':<16} {'tokens/s':>10} {'MFU':>7} {'peak GiB':>9} {'× HF':>6}  note", "-" * 64]
    for r in results:
        rate = f"{r.tokens_per_second:,.0f}" if r.tokens_per_second else "-"
        use = f"{r.mfu:.1%}" if r.mfu is not None else "-"
        peak = f"{r.peak_memory_bytes / 2**30:.2f}" if r.peak_memory_bytes else "-"
        ratio = f"{r.tokens_per_second / hf:.2f}" if hf and r.tokens_per_second else "-"
        lines.append(f"{r.loop:<16} {rate:>10} {use:>7} {peak:>9} {ratio:>6}  {r.note}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="preset or model folder (default: tiny)")
    parser.add_argument("--lora", action="store_true", help="LoRA on a frozen base (peft; Unsloth's own for unsloth)")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing in every loop")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps per loop")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    parser.add_argument(
        "--loops", default=",".join(LOOPS), help=f"comma-separated, in order (default: {','.join(LOOPS)})"
    )
    args = parser.parse_args()
    loops = [name.strip() for name in args.loops.split(",") if name.strip()]
    unknown = [name for name in loops if name not in RUNNERS]
    if unknown:
        parser.error(f"unknown loops {unknown}; choose from {', '.join(RUNNERS)}")
    setup = Setup(
        args.model,
        args.lora,
        args.lora_rank,
        args.checkpointing,
        args.micro_batch,
        args.seq_len,
        args.steps,
        args.warmup,
    )

    from benchtrain.train.step.hardware import detect_hardware

    hardware = detect_hardware()
    flops = flops_per_token(setup)
    print(
        f"{hardware['name']}: {setup.model} {'LoRA r' + str(setup.rank) if setup.lora else 'full fine-tuning'}"
        f"{' + checkpointing' if setup.checkpointing else ''}, micro-batch {setup.micro_batch} × seq {setup.seq_len}, "
        f"{setup.steps} timed steps after {setup.warmup} (tokens/s of the median step); {flops / 1e9:.2f} GFLOP/token",
        flush=True,
    )
    results = []
    for loop in loops:
        print(f"… {loop}", file=sys.stderr, flush=True)
        results.append(measure(loop, setup, flops, hardware.get("peak_bf16_flops")))
    print("\n".join(table(results)))
    if not math.isfinite(flops):
        sys.exit(1)


if __name__ == "__main__":
    main()
