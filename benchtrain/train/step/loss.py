"""The training loss without full-vocabulary logits: `chunked` (plain torch) or `liger`, installed in
the model instance's own forward. Design: docs/design.md#training-loss"""

from __future__ import annotations

import functools
import importlib
import math
import types
from importlib import metadata
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeAlias

from packaging.version import Version

from benchtrain.common.errors import BenchtrainError
from benchtrain.train.workload.batching import IGNORE_INDEX
from benchtrain.train.workload.method import unwrap

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel
    from transformers.modeling_outputs import CausalLMOutputWithPast

LOSS_CHOICES = ("auto", "chunked", "liger", "plain")
# Output heads that are a plain linear layer over the decoder's last hidden state (no logit
# soft-capping or scaling), so the loss can be computed from hidden states and the head's weight.
PLAIN_HEAD_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "phi3")

LIGER_MIN_VERSION = "0.7.0"


def liger_functions() -> tuple[type[torch.nn.Module], ModuleType]:
    """Liger's fused linear cross-entropy module and its package (`apply_liger_kernel_to_<type>`)."""
    import liger_kernel.transformers as liger
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

    return LigerFusedLinearCrossEntropyLoss, liger


@functools.lru_cache(maxsize=1)
def liger_problem() -> str | None:
    """Why Liger cannot run here (not installed, too old, does not import), or None. A Liger that
    fails to import must not be what `--loss auto` picks: every probe would fail."""
    try:
        installed = metadata.version("liger-kernel")
    except metadata.PackageNotFoundError:
        return "liger-kernel is not installed (pip install 'benchtrain[gpu]')"
    if Version(installed) < Version(LIGER_MIN_VERSION):
        return f"liger-kernel {installed} predates transformers 5; install liger-kernel>={LIGER_MIN_VERSION} (pip install 'benchtrain[gpu]')"
    try:
        liger_functions()
    except ImportError as error:
        return f"liger-kernel {installed} does not import here ({str(error).splitlines()[0][:120]})"
    return None


def choose_loss(choice: str, device_type: str, model_type: str | None) -> str:
    """The loss implementation for `--loss choice` (checked by StepOptions) on this device and architecture."""
    fusable = model_type in PLAIN_HEAD_MODEL_TYPES
    if choice == "auto":
        if not fusable:
            return "plain"
        return "liger" if device_type == "cuda" and liger_problem() is None else "chunked"
    if choice != "plain" and not fusable:
        raise BenchtrainError(
            f"--loss {choice} supports {', '.join(PLAIN_HEAD_MODEL_TYPES)}, not {model_type}; use --loss plain"
        )
    if choice == "liger" and device_type != "cuda":
        raise BenchtrainError("--loss liger needs CUDA and liger-kernel (pip install 'benchtrain[gpu]')")
    if choice == "liger" and liger_problem() is not None:
        raise BenchtrainError(f"--loss liger: {liger_problem()}")
    return choice


# A chunk's fp32 logits stay under this many bytes (why this size: docs/design.md#training-loss).
LOGITS_CHUNK_BYTES = 256 * 2**20
FP32_LOGIT_BYTES = 4


def chunk_tokens(tokens: int, vocab_size: int, budget_bytes: int | None = None) -> int:
    """Tokens per chunk: as few chunks as keep each one's fp32 logits within `budget_bytes`, evenly."""
    budget = LOGITS_CHUNK_BYTES if budget_bytes is None else budget_bytes
    rows_within_budget = max(1, budget // (vocab_size * FP32_LOGIT_BYTES))
    chunks = max(1, math.ceil(tokens / rows_within_budget))
    return max(1, math.ceil(tokens / chunks))


def _chunked_loss_and_gradients(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int, weight_grad: bool, grads: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Mean cross-entropy of `hidden @ weight.T` against `targets` and (with `grads`) its gradients,
    a chunk of rows at a time: matmuls in `hidden`'s dtype, softmax and sums in fp32."""
    import torch

    count = (targets != IGNORE_INDEX).sum().clamp(min=1)
    compute = weight.to(hidden.dtype)
    loss = torch.zeros((), device=hidden.device, dtype=torch.float32)
    grad_hidden = torch.empty_like(hidden) if grads else None
    weight_grad = weight_grad and grads
    grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if weight_grad else None
    for start in range(0, hidden.shape[0], chunk):
        rows = hidden[start : start + chunk]
        target = targets[start : start + chunk]
        logits = (rows @ compute.t()).float()
        keep = target != IGNORE_INDEX
        safe_target = torch.where(keep, target, 0)
        log_norm = torch.logsumexp(logits, dim=-1)
        picked = logits.gather(1, safe_target[:, None]).squeeze(1)
        loss += ((log_norm - picked) * keep).sum()
        if not grads:
            continue
        # d loss / d logits = (softmax − one-hot) / count on kept rows, 0 elsewhere: in place.
        grad_logits = logits.sub_(log_norm[:, None]).exp_()
        grad_logits[torch.arange(len(target), device=target.device), safe_target] -= 1.0
        grad_logits.mul_((keep / count)[:, None])
        grad_logits = grad_logits.to(hidden.dtype)
        assert grad_hidden is not None  # made whenever grads are
        grad_hidden[start : start + chunk] = grad_logits @ compute
        if grad_weight is not None:
            # Accumulated in fp32 whatever the matmul dtype.
            if rows.dtype == torch.float32:
                grad_weight.addmm_(grad_logits.t(), rows)
            else:
                grad_weight += (grad_logits.t() @ rows).float()
    return loss / count, grad_hidden, grad_weight


@functools.cache
def _chunked_function() -> type[torch.autograd.Function]:
    import torch

    class ChunkedLinearCrossEntropy(torch.autograd.Function):
        @staticmethod
        def forward(
            ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int
        ) -> torch.Tensor:
            loss, grad_hidden, grad_weight = _chunked_loss_and_gradients(
                hidden, weight, targets, chunk, weight.requires_grad
            )
            ctx.save_for_backward(grad_hidden, grad_weight if grad_weight is not None else torch.empty(0))
            ctx.weight_dtype = weight.dtype
            ctx.has_weight_grad = grad_weight is not None
            return loss

        @staticmethod
        def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, None, None]:
            grad_hidden, grad_weight = ctx.saved_tensors
            scale = grad_output.to(grad_hidden.dtype)
            weight_out = (grad_weight * grad_output).to(ctx.weight_dtype) if ctx.has_weight_grad else None
            return grad_hidden * scale, weight_out, None, None

    return ChunkedLinearCrossEntropy


def _rows_and_targets(hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states as (tokens, hidden) rows and the label each predicts (position t: labels[t + 1]),
    cast to the autocast dtype inside autocast (both losses run outside it)."""
    import torch
    import torch.nn.functional as F

    targets = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:].reshape(-1)
    flat = hidden.reshape(-1, hidden.shape[-1])
    if torch.is_autocast_enabled(flat.device.type):
        flat = flat.to(torch.get_autocast_dtype(flat.device.type))
    return flat, targets


def chunked_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int | None = None
) -> torch.Tensor:
    """Causal-LM loss from the last hidden states (batch, length, hidden) and the head's weight (vocab, hidden)."""
    import torch

    flat, targets = _rows_and_targets(hidden, labels)
    size = chunk or chunk_tokens(flat.shape[0], weight.shape[0])
    with torch.autocast(flat.device.type, enabled=False):
        if not (torch.is_grad_enabled() and (flat.requires_grad or weight.requires_grad)):
            # evaluation
            return _chunked_loss_and_gradients(flat, weight, targets, size, weight_grad=False, grads=False)[0]
        return _chunked_function().apply(flat, weight, targets, size)


def liger_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Liger's fused linear cross-entropy, the head's gradient summed in fp32 (`accum_dtype`; its default is the weight's dtype)."""
    import torch

    loss_class, _ = liger_functions()
    flat, targets = _rows_and_targets(hidden, labels)
    return loss_class(ignore_index=IGNORE_INDEX, accum_dtype=torch.float32)(weight.to(flat.dtype), flat, targets)


def apply_liger_kernels(lm: PreTrainedModel) -> bool:
    """Liger's RMSNorm and SwiGLU on this model's own modules only (transformers' modeling module is
    put back), recorded for `remove_liger_kernels`; False where Liger has none for it."""
    _, liger = liger_functions()
    apply = getattr(liger, f"apply_liger_kernel_to_{lm.config.model_type}", None)
    if apply is None:
        return False
    modeling = importlib.import_module(type(lm).__module__)
    before = dict(vars(modeling))
    instance_before = _module_states(lm)
    try:
        apply(rope=False, cross_entropy=False, fused_linear_cross_entropy=False, rms_norm=True, swiglu=True, model=lm)
    finally:
        for name in set(vars(modeling)) - set(before):
            delattr(modeling, name)
        for name, value in before.items():
            if vars(modeling).get(name) is not value:
                setattr(modeling, name, value)
        changes = _changes_since(instance_before)
        vars(lm).setdefault(LIGER_CHANGES, []).extend(changes)
    return True


# Where the instance keeps what Liger changed on it (apply_liger_kernels), to be undone.
LIGER_CHANGES = "_benchtrain_liger_changes"
_ABSENT = object()  # an attribute the module did not have

# A module with its class, its own attributes and its children, as they were (_module_states).
ModuleState: TypeAlias = "tuple[torch.nn.Module, type, dict[str, object], dict[str, object]]"
# (module, what, name, before, after): one thing Liger changed on a module (_changes_since).
ModuleChange: TypeAlias = "tuple[torch.nn.Module, str, str, object, object]"


def _module_states(lm: torch.nn.Module) -> list[ModuleState]:
    """Each module of `lm` with its class, its own attributes and its children (shallow copies)."""
    return [(module, type(module), dict(vars(module)), dict(module._modules)) for module in lm.modules()]


def _changes_since(
    states: list[ModuleState],
) -> list[ModuleChange]:
    """(module, what, name, before, after) for every class, attribute and child that changed since `states`."""
    changes: list[ModuleChange] = []
    for module, cls, attributes, children in states:
        if type(module) is not cls:
            changes.append((module, "class", "__class__", cls, type(module)))
        now = vars(module)
        for name in (set(attributes) | set(now)) - {"_modules"}:
            if attributes.get(name, _ABSENT) is not now.get(name, _ABSENT):
                changes.append((module, "attribute", name, attributes.get(name, _ABSENT), now.get(name, _ABSENT)))
        for name in set(children) | set(module._modules):
            if children.get(name, _ABSENT) is not module._modules.get(name, _ABSENT):
                changes.append((module, "child", name, children.get(name, _ABSENT), module._modules.get(name, _ABSENT)))
    return changes


def remove_liger_kernels(lm: torch.nn.Module) -> None:
    """Put back what `apply_liger_kernels` changed on `lm`, where it still holds what Liger put
    there (a later change, such as gradient checkpointing's flags, stays)."""
    for module, what, name, before, after in reversed(vars(lm).pop(LIGER_CHANGES, [])):
        if what == "class":
            if type(module) is after:
                module.__class__ = before
            continue
        place = module._modules if what == "child" else vars(module)
        if place.get(name, _ABSENT) is not after:
            continue
        if before is _ABSENT:
            del place[name]
        else:
            place[name] = before


def _loss_forward(
    self: Any,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    **kwargs: object,
) -> CausalLMOutputWithPast:
    """The causal LM's forward once a loss is installed; it reads the loss in use (`_benchtrain_loss`) at every call."""
    original = self._benchtrain_original_forward
    kind = self._benchtrain_loss
    if kind == "plain" or labels is None or kwargs.get("return_dict") is False:
        return original(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    loss_of = liger_cross_entropy if kind == "liger" else chunked_cross_entropy
    decoder = getattr(self, self.base_model_prefix)
    kwargs.pop("use_cache", None)
    outputs = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs)
    loss = loss_of(outputs.last_hidden_state, self.get_output_embeddings().weight, labels)
    return CausalLMOutputWithPast(loss=loss, logits=None)


def _forward_chain(forward: object) -> list[object]:
    """The functions inside `forward`: accelerate's wrappers keep theirs as `__wrapped__`."""
    chain: list[object] = []
    function = getattr(forward, "__func__", forward)
    while function is not None and len(chain) < 32:
        chain.append(function)
        function = getattr(function, "__wrapped__", None)
    return chain


def _put_loss_forward(lm: Any) -> None:
    """Make `_loss_forward` the function the instance's forward ends in, once. Where accelerate's `prepare` came first (it kept the forward it wrapped as
    `_original_forward`), its precision wrapper is built again around `_loss_forward` with accelerate's own functions."""
    if any(function is _loss_forward for function in _forward_chain(lm.forward)):
        return  # installed before: a loss switch changes `_benchtrain_loss` alone
    prepared = vars(lm).get("_original_forward")
    lm._benchtrain_original_forward = prepared if prepared is not None else lm.forward
    lm.forward = types.MethodType(_loss_forward, lm)
    if prepared is not None:
        from accelerate.utils import convert_outputs_to_fp32, get_mixed_precision_context_manager

        lm._original_forward = lm.forward
        autocast = get_mixed_precision_context_manager(native_amp=True)
        lm.forward = types.MethodType(convert_outputs_to_fp32(autocast(_loss_forward)), lm)


def install_loss(model: torch.nn.Module, kind: str, compiled: bool = False) -> str:
    """Make `model`'s forward compute the loss with `kind` when given labels; returns `kind`. May be called
    again, before or after accelerate's `prepare`: Liger's kernels are on the model only while the loss is `liger`."""
    if kind not in LOSS_CHOICES or kind == "auto":
        raise ValueError(f"install_loss takes a chosen loss (chunked, liger, plain), got {kind!r}")
    lm = unwrap(model)
    _put_loss_forward(lm)
    remove_liger_kernels(lm)
    setattr(lm, "_benchtrain_loss", kind)  # noqa: B010  # our own mark, unknown to torch's types
    if kind == "liger" and not compiled:
        apply_liger_kernels(lm)
    return kind
