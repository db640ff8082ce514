"""How the model is spread over the processes of a job: DDP or FSDP (`--sharding`).

- ddp (default): every process holds the whole model; gradients are all-reduced once per optimizer
  step (accelerate's DDP wrapper).
- fsdp: parameters, gradients and optimizer state are sharded over the processes, for full
  fine-tuning of a model that does not fit one device. Each decoder block is a unit, then the
  whole model (embeddings, final norm, head): a block's parameters are all-gathered for its forward
  and again for its backward, and its gradients reduce-scattered, on every micro-step.

FSDP here is PyTorch's FSDP2 `fully_shard`, applied per block and then to the root, which is what
accelerate's FSDP2 plugin does (accelerate/utils/fsdp_utils.py, `fsdp2_prepare_model`). It is
called directly because accelerate turns its FSDP plugin on only for GPU-like distributed types,
not for CPU processes on gloo (accelerate/state.py), and the code the CPU tests run must be the
code the GPUs run. Launch and the process group stay accelerate's (`accelerate launch`, torchrun).

The model is built on `meta` and sharded there, then each rank materialises its shards only
(`materialise_shards`): no rank ever holds the whole fp32 model, which is what the memory check
(train.planning.memory_check, a 1/N share plus gathered blocks) assumes. A preset's weights are
drawn one module at a time (train.workload.meta_init: the values the unsharded build has, bit for
bit), each rank keeping its slice; a folder's weights are read by rank 0 alone, into its host
memory, and broadcast, every rank keeping its shard (torch.distributed.checkpoint's
`set_model_state_dict(..., broadcast_from_rank0=True)`, what accelerate's FSDP2 loading does).

Checkpoints and the exported model hold the full state: gathered to rank 0's host memory
(torch.distributed.checkpoint.state_dict) and loaded back by broadcast from rank 0, so a
checkpoint has the same files whatever the sharding, and only rank 0 writes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from train.workload.meta_init import meta_plain_model, seeded_tensors
from train.workload.method import decoder_blocks, unwrap

if TYPE_CHECKING:
    import torch
    from torch.distributed.checkpoint.state_dict import DictValueType, OptimizerStateType

T = TypeVar("T")

SHARDING_CHOICES = ("ddp", "fsdp")


def sharding_in_use(requested: str, world_size: int) -> str:
    """What a job of `world_size` processes runs: "none" for one process."""
    if requested not in SHARDING_CHOICES:
        raise ValueError(f"sharding must be one of {SHARDING_CHOICES}, got {requested!r}")
    return "none" if world_size < 2 else requested


def shard_model(model: Any, device: Any, bf16: bool, spec: Any = None) -> int:
    """Shard `model` in place over every process of the job (FSDP2): each decoder block, then the
    root. Under bf16 mixed precision, blocks compute in bf16 from fp32 shards and reduce gradients
    in fp32 (accelerate's bf16 mixed precision under FSDP). A model built on `meta` is then
    materialised from `spec` (`materialise_shards`). Returns the number of FSDP units."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    blocks = decoder_blocks(model)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if spec is not None and is_on_meta(model):
        materialise_shards(model, spec, device)
    return len(blocks) + 1


def is_on_meta(model: Any) -> bool:
    return any(parameter.is_meta for parameter in model.parameters())


def materialise_shards(model: Any, spec: Any, device: Any) -> None:
    """Give a model sharded on `meta` its weights on `device`, each rank allocating and filling its
    shards only: the seeded initial values, one module at a time (every rank draws the same ones
    and keeps its slice; no communication), then, for a folder with weights, those read by rank 0
    and broadcast. Tied weights are tied again (`to_empty` gives each module its own tensor)."""
    import torch

    lm = unwrap(model)
    lm.to_empty(device=device)
    lm.tie_weights()
    with torch.no_grad():
        for name, value in seeded_tensors(meta_plain_model(lm.config), device):
            fill_slice(lm.get_parameter_or_buffer(name), value)
            del value  # one full tensor at a time: not this one while the next is drawn
    if spec.has_weights:
        load_from_rank0(lm, spec)


def fill_slice(target: Any, full: Any) -> None:
    """Copy this rank's slice of the full tensor `full` into `target` (a sharded DTensor, or a
    replicated buffer), cut where FSDP cuts (`torch.chunk` along the sharded dimension), without a
    collective and without a copy of the slice."""
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


def load_from_rank0(model: Any, spec: Any) -> None:
    """A folder's weights into the sharded model: rank 0 reads them into its host memory, every
    other rank reads nothing, and each keeps its shard of what rank 0 broadcasts."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoModelForCausalLM

    weights: dict[str, Any] = {}
    if dist.get_rank() == 0:
        full = AutoModelForCausalLM.from_pretrained(str(spec.directory), local_files_only=True, dtype=torch.float32, device_map="cpu")
        weights = full.state_dict()
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


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
    """The full model (and optimizer) state on rank 0's host memory; empty dicts on the other ranks.
    Every process must call it together (it all-gathers the shards)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    if optimizer is None:
        return FullState(weights, None)
    return FullState(weights, get_optimizer_state_dict(model, _plain_optimizer(optimizer), options=options))


def scatter_full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, weights: DictValueType, optimizer_state: OptimizerStateType) -> None:
    """Load a full state held by rank 0 (the other ranks pass empty dicts) into the sharded model
    and optimizer: rank 0 broadcasts, every rank keeps its shard. Every process calls it together."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, weights, options=options)
    set_optimizer_state_dict(model, _plain_optimizer(optimizer), optimizer_state, options=options)


def broadcast_from_rank0(value: T) -> T:
    """A small Python value (an error message, scheduler state, RNG state) from rank 0 to every
    rank. It travels between this job's own processes, never through a file."""
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def largest_block_parameters(blocks: list[torch.nn.Module]) -> int:
    """Parameters of the largest decoder block: what FSDP all-gathers at once (plus the prefetched next)."""
    return max((sum(parameter.numel() for parameter in block.parameters()) for block in blocks), default=0)
