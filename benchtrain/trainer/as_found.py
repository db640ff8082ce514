"""A user's Trainer put back as it was found after benchtrain measured its step (`benchtrain.calibrate`): the trainable
weights and buffers bit for bit, gradients, each module's train/eval mode, gradient checkpointing, the random number
generators, the Trainer's own attributes (optimizer, scheduler, metrics a subclass gathers) and a mixed-precision
scaler's state. Why: docs/design.md#calibrate-a-trainer"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from benchtrain.train.workload.method import unwrap

if TYPE_CHECKING:
    import torch

# The Trainer's attributes of these types are copied and put back (numbers, text, containers: the optimizer and
# scheduler slots, a subclass's metrics lists); objects (the model, the arguments, the state) are never changed.
PLAIN = (int, float, str, bool, type(None), dict, list, tuple, set)
# What transformers' gradient checkpointing sets on a module.
CHECKPOINTING_ATTRIBUTES = ("gradient_checkpointing", "_gradient_checkpointing_func")
MISSING = object()


@dataclass
class RandomStates:
    """Python's, numpy's, torch's CPU and (when initialised) every CUDA device's generator."""

    python: Any
    numpy: Any
    torch_cpu: torch.Tensor
    cuda: list[torch.Tensor] | None

    @classmethod
    def now(cls) -> RandomStates:
        import torch

        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        return cls(random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda)

    def restore(self) -> None:
        import torch

        random.setstate(self.python)
        np.random.set_state(self.numpy)
        torch.set_rng_state(self.torch_cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


@dataclass
class AsFound:
    """What `restore` puts back on a Trainer (`take` reads it before anything is measured)."""

    trainer: Any
    tensors: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (live, copy)
    gradients: list[tuple[torch.nn.Parameter, torch.Tensor | None]] = field(default_factory=list)
    modes: list[tuple[torch.nn.Module, bool]] = field(default_factory=list)
    checkpointing: list[tuple[torch.nn.Module, str, object]] = field(default_factory=list)
    input_grads_hook: bool = False
    use_cache: object = MISSING
    attributes: dict[str, tuple[object, object]] = field(default_factory=dict)  # name: (the object, a deep copy)
    scaler: dict[str, Any] | None = None
    randomness: RandomStates | None = None

    @classmethod
    def take(cls, trainer: Any) -> AsFound:
        import torch

        model = trainer.model
        found = cls(trainer)
        with torch.no_grad():
            # What a step can change: trainable parameters (a frozen base, 4-bit included, gets no gradient) and
            # buffers; compared bit for bit by the tests.
            live = [parameter for parameter in model.parameters() if parameter.requires_grad]
            live += list(model.buffers())
            found.tensors = [(tensor, tensor.detach().clone()) for tensor in live]
        found.gradients = [
            (parameter, None if parameter.grad is None else parameter.grad.detach().clone())
            for parameter in model.parameters()
        ]
        found.modes = [(module, module.training) for module in model.modules()]
        found.checkpointing = [
            (module, name, module.__dict__.get(name, MISSING))
            for module in model.modules()
            for name in CHECKPOINTING_ATTRIBUTES
        ]
        base = unwrap(model)
        found.input_grads_hook = getattr(base, "_require_grads_hook", None) is not None
        found.use_cache = getattr(getattr(base, "config", None), "use_cache", MISSING)
        found.attributes = plain_attributes(trainer)
        scaler = getattr(trainer.accelerator, "scaler", None)
        found.scaler = copy.deepcopy(scaler.state_dict()) if scaler is not None else None
        found.randomness = RandomStates.now()
        return found

    def restore(self) -> None:
        import torch

        trainer = self.trainer
        with torch.no_grad():
            for tensor, saved in self.tensors:
                tensor.copy_(saved)
        for parameter, gradient in self.gradients:
            parameter.grad = gradient
        for module, name, value in self.checkpointing:
            if value is MISSING:
                module.__dict__.pop(name, None)
            else:
                module.__dict__[name] = value
        base = unwrap(trainer.model)
        has_hook = getattr(base, "_require_grads_hook", None) is not None
        if self.input_grads_hook and not has_hook:
            base.enable_input_require_grads()
        elif has_hook and not self.input_grads_hook:
            base.disable_input_require_grads()
        if self.use_cache is not MISSING:
            base.config.use_cache = self.use_cache
        for module, training in self.modes:
            module.training = training
        for name in [name for name in vars(trainer) if name not in self.attributes and is_plain(vars(trainer)[name])]:
            delattr(trainer, name)  # what the probes added (a column list the Trainer caches, say)
        for name, (original, copied) in self.attributes.items():
            put_back(trainer, name, original, copied)
        scaler = getattr(trainer.accelerator, "scaler", None)
        if scaler is not None and self.scaler is not None:
            scaler.load_state_dict(self.scaler)
        if self.randomness is not None:
            self.randomness.restore()


def is_plain(value: object) -> bool:
    return isinstance(value, PLAIN)


def plain_attributes(trainer: Any) -> dict[str, tuple[object, object]]:
    """The Trainer's plain attributes (PLAIN), each with a deep copy; one that cannot be copied is left as it is."""
    copied: dict[str, tuple[object, object]] = {}
    for name, value in vars(trainer).items():
        if not is_plain(value):
            continue
        try:
            copied[name] = (value, copy.deepcopy(value))
        except Exception:  # a container holding something uncopyable: it is the Trainer's, and the probes never set it
            continue
    return copied


def put_back(trainer: Any, name: str, original: object, saved: object) -> None:
    """The attribute is the object it was (whoever holds it keeps it) with its content as it was: a container the
    step filled in place (a subclass's metrics lists) gets the copy's content back."""
    setattr(trainer, name, original)
    if isinstance(original, dict) and isinstance(saved, dict):
        original.clear()
        original.update(saved)
    elif isinstance(original, list) and isinstance(saved, list):
        original[:] = saved
    elif isinstance(original, set) and isinstance(saved, set):
        original.clear()
        original.update(saved)
