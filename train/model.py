"""Which model to train: a preset name or a local directory with `config.json`.

`resolve_model` checks the reference without importing torch weights; `build_model` makes the
module on the target device (weights loaded when the directory has them).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from calibration.errors import BenchtrainError
from train.presets import PRESETS, canonical_preset, preset_names

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
# Keys that do not change the computation and must not change the fingerprint.
FINGERPRINT_IGNORED = {"_name_or_path", "transformers_version", "architectures", "torch_dtype", "dtype", "name_or_path", "id2label", "label2id"}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    config_dict: dict[str, Any]
    directory: Path | None = None

    @property
    def has_weights(self) -> bool:
        return self.directory is not None and any((self.directory / f).is_file() for f in WEIGHT_FILES)

    @property
    def max_positions(self) -> int:
        """The longest sequence the architecture accepts (its position table)."""
        config = self.config_dict
        return int(config.get("max_position_embeddings") or config.get("n_positions") or 1 << 30)

    @property
    def fingerprint(self) -> str:
        """Hash of the full architecture config (defaults filled in by transformers), so a preset
        and a saved folder of the same architecture share calibrations."""
        full = make_config(self).to_dict()
        relevant = {key: value for key, value in full.items() if key not in FINGERPRINT_IGNORED}
        canonical = json.dumps(relevant, sort_keys=True, default=str)
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def resolve_model(reference: str | None) -> ModelSpec:
    reference = reference or "tiny"
    preset = canonical_preset(reference)
    if preset is not None:
        return ModelSpec(preset, dict(PRESETS[preset]))
    folder = Path(reference).expanduser()
    if folder.is_dir():
        config_path = folder / "config.json"
        if not config_path.is_file():
            raise BenchtrainError(f"model directory {folder} has no config.json; point --model at a Hugging Face model folder")
        try:
            config_dict = json.loads(config_path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise BenchtrainError(f"cannot read {config_path}: {error}") from None
        if not isinstance(config_dict, dict) or "model_type" not in config_dict:
            raise BenchtrainError(f"{config_path} has no model_type; is it a transformers config?")
        return ModelSpec(folder.name, config_dict, folder)
    raise BenchtrainError(f"unknown model {reference!r}: use a preset ({', '.join(preset_names())}) or a folder with config.json")


def make_config(spec: ModelSpec) -> Any:
    from transformers import AutoConfig

    values = dict(spec.config_dict)
    model_type = values.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **values)
    except (ValueError, KeyError) as error:
        raise BenchtrainError(f"model {spec.name}: transformers cannot build model_type {model_type!r} ({error})") from None


def build_model(spec: ModelSpec, device: Any) -> Any:
    """The causal LM on `device`, with SDPA attention; weights only from a directory that has them."""
    import torch
    from transformers import AutoModelForCausalLM

    if spec.has_weights:
        model = AutoModelForCausalLM.from_pretrained(str(spec.directory), attn_implementation="sdpa", local_files_only=True)
        return model.to(device)
    config = make_config(spec)
    torch.manual_seed(0)  # identical initial weights for every build of a preset
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model


@dataclass(frozen=True)
class ModelShape:
    """What the FLOPs formula needs: matmul parameters, layers, heads, head size."""

    parameter_count: int
    matmul_parameter_count: int
    layers: int
    heads: int
    head_dim: int

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, 6N + 12·L·H·Q·T (PaLM appendix B, as in nanoGPT's estimate_mfu)."""
        return 6 * self.matmul_parameter_count + 12 * self.layers * self.heads * self.head_dim * seq_len


def model_shape(model: Any) -> ModelShape:
    model = getattr(model, "module", model)  # unwrap DistributedDataParallel
    config = model.config
    total = sum(parameter.numel() for parameter in model.parameters())
    # A token embedding is a lookup, not a matmul; it counts once when tied to the output head.
    lookup = 0
    embeddings = model.get_input_embeddings()
    tied = model.get_output_embeddings() is not None and model.get_output_embeddings().weight is embeddings.weight
    if not tied:
        lookup += embeddings.weight.numel()
    position = getattr(getattr(model, "transformer", None), "wpe", None)
    if position is not None:
        lookup += position.weight.numel()
    heads = config.num_attention_heads
    hidden = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return ModelShape(total, total - lookup, config.num_hidden_layers, heads, head_dim)


def model_record(spec: ModelSpec, shape: ModelShape) -> dict[str, Any]:
    """The `model` section of a calibration or run."""
    return {
        "name": spec.name,
        "source": str(spec.directory) if spec.directory else "preset",
        "architecture": spec.config_dict.get("model_type"),
        "parameter_count": shape.parameter_count,
        "matmul_parameter_count": shape.matmul_parameter_count,
        "layers": shape.layers,
        "heads": shape.heads,
        "head_dim": shape.head_dim,
        "vocab_size": spec.config_dict.get("vocab_size"),
        "fingerprint": spec.fingerprint,
    }
