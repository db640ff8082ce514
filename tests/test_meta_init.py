"""Models that never exist whole (issue #39, faults 5 and 9): a preset's initial weights drawn one
module at a time (train.workload.meta_init), a 4-bit base quantized from them without a temporary
checkpoint, and FSDP built on `meta`, each rank materialising its shards only, in bf16 mixed
precision as two ranks (this file is also the rank's script: `python -m torch.distributed.run
--nproc_per_node 2 tests/test_meta_init.py fsdp FOLDER`; the test forks the ranks from
tests/forkserver.py with the variables torchrun sets).

Memory is measured by a spy, not by RSS: `LiveFloat32` follows every fp32 CPU storage made while
it is on (a dispatch mode sees each op's outputs) and keeps the peak of the bytes alive at once."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import loaded_bytes
from torch.utils._python_dispatch import TorchDispatchMode

TIED: dict[str, Any] = {  # llama-shaped, the head tied to the embedding (as llama-3.2-1b's and gpt2's are)
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}
SEVERAL_LAYERS: dict[str, Any] = {
    **TIED,
    "vocab_size": 256,
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_hidden_layers": 6,
    "tie_word_embeddings": False,
}


class LiveFloat32(TorchDispatchMode):
    """The most bytes of fp32 CPU storage alive at once among the storages made while it is on."""

    def __init__(self) -> None:
        super().__init__()
        from torch.multiprocessing.reductions import StorageWeakRef

        self.weak = StorageWeakRef
        self.alive: dict[int, tuple[Any, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.distributed.tensor import DTensor
        from torch.utils._pytree import tree_leaves

        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            tensor = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu" and tensor.dtype == torch.float32:
                storage = tensor.untyped_storage()
                if storage.nbytes() and storage.data_ptr() not in self.alive:
                    self.alive[storage.data_ptr()] = (self.weak(storage), storage.nbytes())
        self.alive = {key: (ref, size) for key, (ref, size) in self.alive.items() if not ref.expired()}
        self.peak = max(self.peak, sum(size for _, size in self.alive.values()))
        return out


def spec_of(name: str, config: dict[str, Any]) -> Any:
    from benchtrain.train.workload.model import ModelSpec

    return ModelSpec(name, dict(config))


def seeded_reference(config: dict[str, Any], dtype: Any = torch.float32) -> Any:
    """What every unsharded, unquantized build of a preset is: from_config after manual_seed(0)."""
    from transformers import AutoModelForCausalLM

    from benchtrain.train.workload.model import make_config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(
        make_config(spec_of("reference", config)), attn_implementation="sdpa", dtype=dtype
    )


GPT2: dict[str, Any] = {
    "model_type": "gpt2",
    "vocab_size": 300,
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 128,
    "bos_token_id": 0,
    "eos_token_id": 0,
}


@pytest.mark.parametrize(
    "config", [TIED, GPT2, {**SEVERAL_LAYERS, "model_type": "qwen2"}], ids=["llama-tied", "gpt2", "qwen2"]
)
def test_weights_drawn_module_by_module_are_from_config_s(config: dict[str, Any]) -> None:
    """Bit for bit, buffers included: constructors' inits, each sub-model's pass, gpt2's blocks
    re-drawing their projections, and a tied head (its own draw dropped)."""
    from benchtrain.train.workload.meta_init import meta_plain_model, seeded_tensors
    from benchtrain.train.workload.model import make_config

    reference = seeded_reference(config, torch.bfloat16)
    expected = {**dict(reference.named_parameters()), **dict(reference.named_buffers())}
    drawn = dict(seeded_tensors(meta_plain_model(make_config(spec_of("x", config)), torch.bfloat16), "cpu"))
    assert drawn.keys() == expected.keys()
    assert all(torch.equal(drawn[name], tensor) for name, tensor in expected.items())


def test_a_preset_s_4bit_base_is_quantized_without_a_checkpoint_or_its_whole_fp32_model(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The bench path used to write the random model to a temporary folder and load it back
    quantized (16 GB of disk and host memory per rank for an 8B model). Now nothing is written,
    host memory holds one layer at a time beside the fp32 embeddings, and the base is the one
    quantizing that folder would give, with the bytes the plan counts; and it trains."""
    import tempfile

    from transformers import AutoModelForCausalLM, PreTrainedModel

    from benchtrain.train.planning.memory_check import memory_need
    from benchtrain.train.workload.method import MethodConfig, apply_method
    from benchtrain.train.workload.model import make_config
    from benchtrain.train.workload.quantize import quantized_base

    spec = spec_of("several-layers", SEVERAL_LAYERS)
    reference_folder = tmp_path / "seeded"
    seeded_reference(SEVERAL_LAYERS).save_pretrained(reference_folder)
    reference = quantized_base(reference_folder, "cpu", "4bit", torch.float32)

    written: list[str] = []

    def refuse(what: str) -> Any:
        def record(*args: Any, **kwargs: Any) -> Any:
            written.append(what)
            raise AssertionError(f"{what} while quantizing a preset")

        return record

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", refuse("save_pretrained"))
    monkeypatch.setattr(tempfile, "TemporaryDirectory", refuse("TemporaryDirectory"))
    monkeypatch.setattr(tempfile, "mkdtemp", refuse("mkdtemp"))
    with LiveFloat32() as spy:
        model = quantized_base(make_config(spec), "cpu", "4bit", torch.float32)
    assert written == []

    plain = seeded_reference(SEVERAL_LAYERS)
    layer = sum(parameter.numel() for parameter in plain.model.layers[0].parameters()) * 4
    embeddings = (
        plain.model.embed_tokens.weight.numel() + plain.lm_head.weight.numel() + plain.model.norm.weight.numel()
    ) * 4
    whole = sum(parameter.numel() for parameter in plain.parameters()) * 4
    assert spy.peak <= layer + embeddings < whole / 2, (spy.peak, layer, embeddings, whole)

    assert model.state_dict().keys() == reference.state_dict().keys()
    assert all(torch.equal(tensor, reference.state_dict()[name]) for name, tensor in model.state_dict().items())
    assert loaded_bytes(model) == memory_need(
        spec, MethodConfig(method="lora", quantize="4bit"), "cpu"
    ).weights_bytes - _adapter_bytes(spec)
    assert type(model.model.layers[0].mlp.down_proj).__name__ == "Linear4bit" and model.is_loaded_in_4bit

    lora = apply_method(model, MethodConfig(method="lora", quantize="4bit"))
    tokens = torch.randint(0, SEVERAL_LAYERS["vocab_size"], (2, 16))
    lora(input_ids=tokens, labels=tokens).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in lora.named_parameters() if "lora_B" in n)
    assert isinstance(AutoModelForCausalLM, type)


def _adapter_bytes(spec: Any) -> int:
    from benchtrain.train.planning.memory_check import trainable_sizes
    from benchtrain.train.workload.method import MethodConfig

    return 4 * sum(trainable_sizes(spec, MethodConfig(method="lora", quantize="4bit")))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fsdp_builds_on_meta_and_each_rank_holds_its_shards_in_bf16_mixed_precision(
    tmp_path: Path, fork_server
) -> None:
    """Two gloo processes (forked with torchrun's variables: tests/forkserver.py), bf16 mixed precision (FSDP's MixedPrecisionPolicy
    param_dtype=bfloat16, reduce_dtype=float32): a preset with a tied head and a folder with
    weights. No rank ever holds the whole fp32 model while building (the old build made all of it
    on every rank, then sharded); what a rank holds is its half, as the memory check counts; the
    weights are the unsharded build's (the folder's, read by rank 0 and broadcast); the head stays
    tied; blocks compute in bf16 and the step trains."""
    folder = tmp_path / "weights"
    torch.manual_seed(1)
    from transformers import AutoModelForCausalLM

    from benchtrain.train.workload.model import make_config

    AutoModelForCausalLM.from_config(make_config(spec_of("folder", SEVERAL_LAYERS))).save_pretrained(folder)
    ranks = fork_server.group_report(Path(__file__), ["fsdp", str(folder)], timeout=200)
    assert sorted(rank["rank"] for rank in ranks) == [0, 1]
    for rank in ranks:
        for built in (rank["preset"], rank["folder"]):
            assert built["held"] <= built["whole"] / 2 + built["uneven"]  # its half, as the check counts
            assert built["compute_dtype"] == "torch.bfloat16" and built["losses_finite"]
        preset = rank["preset"]
        # Never the whole model: its shards and one module's tensors drawn whole at a time, within
        # what the memory check gives a process.
        assert preset["peak"] <= preset["held"] + preset["largest_module"] + preset["buffers"] < preset["whole"], preset
        assert preset["peak"] <= preset["check_per_process"], preset
        assert preset["tied"]
    rank0, rank1 = sorted(ranks, key=lambda rank: rank["rank"])
    assert rank0["preset"]["same_weights"] and rank0["folder"]["same_weights"]
    # The folder is read by rank 0 alone (into host memory); rank 1 only ever holds its shards
    # and the tensor being broadcast.
    assert rank1["folder"]["peak"] < rank1["folder"]["whole"], rank1["folder"]


# The torchrun worker --------------------------------------------------------------------------


def build_and_train(spec: Any, expected: Any) -> dict[str, Any]:
    """Build `spec` under FSDP in bf16 (the spy on), then compare, check and train two steps."""
    import torch.distributed as dist
    from accelerate import Accelerator

    from benchtrain.train.planning.memory_check import memory_need
    from benchtrain.train.step.engine import StepOptions, engine_from_options
    from benchtrain.train.step.sharding import gather_full_state
    from benchtrain.train.workload.batching import SyntheticBatches
    from benchtrain.train.workload.method import MethodConfig, unwrap

    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    with LiveFloat32() as spy:
        engine = engine_from_options(
            spec, MethodConfig(), accelerator, StepOptions(compile="off", loss="plain", sharding="fsdp")
        )
    lm = unwrap(engine.model)
    need = memory_need(spec, MethodConfig(), "cpu")
    held = sum(parameter.to_local().numel() * 4 for parameter in lm.parameters())
    weights, _ = gather_full_state(engine.model, None)
    same = dist.get_rank() != 0 or all(
        torch.equal(weights[name], tensor) for name, tensor in expected.state_dict().items()
    )
    seen: list[str] = []
    block = lm.model.layers[0].mlp.down_proj
    handle = block.register_forward_pre_hook(lambda module, args: seen.append(str(module.weight.dtype)))
    batches = iter(SyntheticBatches(2, 2, 16, spec.config_dict["vocab_size"]))
    losses = [engine.step.run(batches, 1).loss for _ in range(2)]
    handle.remove()
    return {
        "peak": spy.peak,
        "whole": need.weights_bytes,
        "held": held,
        "uneven": 4 * sum(parameter.numel() // parameter.shape[0] for parameter in lm.parameters()),  # a row per tensor
        "check_per_process": need.per_process_bytes("fsdp", 2, "cpu"),
        "buffers": 4 * sum(buffer.numel() for buffer in expected.buffers()),
        "largest_module": 4
        * max(sum(p.numel() for p in module.parameters(recurse=False)) for module in expected.modules()),
        "same_weights": bool(same),
        "tied": lm.get_output_embeddings().weight is lm.get_input_embeddings().weight,
        "compute_dtype": seen[0],
        "losses_finite": all(torch.isfinite(torch.tensor(loss)) for loss in losses),
    }


def fsdp_worker(folder: str) -> None:
    from transformers import AutoModelForCausalLM

    from benchtrain.train.step.runtime import finish_together, leave
    from benchtrain.train.workload.model import resolve_model

    preset = build_and_train(spec_of("tied", TIED), seeded_reference(TIED))
    saved = resolve_model(folder)
    loaded = build_and_train(saved, AutoModelForCausalLM.from_pretrained(folder))
    import torch.distributed as dist

    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, {"rank": dist.get_rank(), "preset": preset, "folder": loaded})
    if dist.get_rank() == 0:
        print(json.dumps(ranks), flush=True)
    finish_together()
    leave(0)


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "fsdp":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    fsdp_worker(sys.argv[2])
