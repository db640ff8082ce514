"""Where DDP's gradients live, run as two ranks (torchrun, or tests/forkserver.py's ranks, as tests/test_memory_reserved.py runs it):

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/ddp_gradient_checks.py

Rank 0 prints one JSON line: at every optimizer step of a probe-like sequence (the probe's first
step with no collective in it, then accumulating steps, then a recovery after a failed probe and
its first step again), the gradient bytes the process holds, in units of one fp32 copy of the
trainable parameters. DDP allocates its all-reduce buckets (one copy) when it wraps the model;
with `gradient_as_bucket_view` the gradients should be views into them, and nothing more is held.
"""

from __future__ import annotations

from typing import Any


def gradient_copies(model: Any, parameters: list[Any]) -> dict[str, float]:
    """Gradient bytes held, in copies of the trainable parameters: DDP's buckets (always allocated,
    one copy) plus every gradient that is not a view into them (allocated by autograd outside the
    buckets). A gradient in a bucket is a view of the bucket's flat tensor, sharing its storage."""
    one_copy = sum(p.numel() * p.element_size() for p in parameters)
    buckets = sum(b.buffer().numel() * b.buffer().element_size() for b in model.reducer._get_zeros_like_grad_buckets())
    storages: dict[int, int] = {}
    for p in parameters:
        if p.grad is not None:
            storages.setdefault(p.grad.untyped_storage().data_ptr(), 0)
            storages[p.grad.untyped_storage().data_ptr()] += 1
    outside = sum(
        p.grad.numel() * p.grad.element_size()
        for p in parameters
        if p.grad is not None and p.grad._base is None and storages[p.grad.untyped_storage().data_ptr()] == 1
    )
    return {
        "buckets": buckets / one_copy,
        "outside_buckets": outside / one_copy,
        "held": (buckets + outside) / one_copy,
    }


def ddp_gradient_storage() -> dict[str, Any]:
    import torch

    from benchtrain.bench.probe import Workload, first_step_agreed, recover_after_failure
    from benchtrain.train.step.engine import StepOptions
    from benchtrain.train.workload.batching import SyntheticBatches
    from benchtrain.train.workload.model import resolve_model

    torch.manual_seed(0)
    workload = Workload(resolve_model("tiny"), options=StepOptions(compile="off", loss="plain"))
    model = workload.engine.model
    assert isinstance(model, torch.nn.parallel.DistributedDataParallel), type(model)
    parameters = [p for p in model.parameters() if p.requires_grad]
    step_held: list[float] = []  # the most held at any moment of the current step
    seen: list[float] = []
    optimizer_step = workload.engine.optimizer.step

    def measure(*_: Any) -> None:
        step_held.append(gradient_copies(model, parameters)["held"])

    def measured_step(*args: Any, **kwargs: Any) -> Any:
        # Every micro-step's forward begins with the gradients of the micro-steps before it; the
        # optimizer step holds all of them (and, the first time, creates AdamW's state).
        measure()
        seen.append(max(step_held))
        step_held.clear()
        return optimizer_step(*args, **kwargs)

    model.module.register_forward_pre_hook(measure)
    workload.engine.optimizer.step = measured_step  # type: ignore[method-assign]
    batches = iter(SyntheticBatches(64, 2, 16, workload.vocab_size))
    labels = []
    first_step_agreed(workload, batches, 2)  # the probe's first step: no collective in it
    labels.append("first step, no sync, accum 2")
    for accum in (2, 1, 2):
        workload.engine.step.run(batches, accum)
        labels.append(f"accum {accum}")
    recover_after_failure(workload)  # what a failed probe leaves for the next one
    first_step_agreed(workload, batches, 2)
    labels.append("first step after a failed probe")
    workload.engine.step.run(batches, 2)
    labels.append("accum 2 after it")
    return {"steps": dict(zip(labels, seen, strict=True)), "processes": workload.accelerator.num_processes}


def main() -> None:
    from distributed_checks import report_and_leave

    report_and_leave(ddp_gradient_storage())


if __name__ == "__main__":
    main()
