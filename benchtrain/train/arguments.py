"""The argument groups that `bench run` and `train` share: the data's format and columns, the
method (full or LoRA) and the step (compile, loss, sharding). They stand beside the commands,
which build their parsers from them; the components only name their choices."""

from __future__ import annotations

import argparse

from benchtrain.train.recipes.config import option_default
from benchtrain.train.step.compile import COMPILE_CHOICES
from benchtrain.train.step.loss import LOSS_CHOICES
from benchtrain.train.step.sharding import SHARDING_CHOICES
from benchtrain.train.workload.formats import FORMATS, format_help
from benchtrain.train.workload.method import METHODS
from benchtrain.train.workload.optimizers import DEFAULT_OPTIMIZER, OPTIMIZERS, optimizer_help
from benchtrain.train.workload.quantize import QUANTIZE_CHOICES


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that name a dataset's format and columns (train and bench --data)."""
    parser.add_argument("--data-format", default="auto", choices=("auto", *FORMATS), help=format_help())
    parser.add_argument(
        "--data-split",
        default=option_default("data_split"),
        metavar="SPLIT",
        help="split of a hub dataset or a saved DatasetDict (default: %(default)s)",
    )
    parser.add_argument("--text-field", metavar="COLUMN", help="the text column (text format)")
    parser.add_argument(
        "--messages-field", metavar="COLUMN", help="the column of conversation turns (messages, sharegpt)"
    )
    parser.add_argument(
        "--prompt-field", metavar="COLUMN", help="the prompt column (prompt_completion; Alpaca's instruction)"
    )
    parser.add_argument(
        "--completion-field", metavar="COLUMN", help="the answer column (prompt_completion; Alpaca's output)"
    )
    parser.add_argument("--input-field", metavar="COLUMN", help="Alpaca's optional input column")
    parser.add_argument("--system-field", metavar="COLUMN", help="a system prompt column (sharegpt, alpaca)")
    parser.add_argument(
        "--token-dtype",
        choices=("uint16", "uint32", "int32", "int64"),
        help="pre-tokenized .bin files: the ids' type (nanoGPT writes uint16); or a benchtrain.json beside them",
    )
    parser.add_argument(
        "--document-separator",
        type=int,
        metavar="ID",
        help="pre-tokenized .bin/.npy files: the token id that ends each document (e.g. 50256, GPT-2's <|endoftext|>)",
    )


def add_method_arguments(parser: argparse.ArgumentParser, measured: bool = False) -> None:
    """What is trained (MethodConfig): the method, LoRA's settings, the base's quantization and the optimizer. `measured`
    (bench): --quantize and --optimizer take lists, each measured into the one calibration; train takes one or `auto`."""
    phrases = ", ".join(f"{name} ({entry.phrase})" for name, entry in METHODS.items())
    method = option_default("method")
    parser.add_argument(
        "--method", choices=METHODS, default=method, help=f"what is trained: {phrases}; default {method}"
    )
    parser.add_argument(
        "--lora", action="store_true", help="same as --method lora: train LoRA adapters on a frozen base (peft)"
    )
    parser.add_argument(
        "--lora-rank",
        type=int,
        default=option_default("lora_rank"),
        metavar="R",
        help="LoRA rank (default: %(default)s)",
    )
    parser.add_argument("--lora-alpha", type=float, metavar="A", help="LoRA alpha (default: 2 × rank)")
    dropout = option_default("lora_dropout")
    parser.add_argument(
        "--lora-dropout", type=float, default=dropout, metavar="P", help=f"LoRA dropout (default: {dropout:g})"
    )
    parser.add_argument(
        "--lora-targets",
        metavar="NAMES",
        help="comma-separated module names, e.g. q_proj,v_proj (default: every linear projection of attention and MLP)",
    )
    quantize = (
        "with --lora, the frozen base quantized by bitsandbytes: 4bit (QLoRA: NF4, double quantization, "
        "bf16 compute on CUDA, fp32 on a CPU) or 8bit (LLM.int8)"
    )
    optimizer = optimizer_help()  # each of OPTIMIZERS with its phrase
    if measured:
        parser.add_argument(
            "--quantize",
            default="none",
            metavar="LIST",
            help=f"{quantize}; a list (none,4bit) measures each into one calibration (default: none)",
        )
        parser.add_argument(
            "--optimizer",
            default=DEFAULT_OPTIMIZER,
            metavar="LIST",
            help=f"{optimizer}; a list measures each (default: {DEFAULT_OPTIMIZER})",
        )
        return
    auto = "auto (default): what the calibration measured, the fastest that fits where it measured several"
    parser.add_argument("--quantize", choices=("auto", *QUANTIZE_CHOICES), default="auto", help=f"{quantize}; {auto}")
    parser.add_argument("--optimizer", choices=("auto", *OPTIMIZERS), default="auto", help=f"{optimizer}; {auto}")


def add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """How THE step runs (StepOptions): compiled or eager, which loss, how processes share the model."""
    parser.add_argument(
        "--compile",
        choices=COMPILE_CHOICES,
        default=option_default("compile"),
        help="torch.compile the decoder blocks: auto (default) = on for CUDA, off on CPU; compile time is measured and planned",
    )
    parser.add_argument(
        "--loss",
        choices=LOSS_CHOICES,
        default=option_default("loss"),
        help="loss without full-vocabulary logits: auto (default) = liger on CUDA when installed, else chunked; plain = transformers' own",
    )
    parser.add_argument(
        "--sharding",
        choices=SHARDING_CHOICES,
        default=option_default("sharding"),
        help="under several processes (accelerate launch): ddp (default) = a whole model per process; "
        "fsdp = parameters, gradients and optimizer state sharded (a model too big for one device: full fine-tuning, "
        "or LoRA with its frozen base sharded, a 4-bit base too)",
    )
