"""Switching the loss on one model (bench compares the losses): the forward keeps accelerate's bf16
autocast wrapper whatever the loss and whenever it was installed (issue #39, fault 1), and Liger's
instance patches leave with the liger loss (fault 11). bf16 autocast runs on CPU, as on a GPU."""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from benchtrain.train.step.loss import install_loss
from benchtrain.train.workload.method import set_gradient_checkpointing
from benchtrain.train.workload.model import build_model, resolve_model


class _FakeLigerLoss(torch.nn.Module):
    """LigerFusedLinearCrossEntropyLoss's call on CPU: the same mean cross-entropy."""

    def __init__(self, **options: object) -> None:
        super().__init__()

    def forward(self, weight: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy((rows @ weight.t()).float(), targets, ignore_index=-100)


class _LigerRMSNorm(torch.nn.Module):
    """Not the model's RMSNorm: scales by 2, so a patched model computes another loss."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return 2.0 * hidden

    def extra_repr(self) -> str:
        return "liger"


class _LigerSwiGLU(torch.nn.Module):
    gate_proj: torch.nn.Module
    down_proj: torch.nn.Module

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(hidden)))  # no up_proj


def _bind(module: torch.nn.Module, name: str, function: Any) -> None:
    # As Liger's monkey_patch._bind_method_to_module: a method bound into the instance's __dict__.
    module.__dict__[name] = function.__get__(module, type(module))


def apply_liger_kernel_to_llama(
    rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True, model=None
):
    """What Liger's apply_liger_kernel_to_llama(model=…) does to an instance (monkey_patch.py's
    _patch_rms_norm_module and _patch_swiglu_module: attributes set, forward/extra_repr/_get_name
    bound), plus what other patchers do: a module's class swapped, a child module replaced."""
    base = model.model
    norms = [
        base.norm,
        *(norm for layer in base.layers for norm in (layer.input_layernorm, layer.post_attention_layernorm)),
    ]
    for norm in norms if rms_norm else []:
        norm.offset, norm.casting_mode, norm.in_place, norm.row_mode, norm.impl, norm.mode = (
            0.0,
            "llama",
            True,
            None,
            None,
            None,
        )
        _bind(norm, "forward", _LigerRMSNorm.forward)
        _bind(norm, "extra_repr", _LigerRMSNorm.extra_repr)
        _bind(norm, "_get_name", lambda self: "LigerRMSNorm")
    if swiglu:
        for layer in base.layers[1:]:
            _bind(layer.mlp, "forward", _LigerSwiGLU.forward)
            _bind(layer.mlp, "_get_name", lambda self: "LigerSwiGLUMLP")
        first = base.layers[0]
        replacement = _LigerSwiGLU()
        replacement.gate_proj, replacement.down_proj = first.mlp.gate_proj, first.mlp.down_proj
        first.mlp = replacement
    base.rotary_emb.__class__ = type("LigerRotary", (type(base.rotary_emb),), {})


@pytest.fixture()
def fake_liger(monkeypatch: pytest.MonkeyPatch) -> None:
    liger = types.SimpleNamespace(apply_liger_kernel_to_llama=apply_liger_kernel_to_llama)
    monkeypatch.setattr("benchtrain.train.step.loss.liger_functions", lambda: (_FakeLigerLoss, liger))


def _instance_state(model: torch.nn.Module) -> dict[str, tuple[type, dict[str, Any], dict[str, Any]]]:
    return {name: (type(module), dict(vars(module)), dict(module._modules)) for name, module in model.named_modules()}


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(3))
    return ids, ids.clone()


def _loss(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> float:
    with torch.no_grad():
        return float(model(input_ids=ids, labels=labels).loss)


@pytest.mark.usefixtures("fake_liger")
@pytest.mark.parametrize("then", ["chunked", "plain"])
def test_switching_away_from_liger_restores_the_models_own_modules(then: str) -> None:
    model = build_model(resolve_model("tiny"), "cpu")
    ids, labels = _batch(model.config.vocab_size)
    install_loss(model, then)
    before_state, before_loss = _instance_state(model), _loss(model, ids, labels)
    install_loss(model, "liger", compiled=False)
    assert type(model.model.rotary_emb).__name__ == "LigerRotary" and "forward" in vars(model.model.norm)
    assert _loss(model, ids, labels) != pytest.approx(before_loss, rel=1e-3)  # the kernels are live
    install_loss(model, then)
    after = _instance_state(model)
    assert after.keys() == before_state.keys()
    for name, (cls, attributes, children) in before_state.items():
        assert after[name][0] is cls, name
        assert after[name][1].keys() == attributes.keys(), name
        assert all(
            after[name][1][key] is value for key, value in attributes.items() if key not in ("_modules", "training")
        ), name
        assert after[name][2] == children, name
    assert _loss(model, ids, labels) == before_loss
    # Liger again, then away again: nothing piles up.
    install_loss(model, "liger", compiled=False)
    install_loss(model, then)
    assert {name: (state[0], state[1].keys()) for name, state in _instance_state(model).items()} == {
        name: (state[0], state[1].keys()) for name, state in before_state.items()
    }


@pytest.mark.usefixtures("fake_liger")
def test_checkpointing_turned_on_under_liger_survives_the_switch() -> None:
    model = build_model(resolve_model("tiny"), "cpu")
    install_loss(model, "liger", compiled=False)
    set_gradient_checkpointing(model, True)
    install_loss(model, "chunked")
    assert "forward" not in vars(model.model.norm)
    assert all(getattr(layer, "gradient_checkpointing", False) for layer in model.model.layers)


@pytest.fixture()
def bf16_accelerator(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Accelerate's bf16 autocast on CPU, the GPU's precision path. Accelerate keeps one precision
    per process: its state is reset before, and after for the tests that follow."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()
    yield Accelerator(mixed_precision="bf16", cpu=True)
    AcceleratorState._reset_state()


def _linear_calls(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> set[tuple[bool, torch.dtype]]:
    """(autocast on, output dtype) of every nn.Linear call in one forward and backward."""
    calls: set[tuple[bool, torch.dtype]] = set()

    def record(module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> None:
        if isinstance(module, torch.nn.Linear):
            calls.add((torch.is_autocast_enabled("cpu"), output.dtype))

    handle = torch.nn.modules.module.register_module_forward_hook(record)
    try:
        output = model(input_ids=ids, labels=labels)
        assert output.loss.dtype == torch.float32  # accelerate's convert_outputs_to_fp32
        output.loss.backward()
    finally:
        handle.remove()
    return calls


@pytest.mark.usefixtures("fake_liger")
@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("installed", ["before prepare", "after prepare"])
def test_every_loss_runs_under_accelerates_autocast_after_any_switch(
    bf16_accelerator: Any, installed: str, method: str
) -> None:
    from benchtrain.train.workload.method import MethodConfig

    model = build_model(resolve_model("tiny"), "cpu", MethodConfig(method=method))
    if installed == "before prepare":
        install_loss(model, "plain")
    model = bf16_accelerator.prepare(model)
    ids, labels = _batch(model.config.vocab_size)
    seen = {}
    for kind in ("chunked", "plain", "liger", "chunked", "liger", "plain"):
        install_loss(model, kind, compiled=False)
        seen[kind] = _linear_calls(model, ids, labels)
        assert seen[kind] == {(True, torch.bfloat16)}, (kind, seen[kind])
