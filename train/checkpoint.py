"""Checkpoints: model, optimizer, scheduler, RNG and loop position, written atomically.

A checkpoint is a folder `step-000123` under `<run>/checkpoints/`, written as a temporary folder
and renamed; only the last `keep` are kept. Save time is measured and returned.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path
from typing import Any

from calibration.atomic import atomic_directory

STATE_FILE = "state.pt"
META_FILE = "meta.json"


def rng_state() -> dict[str, Any]:
    import numpy as np
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(folder: Path, model: Any, optimizer: Any, scheduler: Any, meta: dict[str, Any], keep: int | None = None) -> float:
    """Write `folder` atomically; returns the seconds it took. Prunes old siblings to `keep`."""
    import torch

    started = time.perf_counter()
    with atomic_directory(folder) as temporary:
        state = {
            "model": model_state(model),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "rng": rng_state(),
        }
        torch.save(state, temporary / STATE_FILE)
        (temporary / META_FILE).write_text(json.dumps(meta, indent=2))
    if keep:
        prune_checkpoints(folder.parent, keep)
    return time.perf_counter() - started


def _unwrapped(model: Any) -> Any:
    return getattr(model, "module", model)


def model_state(model: Any) -> dict[str, Any]:
    """What a checkpoint must keep of the model: everything for full fine-tuning; for LoRA only the
    trainable adapters (the frozen base is rebuilt from the preset or the model folder)."""
    module = _unwrapped(model)
    trainable = {name for name, parameter in module.named_parameters() if parameter.requires_grad}
    if len(trainable) == sum(1 for _ in module.parameters()):
        return module.state_dict()
    return {name: value for name, value in module.state_dict().items() if name in trainable}


def load_model_state(model: Any, state: dict[str, Any], source: Path) -> None:
    """Restore `model_state`: all of it, or (LoRA) exactly the trainable tensors."""
    from calibration.errors import BenchtrainError

    module = _unwrapped(model)
    trainable = {name for name, parameter in module.named_parameters() if parameter.requires_grad}
    partial = len(trainable) < sum(1 for _ in module.parameters())
    missing, unexpected = module.load_state_dict(state, strict=not partial)
    lost = sorted(trainable & set(missing)) if partial else []
    if unexpected or lost:
        raise BenchtrainError(f"checkpoint {source} does not match this model ({len(unexpected)} unexpected, {len(lost)} missing tensors)")


def list_checkpoints(parent: Path) -> list[Path]:
    if not parent.is_dir():
        return []
    return sorted(p for p in parent.iterdir() if p.is_dir() and p.name.startswith("step-") and (p / META_FILE).is_file())


def prune_checkpoints(parent: Path, keep: int) -> None:
    for old in list_checkpoints(parent)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(folder: Path, model: Any, optimizer: Any, scheduler: Any) -> dict[str, Any]:
    """Restore everything saved in `folder`; returns its meta (loop position)."""
    import torch

    state = torch.load(folder / STATE_FILE, map_location="cpu", weights_only=False)
    load_model_state(model, state["model"], folder)
    optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return json.loads((folder / META_FILE).read_text())


def checkpoint_name(step: int) -> str:
    return f"step-{step:07d}"
