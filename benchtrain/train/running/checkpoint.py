"""Checkpoints: safe to load (safetensors, weights_only), atomic to write, sealed by a COMPLETE
marker, gathered to rank 0 under FSDP. The layout and why: docs/design.md#checkpoints."""

from __future__ import annotations

import errno
import json
import os
import pickle
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, cast

import numpy as np

from benchtrain.common.atomic import atomic_directory
from benchtrain.common.errors import EXIT_DISK, BenchtrainError
from benchtrain.common.json_types import JsonDict
from benchtrain.common.pause import pause_at
from benchtrain.train.step.sharding import broadcast_from_rank0, gather_full_state, is_sharded, scatter_full_state

if TYPE_CHECKING:
    import torch
    from torch.optim import Optimizer
    from torch.optim.lr_scheduler import LRScheduler

WEIGHTS_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
PROGRESS_FILE = "progress.json"
MARKER_FILE = "COMPLETE"
LEGACY_STATE_FILE = "state.pt"


class CheckpointWriteError(BenchtrainError):
    """A checkpoint could not be written (disk full, I/O error); the previous one is intact."""

    exit_code = EXIT_DISK


class CheckpointReadError(BenchtrainError):
    """A checkpoint that cannot be used: unreadable, unsafe, or for another model."""


class RngState(NamedTuple):
    plain: JsonDict  # Python's and NumPy's, JSON-able (progress.json)
    tensors: JsonDict  # torch's (and CUDA's) generator tensors (optimizer.pt)


def rng_state() -> RngState:
    import torch

    version, internal, gauss = random.getstate()
    name, keys, position, has_gauss, cached = np.random.get_state(legacy=True)
    plain = {
        "python": [version, list(internal), gauss],
        "numpy": [name, np.asarray(keys).tolist(), int(position), int(has_gauss), float(cached)],
    }
    tensors: JsonDict = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["cuda"] = torch.cuda.get_rng_state_all()
    return RngState(plain, tensors)


def set_rng_state(plain: JsonDict, tensors: JsonDict) -> None:
    import torch

    version, internal, gauss = plain["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, position, has_gauss, cached = plain["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), position, has_gauss, cached))
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(tensors["cuda"])


def save_checkpoint(
    folder: Path,
    model: torch.nn.Module,
    optimizer: Optimizer,
    scheduler: LRScheduler | None,
    meta: JsonDict,
    keep: int | None = None,
) -> float:
    """Write `folder` atomically, then prune older siblings of the same run (meta's run_id) to `keep`; returns the seconds
    it took."""
    import torch
    from safetensors.torch import save_file

    started = time.perf_counter()
    plain_rng, tensor_rng = rng_state()
    if is_sharded(model):
        import torch.distributed as dist

        full_weights, optimizer_state = gather_full_state(model, optimizer)  # every process, together
        if dist.get_rank() != 0:
            return time.perf_counter() - started
    else:
        full_weights, optimizer_state = model_state(model), optimizer.state_dict()
    try:
        with atomic_directory(folder) as temporary:
            weights = {name: tensor.detach().contiguous().cpu() for name, tensor in full_weights.items()}
            save_file(_untied(weights), str(temporary / WEIGHTS_FILE))
            state = {
                "optimizer": optimizer_state,
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "rng": tensor_rng,
            }
            torch.save(state, temporary / OPTIMIZER_FILE)
            (temporary / PROGRESS_FILE).write_text(json.dumps({**meta, "rng": plain_rng}, indent=1))
            pause_at("checkpoint", meta.get("step"))
            _seal(temporary)
    except (OSError, RuntimeError) as error:
        raise write_error(folder, error) from None
    if (
        keep
    ):  # older ones go only once the new one is complete; another run's in a reused --out are not this run's to prune
        run_id = meta.get("run_id")
        for old in list_checkpoints(folder.parent, run_id if isinstance(run_id, str) else None)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return time.perf_counter() - started


def write_error(folder: Path, error: BaseException) -> CheckpointWriteError:
    """One line: what failed, that the previous checkpoint is intact, how to resume."""
    run_dir = folder.parent.parent
    full = (
        (isinstance(error, OSError) and error.errno == errno.ENOSPC)
        or "unexpected pos" in str(error)
        or "No space left" in str(error)
    )
    problem = (
        "the disk is full"
        if full
        else f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else 'I/O error'}"
    )
    previous = list_checkpoints(folder.parent)
    kept = f"the last checkpoint, {previous[-1].name}, is intact" if previous else "no earlier checkpoint exists"
    return CheckpointWriteError(
        f"could not save checkpoint {folder.name} in {folder.parent}: {problem}; {kept}; free space, then `train --resume --out {run_dir}`"
    )


def _untied(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied embeddings): store the later ones as copies."""
    seen: set[int] = set()
    out = {}
    for name, tensor in weights.items():
        pointer = tensor.data_ptr()
        out[name] = tensor.clone() if pointer in seen else tensor
        seen.add(pointer)
    return out


def _seal(folder: Path) -> None:
    """Every file on disk, then the marker, then the folder's entries: only a whole checkpoint has a marker."""
    for path in folder.iterdir():
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
    with open(folder / MARKER_FILE, "w") as handle:
        handle.write("complete\n")
        handle.flush()
        os.fsync(handle.fileno())
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside a DistributedDataParallel wrapper (its `module`), or the model itself."""
    return cast("torch.nn.Module", getattr(model, "module", model))


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Everything for full fine-tuning; for LoRA only the trainable adapters (the base is rebuilt)."""
    module = _unwrapped(model)
    trainable = {name for name, parameter in module.named_parameters() if parameter.requires_grad}
    if len(trainable) == sum(1 for _ in module.parameters()):
        return module.state_dict()
    return {name: value for name, value in module.state_dict().items() if name in trainable}


def check_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor], source: Path) -> bool:
    """Whether `state` is all of the model's state (True) or exactly its trainable tensors (LoRA, False); a one-line error when neither."""
    whole, expected = set(_unwrapped(model).state_dict()), set(model_state(model))
    unexpected, missing = sorted(set(state) - whole), sorted(expected - set(state))
    if unexpected or missing:
        example = (unexpected or missing)[0]
        counts = f"{len(unexpected)} unexpected, {len(missing)} missing tensors, e.g. {example}"
        raise CheckpointReadError(f"checkpoint {source} does not match this model ({counts})")
    return expected == whole


def list_checkpoints(parent: Path, run_id: str | None = None) -> list[Path]:
    """Complete checkpoints, oldest first (a folder without its marker is not one); with `run_id`, only that run's: a new
    run in a reused --out names its checkpoints as the old run did, and step numbers alone would mix the two."""
    if not parent.is_dir():
        return []
    found = sorted(
        p for p in parent.iterdir() if p.is_dir() and p.name.startswith("step-") and (p / MARKER_FILE).is_file()
    )
    return found if run_id is None else [folder for folder in found if checkpoint_run_id(folder) == run_id]


def checkpoint_run_id(folder: Path) -> str | None:
    """The run a checkpoint belongs to (its progress.json's run_id); None when it does not say (or cannot be read)."""
    try:
        progress = json.loads((folder / PROGRESS_FILE).read_text())
    except (OSError, ValueError):
        return None
    run_id = progress.get("run_id") if isinstance(progress, dict) else None
    return run_id if isinstance(run_id, str) else None


def checkpoints_to_resume(run_dir: Path, run_id: str | None = None) -> list[Path]:
    """The run's complete checkpoints (`run_id`'s, where given), oldest first; none is the one-line --resume error."""
    parent = run_dir / "checkpoints"
    # A run from before checkpoints named their run: its unlabelled ones.
    found = list_checkpoints(parent, run_id) or [
        one for one in list_checkpoints(parent) if checkpoint_run_id(one) is None
    ]
    if not found:
        raise BenchtrainError(f"--resume: no checkpoint in {run_dir / 'checkpoints'}")
    return found


def read_progress(folder: Path) -> JsonDict:
    """The checkpoint's progress.json, or a one-line error naming it."""
    try:
        progress = json.loads((folder / PROGRESS_FILE).read_text())
    except (OSError, ValueError) as error:
        raise CheckpointReadError(f"checkpoint {folder}: cannot read {PROGRESS_FILE} ({error})") from None
    if not isinstance(progress, dict) or not isinstance(progress.get("step"), int):
        raise CheckpointReadError(f"checkpoint {folder}: {PROGRESS_FILE} has no step")
    return progress


def load_checkpoint(
    folder: Path, model: torch.nn.Module, optimizer: Optimizer, scheduler: LRScheduler | None
) -> JsonDict:
    """Restore everything saved in `folder` (nothing unpickled beyond tensors: weights_only); returns its progress."""
    if is_sharded(model):
        return _load_sharded(folder, model, optimizer, scheduler)
    progress = read_progress(folder)
    weights, state = _read_state(folder)
    whole = check_model_state(model, weights, folder)  # LoRA: exactly the trainable tensors
    try:
        _unwrapped(model).load_state_dict(weights, strict=whole)
    except RuntimeError as error:
        raise CheckpointReadError(
            f"checkpoint {folder} does not match this model ({str(error).splitlines()[0]})"
        ) from None
    load_optimizer = lambda: optimizer.load_state_dict(state["optimizer"])  # noqa: E731
    return _restore_rest(
        folder, progress, load_optimizer, scheduler, state, "the optimizer state does not match this model"
    )


def _restore_rest(
    folder: Path,
    progress: JsonDict,
    load_optimizer: Callable[[], object],
    scheduler: LRScheduler | None,
    state: JsonDict,
    mismatch: str,
) -> JsonDict:
    """Optimizer (`load_optimizer()`), scheduler and RNG state back; `progress` without its RNG.
    A state that does not fit is a one-line error saying `mismatch`."""
    try:
        load_optimizer()
        if scheduler is not None and state.get("scheduler") is not None:
            scheduler.load_state_dict(state["scheduler"])
    except (ValueError, KeyError, RuntimeError) as error:
        raise CheckpointReadError(f"checkpoint {folder}: {mismatch} ({str(error).splitlines()[0]})") from None
    set_rng_state(progress.pop("rng"), state["rng"])
    return progress


class SavedState(NamedTuple):
    weights: dict[str, torch.Tensor]  # model.safetensors
    state: JsonDict  # optimizer.pt: the optimizer's, the scheduler's and torch's RNG state


def _read_state(folder: Path) -> SavedState:
    """The weights and the optimizer, scheduler and RNG state of `folder`, read safely, or a one-line error."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if (folder / LEGACY_STATE_FILE).is_file() and not (folder / WEIGHTS_FILE).is_file():
        raise CheckpointReadError(
            f"checkpoint {folder} is in the old pickle format ({LEGACY_STATE_FILE}), which is not loaded: it could run code"
        )
    try:
        weights = load_file(str(folder / WEIGHTS_FILE))
        state = torch.load(folder / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
    except (OSError, SafetensorError, pickle.UnpicklingError, RuntimeError, EOFError) as error:
        raise CheckpointReadError(
            f"checkpoint {folder} cannot be loaded safely ({type(error).__name__}: {str(error).splitlines()[0][:160]})"
        ) from None
    if not isinstance(state, dict) or "optimizer" not in state or "rng" not in state:
        raise CheckpointReadError(f"checkpoint {folder}: {OPTIMIZER_FILE} holds no optimizer state")
    return SavedState(weights, state)


def _load_sharded(
    folder: Path, model: torch.nn.Module, optimizer: Optimizer, scheduler: LRScheduler | None
) -> JsonDict:
    """FSDP: rank 0 reads and checks the files and broadcasts the verdict, the scheduler and RNG
    state, then each rank receives its shard of the weights and optimizer state."""
    import torch.distributed as dist

    progress = read_progress(folder)
    weights: dict[str, torch.Tensor] = {}
    state: JsonDict = {"optimizer": {}}
    problem = None
    if dist.get_rank() == 0:
        try:
            weights, state = _read_state(folder)
            check_model_state(model, weights, folder)
        except CheckpointReadError as error:
            problem = str(error)
    problem, small = broadcast_from_rank0((problem, {key: state.get(key) for key in ("scheduler", "rng")}))
    if problem:
        raise CheckpointReadError(problem)
    scatter = lambda: scatter_full_state(model, optimizer, dict(weights), state["optimizer"])  # noqa: E731
    return _restore_rest(folder, progress, scatter, scheduler, small, "the state does not match this sharded model")


def checkpoint_name(step: int) -> str:
    return f"step-{step:07d}"


def checkpoint_bytes(model: torch.nn.Module, optimizer_state_bytes: int) -> int:
    """Bytes one checkpoint writes: the saved weights plus the optimizer state."""
    return sum(tensor.numel() * tensor.element_size() for tensor in model_state(model).values()) + optimizer_state_bytes
