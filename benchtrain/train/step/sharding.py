"""How the model is spread over the processes of a job: DDP or FSDP2 (`--sharding`), materialised
shard by shard, and the full state gathered for checkpoints. Design: docs/design.md#sharding-ddp-and-fsdp"""

from __future__ import annotations

import itertools
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from benchtrain.common.errors import BenchtrainError
from benchtrain.train.step.runtime import wait_for_all
from benchtrain.train.workload.meta_init import meta_plain_model, seeded_tensors
from benchtrain.train.workload.method import decoder_blocks, unwrap

if TYPE_CHECKING:
    import torch
    from torch.distributed.checkpoint.state_dict import DictValueType, OptimizerStateType

    from benchtrain.train.workload.model import ModelSpec

T = TypeVar("T")

SHARDING_CHOICES = ("ddp", "fsdp")


def shard_model(model: torch.nn.Module, device: torch.device, bf16: bool, spec: ModelSpec | None = None) -> None:
    """Shard `model` in place over the job's processes (FSDP2): each decoder block, then the root. Under bf16, blocks compute in bf16 from fp32 shards and
    reduce gradients in fp32. A model on `meta` is then materialised from `spec`; a 4-bit base is checked by measurement and refused in one line if wrong."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    )
    blocks = decoder_blocks(model)
    before = (
        quantized_check(model)
        if any(type(parameter).__name__ == "Params4bit" for parameter in model.parameters())
        else None
    )
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if spec is not None and any(parameter.is_meta for parameter in model.parameters()):
        materialise_shards(model, spec, device)
    if before is not None:
        fault = broadcast_from_rank0(quantized_sharding_fault(before, model, dist.get_world_size(), policy.param_dtype))
        if fault:
            raise BenchtrainError(
                f"--sharding fsdp with --quantize 4bit: {fault}; use --sharding ddp (each process holds the 4-bit base)"
            )


SHARDABLE_QUANTIZE = ("4bit",)  # bitsandbytes' 4-bit weights stored in a float dtype; LLM.int8's are int8


def check_quantized_sharding(kind: str) -> None:
    """One line for a bitsandbytes base FSDP cannot shard (8-bit: int8 weights and row scales)."""
    if kind not in SHARDABLE_QUANTIZE:
        raise BenchtrainError(
            f"--sharding fsdp with --quantize {kind}: an 8-bit base cannot be sharded (int8 weights); use --quantize 4bit, or --sharding ddp"
        )


# A 4-bit base under FSDP is checked by measurement, not assumed (docs/design.md#sharding-ddp-and-fsdp).
QUANTIZED_OUTPUT_TOLERANCE = 1e-3  # of the largest logit: the gathered weights are the same bytes, so equal is expected
QUANTIZED_SHARE_SLACK = 1.1  # a rank's share of the base against 1/N of it: uneven rows and unsharded statistics


class QuantizedCheck(NamedTuple):
    """A 4-bit base's logits on fixed tokens and the bytes of its frozen tensors, on one rank."""

    logits: torch.Tensor
    base_bytes: int
    storage: torch.dtype | None  # the dtype the packed 4-bit values are stored in (None once FSDP replaced them)


def quantized_check(model: Any) -> QuantizedCheck:
    import torch
    from torch.distributed.tensor import DTensor

    # The bytes first: after a forward FSDP leaves the root's parameters gathered until the backward.
    frozen = (
        parameter.to_local() if isinstance(parameter, DTensor) else parameter
        for parameter in model.parameters()
        if not parameter.requires_grad
    )
    base_bytes = sum(tensor.numel() * tensor.element_size() for tensor in frozen)
    vocab = unwrap(model).config.vocab_size
    tokens = torch.randint(0, vocab, (1, 8), generator=torch.Generator().manual_seed(0)).to(
        next(model.parameters()).device
    )
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.float().cpu()
    if is_sharded(model):
        model.reshard()  # the root's gathered parameters freed again
    storage = next(
        (parameter.dtype for parameter in model.parameters() if type(parameter).__name__ == "Params4bit"), None
    )
    return QuantizedCheck(logits, base_bytes, storage)


def quantized_sharding_fault(
    before: QuantizedCheck, model: torch.nn.Module, world_size: int, compute_dtype: torch.dtype | None = None
) -> str | None:
    """Why a 4-bit base sharded by FSDP must not train (None: it computes what it did whole, and
    each rank holds its share). `compute_dtype`: FSDP's gathered dtype. Every rank calls it together."""
    cast = None
    if compute_dtype is not None and compute_dtype != before.storage:
        cast = f"FSDP's mixed precision casts the packed 4-bit values, stored as {before.storage}, to {compute_dtype}"
    try:
        after = quantized_check(model)
    except (RuntimeError, AttributeError, TypeError, ValueError) as error:
        return f"it fails after sharding ({type(error).__name__}: {str(error).splitlines()[0][:120]}){f': {cast}' if cast else ''}"
    scale = max(1.0, float(before.logits.abs().max()))
    difference = float((after.logits - before.logits).abs().max())
    if not difference <= QUANTIZED_OUTPUT_TOLERANCE * scale:
        wrong = cast or "bitsandbytes' Linear4bit computes wrong values under FSDP2 here"
        return f"its outputs change after sharding (largest difference {difference:.3g} of logits up to {scale:.3g}): {wrong}"
    if after.base_bytes > QUANTIZED_SHARE_SLACK * before.base_bytes / world_size:
        return f"it is not sharded (each rank keeps {after.base_bytes / 2**20:.1f} MiB of the {before.base_bytes / 2**20:.1f} MiB base, not 1/{world_size})"
    return None


def materialise_shards(model: torch.nn.Module, spec: ModelSpec, device: torch.device) -> None:
    """Give a model sharded on `meta` its weights on `device`, each rank filling only its shards: the
    seeded initial values, then a folder's weights from rank 0. `to_empty` unties weights: they are tied again."""
    import torch

    lm = unwrap(model)
    lm.to_empty(device=device)
    lm.tie_weights()
    placed = base_names(lm)
    with torch.no_grad():
        for name, value in seeded_tensors(meta_plain_model(lm.config), device):
            fill_slice(lm.get_parameter_or_buffer(placed.get(name, name)), value)
            del value  # one full tensor at a time: not this one while the next is drawn
        seed_adapters(lm)
    if spec.has_weights:
        load_from_rank0(lm, spec)


def base_names(lm: torch.nn.Module) -> dict[str, str]:
    """The plain model's name of each tensor peft moved under a LoRA layer's `base_layer`
    (`…q_proj.weight` → `…q_proj.base_layer.weight`); empty for a model without adapters."""
    names = (name for name, _ in (*lm.named_parameters(), *lm.named_buffers()))
    return {name.replace(".base_layer.", "."): name for name in names if ".base_layer." in name}


def seed_adapters(lm: Any) -> None:
    """Give LoRA's sharded adapters the values an unsharded build draws right after the base, in
    peft's order; every rank draws the same and keeps its slice, with no collective."""
    import torch

    for module in lm.modules():
        adapters = getattr(module, "lora_A", None)
        if not isinstance(adapters, torch.nn.ModuleDict):
            continue
        for key in adapters:
            down: Any = adapters[key]  # nn.Linear layers: their sizes are ints, not what Module's typing says
            up: Any = module.lora_B[key]
            first = torch.nn.Linear(down.in_features, down.out_features, bias=down.bias is not None)
            second = torch.nn.Linear(up.in_features, up.out_features, bias=up.bias is not None)
            torch.nn.init.kaiming_uniform_(first.weight, a=math.sqrt(5))
            torch.nn.init.zeros_(second.weight)
            if second.bias is not None:
                torch.nn.init.zeros_(second.bias)
            for target, source in ((down, first), (up, second)):
                for name, value in source.named_parameters():
                    fill_slice(getattr(target, name), value.detach())


def fill_slice(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's slice of `full` into `target` (a sharded DTensor, or a replicated buffer), cut where FSDP cuts, without a collective."""
    import torch
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    if not isinstance(target, DTensor):
        target.copy_(full)
        return
    placements, mesh = target.placements, target.device_mesh
    if len(placements) == 1 and isinstance(placements[0], Shard):
        pieces = torch.chunk(full, mesh.size(), dim=placements[0].dim)
        rank = mesh.get_local_rank()
        local = pieces[rank] if rank < len(pieces) else full.narrow(placements[0].dim, 0, 0)
    else:  # another layout: DTensor's own cut (a copy)
        local = distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()
    target.to_local().copy_(local)


# While rank 0 reads a folder's weights the others wait on the store, and give up after the weights'
# bytes at LOAD_READ_RATE plus LOAD_SLACK_SECONDS (docs/design.md#sharding-ddp-and-fsdp).
LOAD_READ_RATE = 50e6  # bytes/s: an assumed slow network volume, not a measurement
LOAD_SLACK_SECONDS = 600.0
_LOAD_KEYS = (f"benchtrain/fsdp-load/{index}" for index in itertools.count())  # the same sequence on every rank


def load_from_rank0(model: torch.nn.Module, spec: Any) -> None:
    """A folder's weights into the sharded model: rank 0 reads them to host memory in their own
    dtype while the others wait on the job's store, then each keeps its shard of rank 0's broadcast."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.distributed_c10d import _get_default_store
    from transformers import AutoModelForCausalLM

    key, store, world_size = next(_LOAD_KEYS), _get_default_store(), dist.get_world_size()
    weights: DictValueType = {}
    if dist.get_rank() == 0:
        try:
            full = AutoModelForCausalLM.from_pretrained(
                str(spec.directory), local_files_only=True, dtype="auto", device_map="cpu"
            )
            placed = base_names(model)  # LoRA: the base's tensors sit under `base_layer`
            weights = {placed.get(name, name): tensor for name, tensor in full.state_dict().items()}
        finally:  # counted in even when reading failed: the others then fail in the broadcast, not wait here
            store.add(key, 1)
    else:
        give_up_at = time.monotonic() + weight_bytes(spec.directory) / LOAD_READ_RATE + LOAD_SLACK_SECONDS
        wait_for_all(store, key, world_size, give_up_at)  # every rank counted in: rank 0 has read the weights
    # LoRA's adapters are not in the folder: they keep their seeded values (strict off for them).
    set_model_state_dict(
        model,
        weights,
        options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True, strict=not has_frozen_parameters(model)
        ),
    )


def weight_bytes(folder: Path) -> int:
    """The bytes of a folder's weight files (safetensors or PyTorch's)."""
    return sum(path.stat().st_size for pattern in ("*.safetensors", "*.bin") for path in folder.glob(pattern))


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _plain_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it


class FullState(NamedTuple):
    """A sharded run's whole state on rank 0's host (empty dicts on the other ranks)."""

    weights: dict[str, Any]
    optimizer_state: dict[str, Any] | None  # None: not asked for


def gather_full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> FullState:
    """The full model (and optimizer) state in rank 0's host memory; empty on the others. Every
    process calls it together. A frozen base (LoRA) is left out: only the adapters are gathered."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    weights = get_model_state_dict(model, options=options)
    if has_frozen_parameters(model):  # only the trainable tensors: the buffers are rebuilt, like the base
        trainable = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
        weights = {name: tensor for name, tensor in weights.items() if name in trainable}
    if optimizer is None:
        return FullState(weights, None)
    return FullState(weights, get_optimizer_state_dict(model, _plain_optimizer(optimizer), options=options))


def has_frozen_parameters(model: torch.nn.Module) -> bool:
    """Whether some parameters are frozen (LoRA's base) and others trained."""
    flags = {parameter.requires_grad for parameter in model.parameters()}
    return flags == {True, False}


def scatter_full_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    weights: DictValueType,
    optimizer_state: OptimizerStateType,
) -> None:
    """Load a full state held by rank 0 (the others pass empty dicts) into the sharded model and
    optimizer, every process together; LoRA's frozen base keeps what it was built with."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=not has_frozen_parameters(model))
    set_model_state_dict(model, weights, options=options)
    set_optimizer_state_dict(model, _plain_optimizer(optimizer), optimizer_state, options=options)


def broadcast_from_rank0(value: T) -> T:
    """A small Python value (an error message, scheduler or RNG state) from rank 0 to every rank."""
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def largest_block_parameters(blocks: list[torch.nn.Module]) -> int:
    """Parameters of the largest decoder block: what FSDP all-gathers at once (plus the prefetched next)."""
    return max((sum(parameter.numel() for parameter in block.parameters()) for block in blocks), default=0)
