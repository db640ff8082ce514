"""The loss without full-vocabulary logits (train/loss.py): the same loss and gradients as
transformers' own, and less memory."""

from __future__ import annotations

import copy

import pytest
import torch

from train.loss import choose_loss, chunk_tokens, chunked_cross_entropy, install_loss
from train.method import MethodConfig
from train.model import ModelSpec, build_model, resolve_model


def _batch(vocab: int, rows: int = 3, length: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (rows, length), generator=generator)
    labels = ids.clone()
    labels[0, : min(12, length - 1)] = -100  # a prompt without loss
    labels[-1, -2:] = -100  # padding
    return ids, labels


def _loss_and_grads(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
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
    reference = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 50), labels[:, 1:].reshape(-1), ignore_index=-100)
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


def test_chunks_make_logits_about_the_size_of_the_hidden_states() -> None:
    assert chunk_tokens(16384, 2048, 128256) == 16384 // 63 + 1  # Llama-3: 63 chunks
    assert chunk_tokens(10, 4096, 1000) == 10  # a small vocabulary: one chunk


def _peak_rss(model: torch.nn.Module, ids: torch.Tensor) -> int:
    from train.peak_memory import PeakMemory

    with PeakMemory(torch.device("cpu")) as memory:
        model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)
    return memory.peak_bytes


def test_chunked_loss_needs_less_memory_than_full_logits() -> None:
    """A 32k vocabulary at 4 × 512 tokens: the plain loss holds 260 MB of fp32 logits (and their
    softmax for backward); the chunked loss only one chunk at a time."""
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
    with pytest.raises(ValueError, match="needs CUDA"):
        choose_loss("liger", "cpu", "llama")
    with pytest.raises(ValueError, match="--loss plain"):
        choose_loss("chunked", "cpu", "gpt_neox")


def test_generation_without_labels_uses_the_models_own_forward() -> None:
    model = build_model(resolve_model("tiny"), "cpu")
    install_loss(model, "chunked")
    ids, _ = _batch(model.config.vocab_size, rows=1, length=8)
    out = model(input_ids=ids)
    assert out.logits.shape == (1, 8, model.config.vocab_size)
