"""Which model to train (a preset of `PRESETS`, a local directory with `config.json`, or a hub id), its build
on a device, and its shape for FLOPs per token. The design: docs/design.md#models-and-their-flops"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchtrain.calibration.dimensions import DIMENSIONS, scaled
from benchtrain.calibration.step_config import Mode
from benchtrain.common.atomic import read_json_file
from benchtrain.common.errors import BenchtrainError
from benchtrain.common.json_types import JsonDict
from benchtrain.train.workload.hub import (
    HubModel,
    fetch_weights,
    has_weight_files,
    parse_hub_id,
    resolve_hub_model,
    weights_to_fetch,
)
from benchtrain.train.workload.meta_init import meta_plain_model
from benchtrain.train.workload.method import MethodConfig, apply_method, unwrap
from benchtrain.train.workload.quantize import logical_numel, quantized_base

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig


# -- presets: published architecture shapes with random initialisation, no weights needed ----------------------
def decoder(
    model_type: str,
    vocab: int,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    positions: int,
    **extra: Any,
) -> JsonDict:
    """A decoder's config.json values, in the order transformers' Llama-style configs name them."""
    shape = {
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
    }
    return {
        **shape,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": positions,
        **extra,
    }


LLAMA_3_1_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# decoder(model type, vocabulary, hidden, intermediate, layers, attention heads, key/value heads, positions, other keys)
PRESETS: dict[str, JsonDict] = {
    # ~0.9M parameters: fast on a laptop CPU, the default everywhere.
    "tiny": decoder("llama", 320, 128, 344, 4, 4, 4, 4096, tie_word_embeddings=False),
    "gpt2": {
        "model_type": "gpt2",
        "vocab_size": 50257,
        "n_embd": 768,
        "n_layer": 12,
        "n_head": 12,
        "n_positions": 1024,
    },
    "llama-3.2-1b": decoder(
        "llama", 128256, 2048, 8192, 16, 32, 8, 131072, rope_theta=500000.0, tie_word_embeddings=True
    ),
    "llama-3.1-8b": decoder(
        "llama",
        128256,
        4096,
        14336,
        32,
        32,
        8,
        131072,
        rope_theta=500000.0,
        rope_scaling=LLAMA_3_1_ROPE,
        tie_word_embeddings=False,
    ),
    # Llama-3.1-70B's published config: 80 layers of the 8B's design, 8192 wide; 141 GB of bf16.
    "llama-3.1-70b": decoder(
        "llama",
        128256,
        8192,
        28672,
        80,
        64,
        8,
        131072,
        rope_theta=500000.0,
        rope_scaling=LLAMA_3_1_ROPE,
        tie_word_embeddings=False,
    ),
    "qwen2.5-7b": decoder(
        "qwen2", 152064, 3584, 18944, 28, 28, 4, 32768, rope_theta=1000000.0, tie_word_embeddings=False
    ),
    "mistral-7b": decoder(
        "mistral",
        32768,
        4096,
        14336,
        32,
        32,
        8,
        32768,
        rope_theta=1000000.0,
        sliding_window=None,
        tie_word_embeddings=False,
    ),
    # Mistral-Nemo-12B: head_dim 128 is not hidden / heads (160), so it is given explicitly.
    "mistral-nemo-12b": decoder(
        "mistral",
        131072,
        5120,
        14336,
        40,
        32,
        8,
        128000,
        head_dim=128,
        rope_theta=1000000.0,
        sliding_window=None,
        tie_word_embeddings=False,
    ),
}

PRESET_ALIASES = {
    "gpt2-124m": "gpt2",
    "llama3.2-1b": "llama-3.2-1b",
    "llama-1b": "llama-3.2-1b",
    "llama3-8b": "llama-3.1-8b",
    "llama-3-8b": "llama-3.1-8b",
    "llama3.1-8b": "llama-3.1-8b",
    "llama-3.1-8b-instruct": "llama-3.1-8b",
    "llama3.1-70b": "llama-3.1-70b",
    "llama-3.1-70b-instruct": "llama-3.1-70b",
    "mistral-nemo": "mistral-nemo-12b",
    "mistral-nemo-12b-instruct": "mistral-nemo-12b",
    "qwen2.5-7b-instruct": "qwen2.5-7b",
    "mistral": "mistral-7b",
}


def canonical_preset(name: str) -> str | None:
    key = name.lower()
    key = PRESET_ALIASES.get(key, key)
    return key if key in PRESETS else None


# Keys that do not change the computation and must not change the fingerprint.
FINGERPRINT_IGNORED = {
    "_name_or_path",
    "transformers_version",
    "architectures",
    "torch_dtype",
    "dtype",
    "name_or_path",
    "id2label",
    "label2id",
}
# Values that cost nothing to change (token ids, a norm's epsilon, the random init's scale, `use_cache`, which a
# Trainer turns off and a training step never uses): taken at the architecture's default before fingerprinting,
# so a hub config.json and the preset of its shape share calibrations.
FINGERPRINT_DEFAULTED = {"bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "use_cache"}
FINGERPRINT_DEFAULTED |= {"rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon"}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    config_dict: JsonDict
    directory: Path | None = None
    hub: HubModel | None = None  # a hub id's commit; `directory` is then its cache folder
    # False: build from the config with random weights even where the folder has weights (a hub
    # model for bench; for train until `with_hub_weights` has them).
    load_weights: bool = True

    @property
    def has_weights(self) -> bool:
        return self.load_weights and self.directory is not None and has_weight_files(self.directory)

    @property
    def reference(self) -> str:
        """What `resolve_model` turns back into this spec (in another process, say)."""
        if self.hub is not None:
            return self.hub.reference
        return str(self.directory) if self.directory is not None else self.name

    @property
    def max_positions(self) -> int:
        """The longest sequence the architecture accepts (its position table)."""
        config = self.config_dict
        return int(config.get("max_position_embeddings") or config.get("n_positions") or 1 << 30)

    @property
    def fingerprint(self) -> str:
        """Hash of the full architecture config (defaults filled in by transformers), so a preset,
        a saved folder and a hub model of the same architecture share calibrations."""
        shape_only = {key: value for key, value in self.config_dict.items() if key not in FINGERPRINT_DEFAULTED}
        full = make_config(replace(self, config_dict=shape_only)).to_dict()
        relevant = {key: value for key, value in full.items() if key not in FINGERPRINT_IGNORED}
        canonical = json.dumps(relevant, sort_keys=True, default=str)
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def resolve_model(reference: str | None) -> ModelSpec:
    """A preset, a folder, or a hub id (config and tokenizer only: see `with_hub_weights`)."""
    reference = reference or "tiny"
    preset = canonical_preset(reference)
    if preset is not None:
        return ModelSpec(preset, dict(PRESETS[preset]))
    folder = Path(reference).expanduser()
    if folder.is_dir():
        config_path = folder / "config.json"
        if not config_path.is_file():
            raise BenchtrainError(
                f"model directory {folder} has no config.json; point --model at a Hugging Face model folder"
            )
        return ModelSpec(folder.name, read_config(config_path), folder)
    hub_id = parse_hub_id(reference)
    if hub_id is not None:
        hub = resolve_hub_model(*hub_id)
        return ModelSpec(hub.repo_id, read_config(hub.snapshot / "config.json"), hub.snapshot, hub, load_weights=False)
    raise BenchtrainError(
        f"unknown model {reference!r}: use a preset ({', '.join(PRESETS)}), a folder with config.json, or a hub id ORG/NAME[@REVISION]"
    )


def read_config(config_path: Path) -> JsonDict:
    config_dict = read_json_file(config_path)
    if not isinstance(config_dict, dict) or "model_type" not in config_dict:
        raise BenchtrainError(f"{config_path} has no model_type; is it a transformers config?")
    return config_dict


def with_hub_weights(spec: ModelSpec, announce: Callable[[str], None] | None = None, fetch: bool = True) -> ModelSpec:
    """A hub model's spec that loads its weights: says (through `announce`) how many GB will be fetched
    into which cache, then fetches them (unless `fetch` is False: a dry run). Other specs as they are."""
    if spec.hub is None or spec.load_weights:
        return spec
    missing = weights_to_fetch(spec.hub)
    if not missing.files:
        return replace(spec, load_weights=True)
    if announce is not None:
        verb = "fetching" if fetch else "a run will fetch"
        announce(
            f"{verb} {missing.total_bytes / 1e9:.1f} GB of {spec.name} weights ({len(missing.files)} files) into {missing.cache_dir}"
        )
    if not fetch:
        return spec
    fetch_weights(spec.hub, missing)
    return replace(spec, load_weights=True)


def make_config(spec: ModelSpec) -> PretrainedConfig:
    from transformers import AutoConfig

    values = dict(spec.config_dict)
    model_type = values.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **values)
    except (ValueError, KeyError) as error:
        raise BenchtrainError(
            f"model {spec.name}: transformers cannot build model_type {model_type!r} ({error})"
        ) from None


def build_model(
    spec: ModelSpec,
    device: torch.device | str,
    method: MethodConfig | None = None,
    shardable: bool = False,
    weights_on: torch.device | str | None = None,
) -> torch.nn.Module:
    """The causal LM on `device`, with SDPA attention, ready to train with `method`; weights only from a directory
    that has them. Full fine-tuning keeps fp32 weights; LoRA a bf16 base on CUDA. `shardable`: a 4-bit base stored in
    the compute dtype, for FSDP to shard. `weights_on`: the device the weights will be given (FSDP builds on `meta`
    for it), whose type chooses the dtype (None: `device`)."""
    import torch
    from transformers import AutoModelForCausalLM

    method = method or MethodConfig()
    device = torch.device(device)
    dtype = torch.bfloat16 if method.is_lora and torch.device(weights_on or device).type == "cuda" else torch.float32
    if device.type == "meta":
        # A skeleton that allocates nothing: FSDP shards it, then each rank materialises its
        # shards and fills them with the weights below (train.step.sharding.materialise_shards).
        return apply_method(meta_plain_model(make_config(spec), dtype), method)
    if method.quantized:
        source = spec.directory if spec.has_weights else make_config(spec)
        return apply_method(quantized_base(source, device, method.quantize, dtype, float_storage=shardable), method)
    if spec.has_weights:
        # Any: transformers types its `to` as the unbound torch Module.to (functools.wraps).
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            str(spec.directory), attn_implementation="sdpa", local_files_only=True, dtype=dtype
        )
        model = loaded.to(device)
    else:
        config = make_config(spec)
        torch.manual_seed(0)  # identical initial weights for every build of a preset
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    return apply_method(model, method)


@dataclass(frozen=True)
class ModelShape:
    """What the FLOPs formula needs: matmul parameters (base and adapters), layers, heads, head size."""

    parameter_count: int
    matmul_parameter_count: int  # the base model's, adapters excluded
    layers: int
    heads: int
    head_dim: int
    adapter_parameter_count: int = 0

    def flops_terms(self, lora: bool) -> dict[str, float]:
        """FLOPs per token of each compute term of the throughput model (calibration.fit): per token, per token ×
        length (attention), and what checkpointing recomputes of each. The derivation:
        docs/design.md#models-and-their-flops"""
        adapters = self.adapter_parameter_count if lora else 0
        base = self.matmul_parameter_count
        attention = 4 * self.layers * self.heads * self.head_dim  # per token per unit of length, one forward
        return {
            "per_token": float(4 * base + 6 * adapters if lora else 6 * base),
            "attention": float(3 * attention),
            "recompute_per_token": float(2 * base + 2 * adapters),
            "recompute_attention": float(attention),
        }

    def forward_flops_per_token(self, seq_len: int, lora: bool = False) -> float:
        """One forward pass (evaluation): what checkpointing recomputes."""
        terms = self.flops_terms(lora)
        return terms["recompute_per_token"] + terms["recompute_attention"] * seq_len

    def flops_per_token(self, seq_len: int, lora: bool = False, switches: Mode = ()) -> float:
        """FLOPs the device executes per trained token, with the switch dimensions `switches` on: each adds the
        FLOPs of its device terms (calibration.dimensions: gradient checkpointing's recompute) that `flops_terms` counts."""
        terms = self.flops_terms(lora)
        flops = terms["per_token"] + terms["attention"] * seq_len
        added = (
            terms[term.name] * scaled(term.scale, 1.0, seq_len)
            for name in switches
            for term in DIMENSIONS[name].throughput
            if term.device and term.name in terms
        )
        return flops + sum(added)


def model_shape(model: torch.nn.Module) -> ModelShape:
    lm: Any = unwrap(model)  # peft's adapters sit inside the base model's layers
    adapters = sum(parameter.numel() for name, parameter in lm.named_parameters() if "lora_" in name)
    config = lm.config
    total = sum(logical_numel(parameter) for parameter in lm.parameters())
    # A token embedding is a lookup, not a matmul; it counts once when tied to the output head.
    lookup = 0
    embeddings = lm.get_input_embeddings()
    tied = lm.get_output_embeddings() is not None and lm.get_output_embeddings().weight is embeddings.weight
    if not tied:
        lookup += embeddings.weight.numel()
    position = getattr(getattr(lm, "transformer", None), "wpe", None)
    if position is not None:
        lookup += position.weight.numel()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return ModelShape(total - adapters, total - lookup - adapters, config.num_hidden_layers, heads, head_dim, adapters)


def model_record(spec: ModelSpec, shape: ModelShape) -> JsonDict:
    """The `model` section of a calibration or run."""
    source = "hub" if spec.hub else str(spec.directory) if spec.directory else "preset"
    record = {
        **model_identity(spec),
        "source": source,
        "architecture": spec.config_dict.get("model_type"),
        "parameter_count": shape.parameter_count,
    }
    shaped = {
        "matmul_parameter_count": shape.matmul_parameter_count,
        "layers": shape.layers,
        "heads": shape.heads,
        "head_dim": shape.head_dim,
    }
    return {**record, **shaped, "vocab_size": spec.config_dict.get("vocab_size")}


def weights_identity(spec: ModelSpec) -> str | None:
    """Which base weights `spec` loads, cheaply: a hub model's commit; a folder's weight files by name, size and first
    MiB (the index of a sharded one whole); None where the weights are built from the config. The fingerprint covers the
    architecture only: LoRA adapters trained on one base continue on that base alone."""
    if spec.hub is not None:
        return f"{spec.hub.repo_id}@{spec.hub.revision}"
    if not spec.has_weights or spec.directory is None:
        return None
    digest = hashlib.sha256()
    for path in sorted(spec.directory.glob("*")):
        if path.is_file() and (path.suffix in (".safetensors", ".bin") or path.name.endswith(".index.json")):
            digest.update(f"{path.name}:{path.stat().st_size}".encode())
            with open(path, "rb") as handle:
                digest.update(handle.read(1 << 20))
    return f"sha256:{digest.hexdigest()[:16]}"


def model_identity(spec: ModelSpec) -> JsonDict:
    """Name, fingerprint and, for a hub model, its id and the commit it resolved to."""
    return {"name": spec.name, "fingerprint": spec.fingerprint, **(spec.hub.record() if spec.hub else {})}
