"""A model's initial weights made one module at a time, for models built on the `meta` device: the
values `from_config` gives, bit for bit, holding one module at a time. How: docs/design.md#initial-weights-one-module-at-a-time"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from benchtrain.common.errors import BenchtrainError

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel

# In-place ops that write every element of their target without reading it: tensor methods, and
# torch.nn.init's functions (which take their tensor as `tensor=`, and whose inner ops a mode does not see).
WHOLE_WRITES = {
    "normal_",
    "uniform_",
    "fill_",
    "zero_",
    "copy_",
    "exponential_",
    "geometric_",
    "log_normal_",
    "cauchy_",
    "random_",
    "bernoulli_",
}
WHOLE_WRITES |= {
    "constant_",
    "ones_",
    "zeros_",
    "eye_",
    "dirac_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
}
WHOLE_WRITES |= {"trunc_normal_", "orthogonal_", "sparse_"}


@dataclass
class Step:
    """One module's share of building the model: its constructor's init ("construct") or its
    `_init_weights` under the model that owns it ("init"), and what it writes."""

    kind: str
    module: Any
    owner: Any = None
    writes: dict[int, bool] = field(default_factory=dict)  # id of a tensor → first write overwrites it whole


def meta_plain_model(config: PretrainedConfig, dtype: torch.dtype | None = None) -> PreTrainedModel:
    """The causal LM of `config` on `meta`, with SDPA attention: nothing allocated, nothing drawn. A
    skeleton to shard or quantize, or the scratch copy `seeded_tensors` draws the initial weights from."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(
            copy.deepcopy(config), attn_implementation="sdpa", dtype=dtype or torch.float32
        )


def build_steps(model: torch.nn.Module) -> list[Step]:
    """The steps of `from_config`'s construction of `model`, in order (see the module's doc)."""
    from transformers import PreTrainedModel

    steps: list[Step] = []
    done: set[int] = set()

    def post_order(module: Any, owner: Any) -> Iterator[tuple[Any, Any]]:
        for child in module.children():  # smart_apply: a sub-model brings its own `_init_weights`
            yield from post_order(child, child if isinstance(child, PreTrainedModel) else owner)
        yield owner, module

    def construct(module: Any) -> None:
        if any(True for _ in module.parameters(recurse=False)):
            steps.append(Step("construct", module))
        for child in module.children():
            construct(child)
        if isinstance(module, PreTrainedModel):
            for owner, sub in post_order(module, module):
                if id(sub) not in done:
                    done.add(id(sub))
                    steps.append(Step("init", sub, owner))

    construct(model)
    return steps


def run_step(step: Step) -> None:
    """What the step did in `from_config` (on whatever tensors the module holds now)."""
    import torch
    from transformers import initialization
    from transformers.pytorch_utils import Conv1D

    with torch.no_grad():
        if step.kind == "init":
            with initialization.guard_torch_init_functions():
                step.owner._init_weights(step.module)
        elif isinstance(step.module, Conv1D):
            torch.nn.init.normal_(step.module.weight, std=0.02)  # Conv1D's constructor
        elif hasattr(step.module, "reset_parameters"):
            step.module.reset_parameters()


def record_writes(steps: list[Step]) -> None:
    """Run each step on `meta`, noting the tensors it writes (by id) and how it first writes each."""
    import torch
    from torch.overrides import TorchFunctionMode

    class Writes(TorchFunctionMode):
        def __init__(self, step: Step) -> None:
            super().__init__()
            self.step = step

        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            name = getattr(func, "__name__", "")
            target = args[0] if args else (kwargs or {}).get("tensor", (kwargs or {}).get("self"))
            if name.endswith("_") and not name.endswith("__") and isinstance(target, torch.Tensor):
                root = target._base if target._base is not None else target
                self.step.writes.setdefault(id(root), target is root and name in WHOLE_WRITES)
            return func(*args, **(kwargs or {}))

    for step in steps:
        with Writes(step):
            run_step(step)


class Slots:
    """Where each tensor of a model sits (module, attribute): a tied tensor sits in several."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.places: dict[int, list[tuple[Any, str, str, bool]]] = {}
        self.tensors: dict[int, torch.Tensor] = {}
        for prefix, module in model.named_modules(remove_duplicate=False):
            for kind, table in (("parameter", module._parameters), ("buffer", module._buffers)):
                for name, tensor in table.items():
                    if tensor is not None:
                        qualified = f"{prefix}.{name}" if prefix else name
                        self.places.setdefault(id(tensor), []).append((module, name, qualified, kind == "parameter"))
                        self.tensors[id(tensor)] = tensor

    def name(self, key: int) -> str:
        return self.places[key][0][2]

    def put(self, key: int, tensor: torch.Tensor) -> None:
        import torch

        for module, name, _, is_parameter in self.places[key]:
            if is_parameter:
                module._parameters[name] = (
                    tensor
                    if isinstance(tensor, torch.nn.Parameter)
                    else torch.nn.Parameter(tensor, requires_grad=False)
                )
            else:
                module._buffers[name] = tensor


def untie(model: torch.nn.Module) -> None:
    """Give each tied weight its own (meta) tensor, as it had while `from_config` initialised it:
    the tie comes after, and the copy's initial values are drawn and then dropped."""
    import torch

    for target in getattr(model, "all_tied_weights_keys", None) or {}:
        module_name, _, name = target.rpartition(".")
        module = model.get_submodule(module_name)
        tied = module._parameters.get(name)
        if tied is not None:
            module._parameters[name] = torch.nn.Parameter(
                torch.empty_like(tied, device="meta"), requires_grad=tied.requires_grad
            )


class NamedTensor(NamedTuple):
    name: str
    tensor: torch.Tensor


def seeded_tensors(model: torch.nn.Module, device: torch.device | str, seed: int = 0) -> Iterator[NamedTensor]:
    """(name, value on `device`) of every parameter and buffer of `model`, a causal LM built by `from_config` on
    `meta`, as `from_config` on `device` after `torch.manual_seed(seed)` makes them; tied weights are left out (they
    are their source's). `model` is scratch: it is untied and its tensors stay on `meta`. Each value is yielded once
    final; only the tensors a step is writing (and those a later step reads before overwriting) are alive at a
    time."""
    import torch

    untie(model)
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    steps = build_steps(model)
    record_writes(steps)
    slots = Slots(model)
    last = {key: index for index, step in enumerate(steps) for key in step.writes}
    unwritten = [slots.name(key) for key in slots.tensors if key not in last]
    if unwritten:
        raise BenchtrainError(
            f"cannot initialise {type(model).__name__} one module at a time: nothing initialises {', '.join(unwritten[:3])}"
        )
    torch.manual_seed(seed)
    live: dict[int, torch.Tensor] = {}
    for index, step in enumerate(steps):
        for key in step.writes:
            if key not in live:
                live[key] = torch.empty_like(slots.tensors[key], device=device)
            slots.put(key, live[key])
        run_step(step)
        for key in step.writes:
            slots.put(key, slots.tensors[key])  # back to meta in the scratch model
            if last[key] == index:
                final = live.pop(key)
                if slots.name(key) not in tied:
                    yield NamedTensor(slots.name(key), final.detach())
                del final  # the consumer's, now: not kept while the next one is drawn
            elif not _read_later(steps, index, key):
                del live[key]  # the next step to write it overwrites it whole


def _read_later(steps: list[Step], index: int, key: int) -> bool:
    """Whether the next step that writes tensor `key` after step `index` reads it first."""
    for step in steps[index + 1 :]:
        if key in step.writes:
            return not step.writes[key]
    return False
