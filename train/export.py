"""The model people use: `final/` in the Hugging Face layout, written atomically.

- full fine-tuning: `save_pretrained` with safetensors (config, generation config, weights) and the
  tokenizer, so `AutoModelForCausalLM.from_pretrained(final)` and `AutoTokenizer.from_pretrained(final)`
  work;
- LoRA: the PEFT adapter (`adapter_config.json`, `adapter_model.safetensors` with only LoRA tensors),
  the tokenizer and the base's `config.json`. The adapter's `base_model_name_or_path` points at the
  base: the hub id (with its commit as `revision`), the `--model DIR` folder, or — for a preset
  built from its config, which has no weights on disk — `final-base/`, written here, so
  `PeftModel.from_pretrained(base, final)` is exactly the trained model. A base inside the run
  folder (`final-base/`, a `--model DIR` under `--out`) is named relative to `final/`
  (`../final-base`), so the run folder can be moved, copied or shared; a `--model DIR` outside the
  run folder is not part of the run and stays an absolute path;
- `--merge-lora`: also the merged full model in `final-merged/`.
- `--quantize 4bit|8bit` (a LoRA run on a bitsandbytes base): final/ also holds `benchtrain.json`
  naming the quantization the adapters were trained on; a preset's `final-base/` holds its
  unquantized (seeded) weights, which quantize to exactly the base that was trained. `load_final`
  loads the base quantized that way (`quantized=False`: in its own precision), and `--merge-lora`
  merges into the unquantized base (peft's way for QLoRA adapters), not the 4-bit one.

Each folder is written to a temporary folder and renamed, so a crash never leaves half a model.
`load_final(final)` loads the trained model back, wherever the run folder now is.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.atomic import atomic_directory
from common.errors import BenchtrainError
from common.json_types import JsonDict
from train.workload.method import MethodConfig
from train.workload.model import ModelSpec, make_config
from train.workload.quantize import bitsandbytes_config, keep_one_weight_layout

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase


FINAL = "final"
FINAL_BASE = "final-base"
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
    """Write the run's model folders; returns what run.json records (paths, seconds).
    `full_weights`: an FSDP model's state, gathered whole (train.step.sharding), saved in place of its shards."""
    started = time.perf_counter()
    trained: Any = getattr(model, "module", model)  # a transformers or peft model: their saving methods
    record: JsonDict = {"path": str(run_dir / FINAL), "format": "peft-adapter" if method.is_lora else "transformers"}
    if not method.is_lora:
        with atomic_directory(run_dir / FINAL) as folder:
            trained.save_pretrained(folder, state_dict=full_weights, safe_serialization=True)
            tokenizer.save_pretrained(folder)
    else:
        revision = None
        if spec.has_weights and spec.hub is not None:
            base, revision = spec.hub.repo_id, spec.hub.revision
            location = base
        else:
            if spec.has_weights and spec.directory is not None:  # has_weights: it has a folder
                base_path = Path(spec.directory).resolve()
            else:
                base_path = (run_dir / FINAL_BASE).resolve()
                with atomic_directory(base_path) as folder:
                    if method.quantized:
                        save_seeded_base(spec, tokenizer, folder)
                    else:
                        save_base(trained, tokenizer, folder)
            base, location = base_reference(run_dir, base_path), str(base_path)
            if is_relative_reference(base):
                # run.json also keeps the absolute folder, where it was when the run wrote it.
                record["base_path"] = location
        with atomic_directory(run_dir / FINAL) as folder:
            config = trained.peft_config["default"]
            # peft reads the base's config.json at this name while saving (has the vocabulary been
            # resized?), from the current directory, else asks the hub: so it gets the absolute
            # folder, and the adapter's file the reference that travels with the run.
            config.base_model_name_or_path = location
            config.revision = revision
            trained.save_pretrained(folder, safe_serialization=True)
            if base != location:
                name_base(folder / ADAPTER_CONFIG, base)
            trained.get_base_model().config.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            if method.quantized:
                (folder / RUN_NOTE).write_text(json.dumps({"base_quantization": method.quantize}, indent=2), encoding="utf-8")
        record["base_model_name_or_path"] = base
        if method.quantized:
            record["base_quantization"] = method.quantize
        if revision:
            record["base_revision"] = revision
        if merge_lora:
            with atomic_directory(run_dir / FINAL_MERGED) as folder:
                # Last: merging folds the adapters into the base weights of the in-memory model; a
                # quantized base is merged into in its own precision, loaded from what final/ names.
                merged = (load_final(run_dir / FINAL, quantized=False) if method.quantized else trained).merge_and_unload()
                record["merged_into"] = "the unquantized base" if method.quantized else "the trained base"
                merged.save_pretrained(folder, safe_serialization=True)
                tokenizer.save_pretrained(folder)
            record["merged_path"] = str(run_dir / FINAL_MERGED)
    record["seconds"] = time.perf_counter() - started
    return record


def save_base(peft_model: Any, tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
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


def save_seeded_base(spec: ModelSpec, tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    """A preset's base before quantization: built from its config with the seed every build uses
    (train.workload.model.build_model), so that quantizing it again gives the trained base."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(make_config(spec)).save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)


def base_reference(run_dir: Path, base: Path) -> str:
    """How final/ names a base folder: relative to final/ (`../final-base`) when the base lies in the
    run folder, so the reference survives moving or copying the run; else its absolute path, since a
    folder outside the run does not travel with it."""
    adapter = (run_dir / FINAL).resolve()
    run_root = run_dir.resolve()
    if not base.is_relative_to(run_root):
        return str(base)
    # Always with a leading "./" or "../": that is what tells a path from a hub id ("org/name").
    relative = Path(os.path.relpath(base, adapter)).as_posix()
    return relative if relative.startswith(".") else f"./{relative}"


def name_base(adapter_config: Path, base: str) -> None:
    """Rewrite the base an adapter_config.json names, keeping peft's layout of the file."""
    config = json.loads(adapter_config.read_text(encoding="utf-8"))
    config["base_model_name_or_path"] = base
    adapter_config.write_text(json.dumps(config, indent=2, sort_keys=True), encoding="utf-8")


def is_relative_reference(base: str) -> bool:
    """A base named relative to the adapter folder. Hub ids cannot start with ".", so no hub id reads as one."""
    return base == "." or base == ".." or base.startswith(("./", "../"))


def load_final(folder: str | Path, quantized: bool = True, **kwargs: Any) -> Any:
    """The trained model from a run's final/: a full fine-tune's model, or base + adapter for LoRA.
    `kwargs` go to the `from_pretrained` that loads the (base) model (`dtype`, `device_map`, ...).
    An adapter trained on a quantized base gets its base quantized the same way (`quantized=False`:
    the base in its own precision, e.g. to merge).

    peft's `AutoPeftModelForCausalLM.from_pretrained(final)` resolves a relative base against the
    current directory; this resolves it against final/, so it works from anywhere the run folder is."""
    from transformers import AutoModelForCausalLM

    folder = Path(folder).expanduser()
    adapter_config = folder / ADAPTER_CONFIG
    if not adapter_config.is_file():
        return AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    from peft import PeftModel

    config = json.loads(adapter_config.read_text(encoding="utf-8"))
    base = resolve_base(folder, config["base_model_name_or_path"])
    if config.get("revision"):
        kwargs.setdefault("revision", config["revision"])
    note = folder / RUN_NOTE
    quantization = json.loads(note.read_text(encoding="utf-8")).get("base_quantization") if note.is_file() else None
    if quantization and quantized and "quantization_config" not in kwargs:
        import torch

        # 4-bit computes in bf16 on CUDA, fp32 on a CPU: the dtype each trained in (train.workload.quantize).
        kwargs["quantization_config"] = bitsandbytes_config(quantization, torch.bfloat16 if torch.cuda.is_available() else torch.float32)
        kwargs.setdefault("device_map", {"": 0} if torch.cuda.is_available() else "cpu")
        return PeftModel.from_pretrained(keep_one_weight_layout(AutoModelForCausalLM.from_pretrained(base, **kwargs)), folder)
    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, **kwargs), folder)


def resolve_base(adapter: Path, base: str) -> str:
    """An adapter's base as `from_pretrained` takes it: a relative one as the folder it names from the
    adapter's folder; an absolute path or hub id unchanged."""
    if not is_relative_reference(base):
        return base
    path = (adapter / base).resolve()
    if not path.is_dir():
        raise BenchtrainError(f"the adapter in {adapter} names its base as {base}, but {path} does not exist; copy the whole run folder")
    return str(path)
