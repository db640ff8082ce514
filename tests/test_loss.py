"""The loss without full-vocabulary logits (train/step/loss.py): the same loss and gradients as
transformers' own, and less memory."""

from __future__ import annotations

import copy
import math
import sys

import pytest
import torch

from benchtrain.common.errors import BenchtrainError
from benchtrain.train.step.loss import choose_loss, chunk_tokens, chunked_cross_entropy, install_loss
from benchtrain.train.workload.method import MethodConfig
from benchtrain.train.workload.model import ModelSpec, build_model, resolve_model


def _batch(vocab: int, rows: int = 3, length: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (rows, length), generator=generator)
    labels = ids.clone()
    labels[0, : min(12, length - 1)] = -100  # a prompt without loss
    labels[-1, -2:] = -100  # padding
    return ids, labels


def _loss_and_grads(
    model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor
) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return float(loss.detach()), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("method", ["full", "lora"])
def test_chunked_loss_equals_the_plain_loss_and_its_gradients(method: str) -> None:
    plain = build_model(resolve_model("tiny"), "cpu", MethodConfig(method=method))
    chunked = copy.deepcopy(plain)
    assert install_loss(chunked, "chunked") == "chunked"
    ids, labels = _batch(plain.config.vocab_size)
    plain_loss, plain_grads = _loss_and_grads(plain, ids, labels)
    chunked_loss, chunked_grads = _loss_and_grads(chunked, ids, labels)
    assert chunked_loss == pytest.approx(plain_loss, rel=1e-6)
    assert plain_grads.keys() == chunked_grads.keys() and plain_grads
    for name, grad in plain_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    if method == "lora":
        assert not any("lm_head" in name for name in chunked_grads)  # the frozen head gets no gradient


def test_chunked_loss_matches_for_any_chunk_size_and_without_gradients() -> None:
    torch.manual_seed(0)
    hidden = torch.randn(2, 9, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    labels = torch.randint(0, 50, (2, 9))
    labels[0, 3] = -100
    logits = hidden @ weight.t()
    reference = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, 50), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    reference.backward()
    expected = hidden.grad.clone(), weight.grad.clone()
    for chunk in (1, 5, 100):
        hidden.grad = weight.grad = None
        loss = chunked_cross_entropy(hidden, weight, labels, chunk)
        loss.backward()
        assert float(loss) == pytest.approx(float(reference), rel=1e-6)
        torch.testing.assert_close(hidden.grad, expected[0])
        torch.testing.assert_close(weight.grad, expected[1])
    with torch.no_grad():  # evaluation: the loss only
        assert float(chunked_cross_entropy(hidden, weight, labels)) == pytest.approx(float(reference), rel=1e-6)


def test_chunks_bound_the_logits_bytes_not_the_token_count() -> None:
    """Each chunk's fp32 logits fit the byte budget, with as few chunks as that allows: gpt2's
    512 tokens are one chunk (Liger's rule made 64 chunks of 8 rows, each re-reading the head)."""
    assert chunk_tokens(512, 50257) == 512
    budget = 256 * 2**20
    rows = chunk_tokens(16384, 128256, budget)  # Llama-3 at 8 × 2048
    assert rows * 128256 * 4 <= budget and (rows + 1) * 128256 * 4 * 2 > budget  # not needlessly small
    assert rows >= 512 and math.ceil(16384 / rows) == 32
    assert chunk_tokens(1000, 1000, budget_bytes=4000 * 100) == 100  # 100 rows of 1000 fp32 logits
    assert chunk_tokens(10, 10**9, budget_bytes=1) == 1  # never less than one row


def _peak_rss(model: torch.nn.Module, ids: torch.Tensor) -> int:
    from benchtrain.train.step.peak_memory import PeakMemory

    with PeakMemory(torch.device("cpu")) as memory:
        model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)
    return memory.peak_bytes


def test_chunked_loss_needs_less_memory_than_full_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 32k vocabulary at 4 × 512 tokens: the plain loss holds 260 MB of fp32 logits (and their
    softmax for backward); the chunked loss only one chunk at a time (a 32 MiB budget here, so that
    a small test shows what the 256 MiB default does at Llama-3's scale)."""
    monkeypatch.setattr("benchtrain.train.step.loss.LOGITS_CHUNK_BYTES", 32 * 2**20)
    config = {
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
    }
    plain = build_model(ModelSpec("wide-vocab", config), "cpu")
    chunked = copy.deepcopy(plain)
    install_loss(chunked, "chunked")
    ids = torch.randint(0, 32000, (4, 512), generator=torch.Generator().manual_seed(0))
    _peak_rss(chunked, ids[:1, :16])  # allocator and kernels warm for both
    plain_peak = _peak_rss(plain, ids)
    chunked_peak = _peak_rss(chunked, ids)
    logits_bytes = 4 * 512 * 32000 * 4
    assert plain_peak - chunked_peak > logits_bytes, (plain_peak, chunked_peak)


def test_loss_choice_by_device_and_architecture() -> None:
    assert choose_loss("auto", "cpu", "llama") == "chunked"
    assert choose_loss("auto", "cpu", "gpt_neox") == "plain"  # its head is not known to be plain
    assert choose_loss("plain", "cpu", "llama") == "plain"
    with pytest.raises(BenchtrainError, match="needs CUDA"):
        choose_loss("liger", "cpu", "llama")
    with pytest.raises(BenchtrainError, match="--loss plain"):
        choose_loss("chunked", "cpu", "gpt_neox")


def test_generation_without_labels_uses_the_models_own_forward() -> None:
    model = build_model(resolve_model("tiny"), "cpu")
    install_loss(model, "chunked")
    ids, _ = _batch(model.config.vocab_size, rows=1, length=8)
    out = model(input_ids=ids)
    assert out.logits.shape == (1, 8, model.config.vocab_size)


LIGER_LOSSES_MADE: list[dict] = []


class _FakeLigerLoss(torch.nn.Module):
    """Stands in for LigerFusedLinearCrossEntropyLoss on CPU: the same loss; records its options."""

    def __init__(self, **options: object) -> None:
        super().__init__()
        LIGER_LOSSES_MADE.append(options)

    def forward(self, weight: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(rows @ weight.t(), targets, ignore_index=-100)


def _fake_liger(monkeypatch: pytest.MonkeyPatch, version: str = "0.8.5", importable: bool = True) -> list[dict]:
    """A liger-kernel `version` in sys.modules whose apply_liger_kernel_to_llama does what Liger's
    does (monkey_patch.py): replaces transformers' module-level RoPE, RMSNorm and MLP, then patches
    the instance's modules. Returns the calls to apply."""
    import importlib.machinery
    import importlib.metadata
    import types

    from transformers.models.llama import modeling_llama

    from benchtrain.train.step.loss import liger_problem

    calls: list[dict] = []

    def apply_liger_kernel_to_llama(
        rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True, model=None
    ):
        calls.append({"rope": rope, "rms_norm": rms_norm, "swiglu": swiglu})
        if rope:
            modeling_llama.apply_rotary_pos_emb = lambda *args, **kwargs: "liger rope"
        if rms_norm:
            modeling_llama.LlamaRMSNorm = type("LigerRMSNorm", (torch.nn.Module,), {})
            model.model.norm.forward = lambda hidden: hidden  # the instance's own module
        if swiglu:
            modeling_llama.LlamaMLP = type("LigerSwiGLUMLP", (torch.nn.Module,), {})

    modules = {}
    for name in ("liger_kernel", "liger_kernel.transformers", "liger_kernel.transformers.fused_linear_cross_entropy"):
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        modules[name] = module
    modules["liger_kernel.transformers"].apply_liger_kernel_to_llama = apply_liger_kernel_to_llama
    if importable:
        modules[
            "liger_kernel.transformers.fused_linear_cross_entropy"
        ].LigerFusedLinearCrossEntropyLoss = _FakeLigerLoss
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    real_version = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata, "version", lambda package: version if package == "liger-kernel" else real_version(package)
    )
    liger_problem.cache_clear()
    LIGER_LOSSES_MADE.clear()
    return calls


@pytest.fixture()
def clear_liger_cache():
    from benchtrain.train.step.loss import liger_problem

    yield
    liger_problem.cache_clear()


@pytest.mark.usefixtures("clear_liger_cache")
@pytest.mark.parametrize(
    ("version", "importable", "fragment"),
    [("0.6.4", True, "liger-kernel>=0.7.0"), ("0.8.5", False, "does not import"), ("0.8.5", True, None)],
)
def test_auto_picks_liger_only_where_it_imports_with_transformers_5(
    monkeypatch: pytest.MonkeyPatch, version: str, importable: bool, fragment: str | None
) -> None:
    from benchtrain.train.step.loss import liger_problem

    _fake_liger(monkeypatch, version, importable)
    problem = liger_problem()
    if fragment is None:
        assert problem is None and choose_loss("auto", "cuda", "llama") == "liger"
        return
    assert fragment in problem
    assert choose_loss("auto", "cuda", "llama") == "chunked"  # not a Liger that fails in every probe
    with pytest.raises(BenchtrainError, match=fragment.replace(".", r"\.")):
        choose_loss("liger", "cuda", "llama")


@pytest.mark.usefixtures("clear_liger_cache")
def test_liger_patches_stay_on_their_model_and_sum_the_head_gradient_in_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.models.llama import modeling_llama

    calls = _fake_liger(monkeypatch)
    module_level = {
        name: getattr(modeling_llama, name) for name in ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP")
    }
    model = build_model(resolve_model("tiny"), "cpu")
    install_loss(model, "liger", compiled=False)
    assert calls == [{"rope": False, "rms_norm": True, "swiglu": True}]  # RoPE is module-level only in Liger
    assert {name: getattr(modeling_llama, name) for name in module_level} == module_level  # a later model is untouched
    later = build_model(resolve_model("tiny"), "cpu")
    assert type(later.model.norm) is module_level["LlamaRMSNorm"] and "forward" not in vars(later.model.norm)
    assert "forward" in vars(model.model.norm)  # this model keeps its kernels
    ids, labels = _batch(model.config.vocab_size)
    model(input_ids=ids, labels=labels).loss.backward()
    assert LIGER_LOSSES_MADE == [{"ignore_index": -100, "accum_dtype": torch.float32}]


def test_the_liger_functions_we_call_import_with_this_transformers() -> None:
    """Where liger-kernel is installed (the `gpu` extra): it imports with our transformers, has a
    patch for each architecture it covers, and its patches stay on the model."""
    from benchtrain.train.step.loss import apply_liger_kernels, liger_functions, liger_problem

    pytest.importorskip("liger_kernel")
    assert liger_problem() is None
    loss_class, liger = liger_functions()
    assert callable(loss_class)
    for model_type in ("llama", "mistral", "qwen2", "qwen3", "phi3"):
        assert callable(getattr(liger, f"apply_liger_kernel_to_{model_type}"))
    from transformers.models.llama import modeling_llama

    before = modeling_llama.LlamaRMSNorm
    model = build_model(resolve_model("tiny"), "cpu")
    assert apply_liger_kernels(model) and modeling_llama.LlamaRMSNorm is before
