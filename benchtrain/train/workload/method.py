"""What is trained: the whole model or adapters on a frozen base (`METHODS`, peft's LoRA), and
gradient checkpointing; shared by bench probes and train. The design: docs/design.md#methods"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from benchtrain.calibration.adapters import TRAINS_ADAPTERS
from benchtrain.calibration.setup import Variant
from benchtrain.calibration.training import base_phrase
from benchtrain.common.errors import BenchtrainError
from benchtrain.common.json_types import JsonDict, JsonValue
from benchtrain.train.workload.optimizers import DEFAULT_OPTIMIZER, OPTIMIZERS, optimizer_named
from benchtrain.train.workload.quantize import (
    QUANTIZE_CHOICES,
    check_quantize,
    logical_numel,
    require_bitsandbytes,
)

if TYPE_CHECKING:
    import argparse

    import torch
    from transformers import PreTrainedModel

ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class Method:
    name: str  # --method's value, run.json's and the calibration's `method`
    phrase: str  # how plans and lines name it: "full fine-tuning", "LoRA"
    # Trains adapters on a frozen base (peft): --lora-* apply, --quantize may quantize the base. Read from
    # calibration.adapters' table, which calibration/ reads where a file names its method.
    adapters: bool
    # LoraConfig's arguments beyond rank, alpha, dropout, targets
    peft_options: Mapping[str, JsonValue] = field(default_factory=dict)


METHODS: dict[str, Method] = {
    "full": Method("full", "full fine-tuning", adapters=TRAINS_ADAPTERS["full"]),
    "lora": Method("lora", "LoRA", adapters=TRAINS_ADAPTERS["lora"]),
}


@dataclass(frozen=True)
class MethodConfig:
    method: str = "full"
    lora_rank: int = 16
    lora_alpha: float | None = None  # default 2 × rank
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] | None = None  # None: every linear projection of attention and MLP
    quantize: str = "none"  # none | 8bit | 4bit: the frozen base as bitsandbytes holds it (train.workload.quantize)
    optimizer: str = DEFAULT_OPTIMIZER  # a name in train.workload.optimizers.OPTIMIZERS

    def __post_init__(self) -> None:
        if self.method not in METHODS:  # the table's names
            raise BenchtrainError(f"--method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.lora_rank < 1:
            raise BenchtrainError(f"--lora-rank must be a positive integer, got {self.lora_rank}")
        if self.lora_alpha is not None and not self.lora_alpha > 0:
            raise BenchtrainError(f"--lora-alpha must be positive, got {self.lora_alpha}")
        if not 0 <= self.lora_dropout < 1:
            raise BenchtrainError(f"--lora-dropout must be in [0, 1), got {self.lora_dropout}")
        if self.lora_targets is not None and not all(self.lora_targets):
            raise BenchtrainError("--lora-targets needs module names, e.g. q_proj,v_proj")

        check_quantize(self.quantize, self.is_lora)
        if optimizer_named(self.optimizer).needs_bitsandbytes:
            require_bitsandbytes(f"--optimizer {self.optimizer}")

    @property
    def quantized(self) -> bool:
        return self.quantize != "none"

    @property
    def is_lora(self) -> bool:
        """Trains adapters on a frozen base (LoRA or a method of its family: METHODS)."""
        return METHODS[self.method].adapters

    @property
    def alpha(self) -> float:
        return self.lora_alpha if self.lora_alpha is not None else 2.0 * self.lora_rank

    def settings(self) -> JsonDict | None:
        """The adapter settings as asked (targets None: every linear projection); None for full."""
        if not self.is_lora:
            return None
        targets = list(self.lora_targets) if self.lora_targets else None
        settings = {"rank": self.lora_rank, "alpha": self.alpha, "dropout": self.lora_dropout, "targets": targets}
        return {**settings, "quantize": self.quantize} if self.quantized else settings

    @property
    def variant(self) -> Variant:
        """What a calibration may measure several of for one model and method: (quantize, optimizer)."""
        return Variant(self.quantize, self.optimizer)

    def with_variant(self, variant: Variant) -> MethodConfig:
        """This method trained with another base's quantization and optimizer."""
        return replace(self, quantize=variant.quantize, optimizer=variant.optimizer)

    def describe(self) -> str:
        optimizer = "" if self.optimizer == DEFAULT_OPTIMIZER else f", {self.optimizer}"
        if not self.is_lora:
            return f"full fine-tuning{optimizer}"

        base = f" of {base_phrase(self.quantize)}" if self.quantized else ""
        targets = ", ".join(self.lora_targets) if self.lora_targets else "every linear projection"
        return (
            f"{METHODS[self.method].phrase} rank {self.lora_rank} (alpha {self.alpha:g}) on {targets}{base}{optimizer}"
        )


def parse_targets(text: str | None) -> tuple[str, ...] | None:
    if text is None or text.strip().lower() in ("", ALL_LINEAR):
        return None
    return tuple(part.strip() for part in text.split(",") if part.strip()) or None


def method_from_args(args: argparse.Namespace) -> MethodConfig:
    """The method named on a command line (`--lora` is `--method lora`)."""
    method = "lora" if getattr(args, "lora", False) else getattr(args, "method", "full")
    quantize, optimizer = (
        single_choice(getattr(args, "quantize", None), "none"),
        single_choice(getattr(args, "optimizer", None), DEFAULT_OPTIMIZER),
    )
    return MethodConfig(
        method,
        args.lora_rank,
        args.lora_alpha,
        args.lora_dropout,
        parse_targets(args.lora_targets),
        quantize,
        optimizer,
    )


def single_choice(value: str | None, default: str) -> str:
    """One value of an option bench takes as a list and train as one value or `auto`: the first
    listed (bench measures each: measured_methods), `default` for none or `auto`."""
    first = (value or "").split(",")[0].strip()
    return default if first in ("", "auto") else first


def parse_choices(text: str | None, choices: tuple[str, ...], option: str, default: str) -> list[str]:
    """`none,4bit` → ["none", "4bit"], each one of `choices`, in the order given, once."""
    values = [part.strip() for part in (text or default).split(",") if part.strip()] or [default]
    unknown = [value for value in values if value not in choices]
    if unknown:
        raise BenchtrainError(f"{option}: {', '.join(unknown)} is not one of {', '.join(choices)}")
    return list(dict.fromkeys(values))


def measured_methods(quantize: str | None, optimizer: str | None, method: MethodConfig) -> list[MethodConfig]:
    """`method` with every variant (the base's quantization × the optimizer) bench is asked to
    measure side by side in one calibration, the first listed first."""
    quantizations = parse_choices(quantize, QUANTIZE_CHOICES, "--quantize", "none")
    optimizers = parse_choices(optimizer, tuple(OPTIMIZERS), "--optimizer", DEFAULT_OPTIMIZER)
    return [method.with_variant(Variant(q, o)) for q in quantizations for o in optimizers]


def quiet_library_warnings() -> None:
    """transformers 5 deprecates `is_gradient_checkpointing`, which peft and accelerate still read on every model;
    peft says it transposes GPT-2's Conv1D weights for LoRA, which it does rightly: warnings the user can do nothing
    about."""
    warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.*", category=FutureWarning)
    warnings.filterwarnings(
        "ignore", message=r"fan_in_fan_out is set to False but the target module is `Conv1D`.*", category=UserWarning
    )
    # bitsandbytes 0.48's CPU kernels call a torch check that torch 2.13 deprecates, on every matmul.
    warnings.filterwarnings("ignore", message=r".*_check_is_size will be removed.*", category=FutureWarning)
    # LLM.int8 computes its matmuls in fp16, as its paper does: said on every call on CPU.
    warnings.filterwarnings("ignore", message=r"MatMul8bitLt: inputs will be cast from .* during quantization")
    # bitsandbytes >= 0.50 logs, when imported on an AVX512-BF16 CPU, that an optional kernel package
    # for its 4-bit inference path is missing: a path benchtrain turns off (quantize.keep_one_weight_layout).
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def apply_method(model: torch.nn.Module, method: MethodConfig) -> torch.nn.Module:
    """The model to train: itself (full), or wrapped with adapters (the method's LoraConfig) and its base frozen."""
    if not method.is_lora:
        return model
    quiet_library_warnings()  # peft reads a deprecated transformers attribute on every model
    from peft import LoraConfig, get_peft_model

    targets = list(method.lora_targets) if method.lora_targets else ALL_LINEAR
    config = LoraConfig(
        # peft annotates lora_alpha int; a float alpha scales as written.
        r=method.lora_rank,
        lora_alpha=method.alpha,  # type: ignore[arg-type]
        lora_dropout=method.lora_dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
        **METHODS[method.method].peft_options,
    )
    try:
        return get_peft_model(model, config)
    except ValueError as error:
        raise BenchtrainError(f"--lora-targets: {str(error).splitlines()[0]}") from None


def set_gradient_checkpointing(model: torch.nn.Module, enabled: bool) -> None:
    """Recompute activations in the backward pass (less memory, about one more forward pass), non-reentrant.
    The input-gradients hook transformers adds is removed either way: docs/design.md#methods"""
    base = unwrap(model)
    if enabled:
        base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        base.activation_checkpointing_disable()
    base.disable_input_require_grads()
    if enabled:
        base.config.use_cache = False


def unwrap(model: torch.nn.Module) -> PreTrainedModel:
    """The transformers model inside DDP and peft wrappers."""
    inner: Any = getattr(model, "module", model)
    get_base = getattr(inner, "get_base_model", None)
    return get_base() if get_base is not None else inner


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated decoder blocks (transformers names their class in `_no_split_modules`): the
    unit that is compiled (train/step/compile.py) and sharded (train/step/sharding.py)."""
    lm = unwrap(model)
    block_names = set(getattr(lm, "_no_split_modules", None) or ())
    return [module for module in lm.modules() if type(module).__name__ in block_names]


def trainable_parameter_count(model: torch.nn.Module) -> int:
    return sum(parameter.numel() for parameter in model.parameters() if parameter.requires_grad)


def method_record(method: MethodConfig, model: torch.nn.Module) -> JsonDict:
    """What was trained, for the calibration and run.json: method, adapter settings, counts (a 4-bit weight counted as the weights it stands for)."""
    total = sum(logical_numel(parameter) for parameter in model.parameters())
    record: JsonDict = {
        "method": method.method,
        "trainable_parameters": trainable_parameter_count(model),
        "total_parameters": total,
        "lora": None,
    }
    record |= {"quantization": method.quantize if method.quantized else None, "optimizer": method.optimizer}
    if method.is_lora:
        # The modules that carry adapters, after peft resolved "all-linear".
        targets = sorted(
            {
                name.rsplit(".", 1)[-1]
                for name, module in getattr(model, "module", model).named_modules()
                if hasattr(module, "lora_A")
            }
        )
        record["lora"] = {
            **(method.settings() or {}),
            "targets": targets,
            "trainable_parameters": record["trainable_parameters"],
        }
    return record
