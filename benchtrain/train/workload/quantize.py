"""A quantized, frozen base for LoRA (QLoRA's 4-bit NF4, LLM.int8's 8-bit), and its bytes computed
without building it. The arithmetic and why: docs/design.md#quantized-bases"""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packaging.version import Version

from benchtrain.common.errors import BenchtrainError
from benchtrain.train.workload.meta_init import meta_plain_model, seeded_tensors

if TYPE_CHECKING:
    import torch
    from transformers import BitsAndBytesConfig, PretrainedConfig

QUANTIZE_CHOICES = ("none", "8bit", "4bit")
BITSANDBYTES_MIN_VERSION = "0.48"
INSTALL_HINT = f"pip install 'bitsandbytes>={BITSANDBYTES_MIN_VERSION}'"
BLOCKSIZE_4BIT = 64  # weights per absmax (bitsandbytes' default for 4-bit)
NESTED_BLOCKSIZE = 256  # absmax values per second-level absmax (double quantization)
NF4_CODE_VALUES = 16
NESTED_CODE_VALUES = 256
FLOAT32_BYTES = 4


@dataclass(frozen=True)
class QuantizedBytes:
    """The bytes a quantized base holds, by kind."""

    quantized: int  # the converted layers' packed (4-bit) or int8 weights
    statistics: int  # their absmax, codes and offsets (4-bit) or row scales (8-bit)
    unquantized: int  # everything else, biases included, at the model's dtype
    layers: int  # layers converted

    @property
    def total(self) -> int:
        return self.quantized + self.statistics + self.unquantized


def logical_numel(parameter: torch.Tensor) -> int:
    """The weights a parameter stands for: a 4-bit bitsandbytes weight stores two a byte (its
    `quant_state` keeps the shape it came from); every other parameter, its own count."""
    state = getattr(parameter, "quant_state", None)
    shape = getattr(state, "shape", None)
    return int(math.prod(shape)) if shape is not None else parameter.numel()


def check_quantize(kind: str, is_lora: bool) -> None:
    """--quantize is a choice of the frozen base of a LoRA run; bitsandbytes must be there."""
    if kind not in QUANTIZE_CHOICES:
        raise BenchtrainError(f"--quantize must be one of {', '.join(QUANTIZE_CHOICES)}, got {kind!r}")
    if kind == "none":
        return
    if not is_lora:
        raise BenchtrainError(
            f"--quantize {kind} quantizes a frozen base: it needs --lora (full fine-tuning trains every weight, which stay in bf16/fp32)"
        )
    require_bitsandbytes()


def require_bitsandbytes(what: str = "--quantize") -> None:
    try:
        installed = metadata.version("bitsandbytes")
    except metadata.PackageNotFoundError:
        raise BenchtrainError(f"{what} needs bitsandbytes, which is not installed: {INSTALL_HINT}") from None
    if Version(installed) < Version(BITSANDBYTES_MIN_VERSION):
        raise BenchtrainError(
            f"{what} needs bitsandbytes >= {BITSANDBYTES_MIN_VERSION} (installed: {installed}): {INSTALL_HINT}"
        )


def bitsandbytes_config(kind: str, compute_dtype: torch.dtype, float_storage: bool = False) -> BitsAndBytesConfig:
    """transformers' BitsAndBytesConfig for `kind` (4bit: NF4, double quantization, `compute_dtype`).
    `float_storage`: the packed 4-bit values stored in `compute_dtype` tensors, for FSDP to shard."""
    from transformers import BitsAndBytesConfig

    if kind == "4bit":
        storage = {"bnb_4bit_quant_storage": compute_dtype} if float_storage else {}
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute_dtype,
            **storage,
        )
    if kind == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    raise ValueError(f"no bitsandbytes config for {kind!r}")


def converted_layers(model: torch.nn.Module) -> list[tuple[str, int, int, bool]]:
    """(name, in features, out features, has bias) of every layer transformers quantizes."""
    from torch import nn
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.base import get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module

    skipped = list({*get_keys_to_not_convert(model), *(getattr(model, "_keep_in_fp32_modules", None) or [])})
    layers = []
    for name, module in model.named_modules():
        if not should_convert_module(name, skipped):
            continue
        if isinstance(module, Conv1D):
            inputs, outputs = module.weight.shape
        elif type(module) is nn.Linear:
            inputs, outputs = module.in_features, module.out_features
        else:
            continue
        layers.append((name, int(inputs), int(outputs), module.bias is not None))
    return layers


def quantized_bytes(model: torch.nn.Module, kind: str, dtype_bytes: int) -> QuantizedBytes:
    """The bytes of `model` (a plain causal LM, e.g. built on `meta`) with its base quantized as `kind`, its other tensors at `dtype_bytes` each."""
    layers = converted_layers(model) if kind != "none" else []
    whole = sum(parameter.numel() for parameter in model.parameters()) + sum(
        buffer.numel() for buffer in model.buffers()
    )
    converted_weights = sum(inputs * outputs for _, inputs, outputs, _ in layers)
    quantized = statistics = 0
    for _, inputs, outputs, _ in layers:
        weights = inputs * outputs
        if kind == "4bit":
            blocks = math.ceil(weights / BLOCKSIZE_4BIT)
            quantized += math.ceil(weights / 2)
            # absmax, code, offset
            nested = (
                math.ceil(blocks / NESTED_BLOCKSIZE) * FLOAT32_BYTES
                + NESTED_CODE_VALUES * FLOAT32_BYTES
                + FLOAT32_BYTES
            )
            statistics += blocks + nested + NF4_CODE_VALUES * FLOAT32_BYTES
        else:
            quantized += weights
            statistics += outputs * FLOAT32_BYTES
    return QuantizedBytes(quantized, statistics, (whole - converted_weights) * dtype_bytes, len(layers))


def quantized_base(
    source: Any, device: torch.device, kind: str, dtype: torch.dtype, float_storage: bool = False
) -> torch.nn.Module:
    """The frozen base quantized by bitsandbytes on `device`, prepared for k-bit training as peft does it.
    `source`: a folder of weights (quantized while loaded), or a preset's config (`quantized_from_config`)."""
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    require_bitsandbytes()
    # transformers' own bars ("Loading weights") would interleave with bench's.
    bars = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        if isinstance(source, (str, Path)):
            options = {"attn_implementation": "sdpa", "dtype": dtype, "device_map": {"": device}}
            quantization = bitsandbytes_config(kind, dtype, float_storage)
            model = AutoModelForCausalLM.from_pretrained(
                str(source), local_files_only=True, quantization_config=quantization, **options
            )
        else:
            model = quantized_from_config(source, device, kind, dtype, float_storage)
    finally:
        if bars:
            transformers_logging.enable_progress_bar()
    return prepare_model_for_kbit_training(keep_one_weight_layout(model), use_gradient_checkpointing=False)


def quantized_from_config(
    config: PretrainedConfig, device: torch.device, kind: str, dtype: torch.dtype, float_storage: bool = False
) -> Any:
    """A preset's quantized base without its full-precision model ever existing: built on `meta`, then
    each seeded initial weight quantized as it comes (docs/design.md#quantized-bases)."""
    import torch
    from transformers.quantizers.auto import AutoHfQuantizer

    device = torch.device(device)
    quantizer = AutoHfQuantizer.from_config(bitsandbytes_config(kind, dtype, float_storage), pre_quantized=False)
    model = meta_plain_model(config, dtype)
    quantizer.preprocess_model(
        model=model, dtype=dtype, device_map={"": device}, checkpoint_files=None, use_kernels=False
    )
    for name, value in seeded_tensors(meta_plain_model(config, dtype), "cpu"):
        put_quantized(model, name, value, device)
        del value  # one full-precision tensor at a time: not this one while the next is drawn
    model.tie_weights()  # a tied head takes the embedding it was tied to on `meta`
    left = [name for name, tensor in (*model.named_parameters(), *model.named_buffers()) if tensor.is_meta]
    if left:
        raise RuntimeError(f"quantized base: {', '.join(left[:3])} not initialised")
    model.hf_quantizer = quantizer
    quantizer.postprocess_model(model)
    return model.eval()  # as from_pretrained leaves it


def put_quantized(model: Any, name: str, value: Any, device: torch.device) -> None:
    """One tensor of the model, quantized if its layer is bitsandbytes': what transformers'
    Bnb4bitQuantize / Bnb8bitQuantize do to a loaded weight (Conv1D's transposed first)."""
    import bitsandbytes as bnb
    import torch
    from transformers.pytorch_utils import Conv1D

    module_name, _, attribute = name.rpartition(".")
    module = model.get_submodule(module_name)
    if attribute in module._buffers:
        module._buffers[attribute] = value.to(device)
        return
    old = module._parameters[attribute]
    quantized = isinstance(module, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)) and attribute == "weight"
    if quantized and issubclass(module.source_cls, Conv1D):
        value = value.T
    new: Any
    if quantized and isinstance(module, bnb.nn.Linear4bit):
        new = bnb.nn.Params4bit(value, requires_grad=False, **old.__dict__)
        new = new.to(device)  # bitsandbytes quantizes as it moves the weight
    elif quantized:
        settings = {key: item for key, item in old.__dict__.items() if key != "SCB"}
        new = bnb.nn.Int8Params(value.to("cpu"), requires_grad=False, **settings)
        new = new.to(device)
    else:
        new = torch.nn.Parameter(value.to(device), requires_grad=old.requires_grad)
    module._parameters[attribute] = new


def keep_one_weight_layout(model: torch.nn.Module) -> torch.nn.Module:
    """Turn off bitsandbytes' (>= 0.49) in-place CPU repacking of 4-bit weights in eval mode: one layout,
    everywhere, is what `quantized_bytes` counts and what trains (why: docs/design.md#quantized-bases)."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            setattr(module, "support_avx512bf16_for_cpu", False)  # noqa: B010  # bitsandbytes' attribute, unknown to torch's types
    return model
