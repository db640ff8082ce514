"""The model people use: `final/` (and `final-merged/`) in the Hugging Face layout, each folder written
atomically, and `load_final` to load it back. The layouts: docs/design.md#the-exported-model."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchtrain.common.atomic import atomic_directory
from benchtrain.common.errors import BenchtrainError
from benchtrain.common.json_types import JsonDict
from benchtrain.common.pause import pause_at
from benchtrain.train.workload.method import MethodConfig
from benchtrain.train.workload.model import ModelSpec, make_config
from benchtrain.train.workload.quantize import bitsandbytes_config, keep_one_weight_layout

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase


FINAL = "final"
EMBEDDED_BASE = "."  # how an adapter names a base saved in its own folder
FINAL_MERGED = "final-merged"
ADAPTER_CONFIG = "adapter_config.json"
RUN_NOTE = "benchtrain.json"  # in final/: what a loader needs beyond peft's files (the base's quantization)


def export_final(
    run_dir: Path,
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    spec: ModelSpec,
    method: MethodConfig,
    merge_lora: bool = False,
    full_weights: dict[str, torch.Tensor] | None = None,
) -> JsonDict:
    """Write the run's model folders; returns what run.json records. `full_weights`: an FSDP model's state gathered whole,
    saved in place of its shards (for LoRA, the adapters: the base is the preset's seeded build or its folder)."""
    started = time.perf_counter()
    trained: Any = getattr(model, "module", model)  # a transformers or peft model: their saving methods
    record: JsonDict = {"path": str(run_dir / FINAL), "format": "peft-adapter" if method.is_lora else "transformers"}
    if not method.is_lora:
        with atomic_directory(run_dir / FINAL) as folder:
            trained.save_pretrained(folder, state_dict=full_weights, safe_serialization=True)
            tokenizer.save_pretrained(folder)
            pause_at("export")
    else:
        revision = None
        base: str | None = None  # None: the base goes into final/ itself
        if spec.has_weights and spec.hub is not None:
            base, revision = spec.hub.repo_id, spec.hub.revision
        elif (
            spec.has_weights
            and spec.directory is not None
            and not Path(spec.directory).resolve().is_relative_to(run_dir.resolve())
        ):
            base = str(Path(spec.directory).resolve())  # not part of the run: it stays where it is
        with atomic_directory(run_dir / FINAL) as folder:
            if base is None:
                # A quantized or sharded base is written as the preset's seeded build (what it was made from).
                if method.quantized or full_weights is not None:
                    save_seeded_base(spec, tokenizer, folder)
                else:
                    save_base(trained, tokenizer, folder)
            config = trained.peft_config["default"]
            # peft reads the base's config.json at this name while saving (has the vocabulary been resized?), from the current directory, else asks the hub:
            # so it gets an absolute folder, and the adapter's file the name that travels with final/.
            config.base_model_name_or_path = base or str(folder)
            config.revision = revision
            trained.save_pretrained(folder, safe_serialization=True, state_dict=full_weights)
            if base is None:
                name_base(folder / ADAPTER_CONFIG, EMBEDDED_BASE)
            else:
                trained.get_base_model().config.save_pretrained(folder)
                tokenizer.save_pretrained(folder)
            if method.quantized:
                (folder / RUN_NOTE).write_text(
                    json.dumps({"base_quantization": method.quantize}, indent=2), encoding="utf-8"
                )
            pause_at("export")
        base = base or EMBEDDED_BASE
        record["base_model_name_or_path"] = base
        if method.quantized:
            record["base_quantization"] = method.quantize
        if revision:
            record["base_revision"] = revision
        if merge_lora:
            with atomic_directory(run_dir / FINAL_MERGED) as folder:
                # Last: merging folds the adapters into the base weights of the in-memory model; a quantized base is merged into in its own precision,
                # loaded from what final/ names. A sharded model is merged from what final/ holds (its adapters are in shards here).
                from_final = method.quantized or full_weights is not None
                merged = (load_final(run_dir / FINAL, quantized=False) if from_final else trained).merge_and_unload()
                record["merged_into"] = "the unquantized base" if method.quantized else "the trained base"
                merged.save_pretrained(folder, safe_serialization=True)
                tokenizer.save_pretrained(folder)
            record["merged_path"] = str(run_dir / FINAL_MERGED)
    record["seconds"] = time.perf_counter() - started
    return record


def save_base(peft_model: Any, tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    """The frozen base as a plain transformers model: the weights without the adapter tensors, under their original names."""
    base = peft_model.get_base_model()
    state = {
        name.replace(".base_layer.", "."): tensor for name, tensor in base.state_dict().items() if "lora_" not in name
    }
    base.save_pretrained(folder, state_dict=state, safe_serialization=True)
    tokenizer.save_pretrained(folder)


def save_seeded_base(spec: ModelSpec, tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    """A preset's base before quantization, built with the seed every build uses: quantized again, it is the trained base."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(make_config(spec)).save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)


def name_base(adapter_config: Path, base: str) -> None:
    """Rewrite the base an adapter_config.json names, keeping peft's layout of the file."""
    config = json.loads(adapter_config.read_text(encoding="utf-8"))
    config["base_model_name_or_path"] = base
    adapter_config.write_text(json.dumps(config, indent=2, sort_keys=True), encoding="utf-8")


def load_final(folder: str | Path, quantized: bool = True, **kwargs: Any) -> Any:
    """The trained model from a run's final/ (LoRA: base + adapter, a quantized base quantized again unless `quantized=False`).
    `kwargs` go to the (base) model's `from_pretrained`. A relative base is resolved against final/."""
    from transformers import AutoModelForCausalLM

    folder = Path(folder).expanduser()
    adapter_config = folder / ADAPTER_CONFIG
    if not adapter_config.is_file():
        return AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    from peft import PeftModel

    config = json.loads(adapter_config.read_text(encoding="utf-8"))
    if config.get("revision"):
        kwargs.setdefault("revision", config["revision"])
    note = folder / RUN_NOTE
    quantization = json.loads(note.read_text(encoding="utf-8")).get("base_quantization") if note.is_file() else None
    if quantization and quantized and "quantization_config" not in kwargs:
        import torch

        # 4-bit computes in bf16 on CUDA, fp32 on a CPU: the dtype each trained in (train.workload.quantize).
        kwargs["quantization_config"] = bitsandbytes_config(
            quantization, torch.bfloat16 if torch.cuda.is_available() else torch.float32
        )
        kwargs.setdefault("device_map", {"": 0} if torch.cuda.is_available() else "cpu")
        return PeftModel.from_pretrained(
            keep_one_weight_layout(load_base(folder, config["base_model_name_or_path"], **kwargs)), folder
        )
    return PeftModel.from_pretrained(load_base(folder, config["base_model_name_or_path"], **kwargs), folder)


def load_base(adapter: Path, base: str, **kwargs: Any) -> Any:
    """The model an adapter was trained on, without the adapter. A base in the adapter's own folder is built from its config
    and weights: `from_pretrained(folder)` would load the adapter it finds there, and peft would add it again."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if base != EMBEDDED_BASE:
        return AutoModelForCausalLM.from_pretrained(resolve_base(adapter, base), **kwargs)
    from safetensors.torch import load_file
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    index = adapter / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        if index.is_file()
        else ["model.safetensors"]
    )
    weights = {name: tensor for file in files for name, tensor in load_file(adapter / file).items()}
    config = AutoConfig.from_pretrained(adapter)
    model_class: Any = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # the class AutoModelForCausalLM picks for it
    # No folder to load from (`None`): the config and the weights are given, so no adapter is looked for.
    return model_class.from_pretrained(None, config=config, state_dict=weights, **kwargs)


def resolve_base(adapter: Path, base: str) -> str:
    """An adapter's base as `from_pretrained` takes it: a relative one resolved from the adapter's folder, others unchanged."""
    if not (base in (".", "..") or base.startswith(("./", "../"))):  # no hub id starts with "."
        return base
    path = (adapter / base).resolve()
    if not path.is_dir():
        raise BenchtrainError(
            f"the adapter in {adapter} names its base as {base}, but {path} does not exist; copy the whole run folder"
        )
    return str(path)
