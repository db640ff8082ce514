"""The model people use: `final/` in the Hugging Face layout, written atomically.

- full fine-tuning: `save_pretrained` with safetensors (config, generation config, weights) and the
  tokenizer, so `AutoModelForCausalLM.from_pretrained(final)` and `AutoTokenizer.from_pretrained(final)`
  work;
- LoRA: the PEFT adapter (`adapter_config.json`, `adapter_model.safetensors` with only LoRA tensors),
  the tokenizer and the base's `config.json`. The adapter's `base_model_name_or_path` points at the
  base: the hub id (with its commit as `revision`), the `--model DIR` folder, or — for a preset
  built from its config, which has no weights on disk — `final-base/`, written here, so
  `PeftModel.from_pretrained(base, final)` is exactly the trained model;
- `--merge-lora`: also the merged full model in `final-merged/`.

Each folder is written to a temporary folder and renamed, so a crash never leaves half a model.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from common.atomic import atomic_directory
from train.workload.method import MethodConfig

FINAL = "final"
FINAL_BASE = "final-base"
FINAL_MERGED = "final-merged"


def export_final(
    run_dir: Path, model: Any, tokenizer: Any, spec: Any, method: MethodConfig, merge_lora: bool = False, full_weights: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Write the run's model folders; returns what run.json records (paths, seconds).
    `full_weights`: an FSDP model's state, gathered whole (train.step.sharding), saved in place of its shards."""
    started = time.perf_counter()
    model = getattr(model, "module", model)
    record: dict[str, Any] = {"path": str(run_dir / FINAL), "format": "peft-adapter" if method.is_lora else "transformers"}
    if not method.is_lora:
        with atomic_directory(run_dir / FINAL) as folder:
            model.save_pretrained(folder, state_dict=full_weights, safe_serialization=True)
            tokenizer.save_pretrained(folder)
    else:
        revision = None
        if spec.has_weights and spec.hub is not None:
            base_path, revision = spec.hub.repo_id, spec.hub.revision
        elif spec.has_weights:
            base_path = Path(spec.directory).resolve()
        else:
            base_path = (run_dir / FINAL_BASE).resolve()
            with atomic_directory(base_path) as folder:
                save_base(model, tokenizer, folder)
            record["base_path"] = str(base_path)
        with atomic_directory(run_dir / FINAL) as folder:
            config = model.peft_config["default"]
            config.base_model_name_or_path = str(base_path)
            config.revision = revision
            model.save_pretrained(folder, safe_serialization=True)
            model.get_base_model().config.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
        record["base_model_name_or_path"] = str(base_path)
        if revision:
            record["base_revision"] = revision
        if merge_lora:
            with atomic_directory(run_dir / FINAL_MERGED) as folder:
                # Last: merging folds the adapters into the base weights of the in-memory model.
                merged = model.merge_and_unload()
                merged.save_pretrained(folder, safe_serialization=True)
                tokenizer.save_pretrained(folder)
            record["merged_path"] = str(run_dir / FINAL_MERGED)
    record["seconds"] = time.perf_counter() - started
    return record


def save_base(peft_model: Any, tokenizer: Any, folder: Path) -> None:
    """The frozen base as a plain transformers model: the wrapped model's weights without the
    adapter tensors, under their original names."""
    base = peft_model.get_base_model()
    state = {}
    for name, tensor in base.state_dict().items():
        if "lora_" in name:
            continue
        state[name.replace(".base_layer.", ".")] = tensor
    base.save_pretrained(folder, state_dict=state, safe_serialization=True)
    tokenizer.save_pretrained(folder)
