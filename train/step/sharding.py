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

Checkpoints and the exported model hold the full state: gathered to rank 0's host memory
(torch.distributed.checkpoint.state_dict) and loaded back by broadcast from rank 0, so a
checkpoint has the same files whatever the sharding, and only rank 0 writes.
"""

from __future__ import annotations

from typing import Any

SHARDING_CHOICES = ("ddp", "fsdp")


def sharding_in_use(requested: str, world_size: int) -> str:
    """What a job of `world_size` processes runs: "none" for one process."""
    if requested not in SHARDING_CHOICES:
        raise ValueError(f"sharding must be one of {SHARDING_CHOICES}, got {requested!r}")
    return "none" if world_size < 2 else requested


def shard_model(model: Any, device: Any, bf16: bool) -> int:
    """Shard `model` in place over every process of the job (FSDP2): each decoder block, then the
    root. On CUDA, blocks compute in bf16 from fp32 shards and reduce gradients in fp32 (accelerate's
    bf16 mixed precision under FSDP). Returns the number of FSDP units."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from train.workload.method import decoder_blocks

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    blocks = decoder_blocks(model)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return len(blocks) + 1


def is_sharded(model: Any) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _plain_optimizer(optimizer: Any) -> Any:
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it


def gather_full_state(model: Any, optimizer: Any | None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The full model (and optimizer) state on rank 0's host memory; empty dicts on the other ranks.
    Every process must call it together (it all-gathers the shards)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    if optimizer is None:
        return weights, None
    return weights, get_optimizer_state_dict(model, _plain_optimizer(optimizer), options=options)


def scatter_full_state(model: Any, optimizer: Any, weights: dict[str, Any], optimizer_state: dict[str, Any]) -> None:
    """Load a full state held by rank 0 (the other ranks pass empty dicts) into the sharded model
    and optimizer: rank 0 broadcasts, every rank keeps its shard. Every process calls it together."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, weights, options=options)
    set_optimizer_state_dict(model, _plain_optimizer(optimizer), optimizer_state, options=options)


def broadcast_from_rank0(value: Any) -> Any:
    """A small Python value (an error message, scheduler state, RNG state) from rank 0 to every
    rank. It travels between this job's own processes, never through a file."""
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def largest_block_parameters(blocks: list[Any]) -> int:
    """Parameters of the largest decoder block: what FSDP all-gathers at once (plus the prefetched next)."""
    return max((sum(parameter.numel() for parameter in block.parameters()) for block in blocks), default=0)
