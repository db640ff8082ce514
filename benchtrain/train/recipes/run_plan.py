"""What a run will do: one `RunPlan` (a `FittedVariant` planned), made only by `plan_run`, for a `train` command,
each row of a comparison and `--consider`, so that all plan alike. Why: docs/design.md#what-a-run-will-do-runplan."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING

from benchtrain.calibration.comm import communicator_bytes, describe_communication
from benchtrain.common.console import say
from benchtrain.common.durations import format_duration
from benchtrain.common.json_types import JsonDict
from benchtrain.train.planning.comm import CommPlan, Traffic, plan_communication, traffic_of
from benchtrain.train.planning.disk import export_bytes, upload_bytes
from benchtrain.train.planning.memory_check import describe_needs, meta_model
from benchtrain.train.planning.plan_text import describe_compute, describe_plan
from benchtrain.train.planning.planner import deadline_options, make_plan
from benchtrain.train.planning.types import Candidate, Plan, PlanRequest
from benchtrain.train.recipes.config import TrainConfig
from benchtrain.train.recipes.hub_push import PushTarget, upload_rate
from benchtrain.train.recipes.run_data import LoadedData
from benchtrain.train.running.resume import Continuation
from benchtrain.train.step.hardware import peak_flops
from benchtrain.train.step.hyperparameters import scaled_learning_rate
from benchtrain.train.step.metrics import planned_figures
from benchtrain.train.step.peak_memory import host_excess_bytes
from benchtrain.train.workload.model import ModelSpec, model_shape
from benchtrain.train.workload.tokenizer import is_byte_tokenizer

if TYPE_CHECKING:
    from benchtrain.calibration.hardware import Hardware
    from benchtrain.calibration.model import Calibration
    from benchtrain.train.planning.memory_check import MemoryNeed
    from benchtrain.train.step.engine import StepSetup
    from benchtrain.train.workload.batching import DataView
    from benchtrain.train.workload.method import MethodConfig

# What a comparison's predicted row prices the traffic with (train.recipes.machines.plan_row).
Communicate = Callable[[Traffic], CommPlan]


@dataclass(frozen=True)
class PlanContext:
    """What every plan of one command shares, whichever calibration or variant it is for."""

    config: TrainConfig
    spec: ModelSpec
    data: DataView
    eval_data: DataView | None
    elapsed_seconds: float
    data_prep_seconds: float = 0.0
    data_uncertainty: float = 0.0
    # What the command continues (train.running.resume.what_to_continue): a resumed run's epochs, configuration, steps done.
    continuation: Continuation = field(default_factory=Continuation)


@dataclass(frozen=True)
class FittedVariant:
    """A calibration variant and its method on the device the plan is for (this machine's, or in a dry run the
    calibration's, so that a user plans the GPU they will rent), checked before any data is read (choice.fit_variant)."""

    cal: Calibration  # at the variant trained (cal.variant)
    method: MethodConfig
    hardware: (
        Hardware  # the device the plan is for (this machine's, train.step.hardware.this_device, or the calibration's)
    )
    foreign: bool  # a dry run for the calibration's device, not this machine's
    step: StepSetup  # the loss, compiled or not, the processes and their sharding
    need: MemoryNeed
    price_per_hour: float | None
    warnings: tuple[str, ...]  # what --force let through

    @property
    def device_type(self) -> str:
        return self.hardware.device_type


@dataclass(frozen=True)
class RunPlan:
    """A fitted variant planned: the variant, what communication adds (`communication`), and the planner's plan (which
    refers to the request it answered)."""

    fitted: FittedVariant
    communication: JsonDict
    plan: Plan

    def to_json(self, compute: JsonDict) -> JsonDict:
        """A dry run's plan as `--json` prints it (also each row of a comparison, train.recipes.machines)."""
        cal, hardware, step = self.fitted.cal, self.fitted.hardware, self.fitted.step
        return {
            "calibration_id": cal.id,
            "calibration_path": str(cal.path) if cal.path else None,
            "device": hardware.name,
            "device_type": hardware.device_type,
            "memory_bytes": hardware.memory_bytes,
            "world_size": step.world_size,
            "sharding": step.sharding,
            "plan": self.plan.to_json(),
            "bound_parts": asdict(cal.bound_parts),  # the plan's bound: the fit's part and the machine's
            "communication": self.communication,
            "compute": compute,
        }


def plan_run(fitted: FittedVariant, context: PlanContext, communicate: Communicate | None = None) -> RunPlan:
    """A fitted variant planned: what communication adds (measured among the calibration's processes, or
    `communicate(traffic)` where a comparison predicts it, none of it hidden), the request, and the planner's plan."""
    traffic = traffic_of(fitted.step.sharding, fitted.need, fitted.device_type)
    comm = (
        plan_communication(fitted.cal, fitted.step.world_size, traffic, context.config.force)
        if communicate is None
        else communicate(traffic)
    )
    request = plan_request(context, fitted, comm, communicate is not None)
    return RunPlan(fitted, comm.record, make_plan(fitted.cal, context.data, request, context.eval_data))


def plan_exact(run: RunPlan, elapsed_seconds: float, data: DataView, eval_data: DataView | None) -> Plan:
    """A plan made from a sample, planned again on the exact tokens: its configuration (a resume's, else the one chosen)
    kept, the time spent so far counted, and no tokenizing left to plan for."""
    request = replace(
        run.plan.request,
        configuration=run.plan.request.configuration or run.plan.chosen.config,
        elapsed_seconds=elapsed_seconds,
        data_prep_seconds=0.0,
        data_uncertainty=0.0,
    )
    return make_plan(run.fitted.cal, data, request, eval_data)


def plan_trainer(
    calibration: Calibration, data: DataView, request: PlanRequest, eval_data: DataView | None, traffic: Traffic
) -> Plan:
    """A user's own Trainer planned (benchtrain.trainer.fit) as a train command is: what its processes' collectives
    add beyond the calibration's step times (`traffic`, priced as plan_run prices it), then the planner."""
    comm = plan_communication(calibration, request.world_size, traffic, force=False)
    priced = replace(request, comm_seconds_per_step=comm.per_step, comm_seconds_per_micro_step=comm.per_micro_step)
    return make_plan(calibration, data, priced, eval_data)


def plan_request(context: PlanContext, fitted: FittedVariant, comm: CommPlan, comm_overlap: bool) -> PlanRequest:
    """What the planner is asked for this command and fitted variant; `comm`: what communication adds that the
    calibration's step times lack; `comm_overlap`: whether it may hide behind backward (the planner brackets it)."""
    config, spec, resumed = context.config, context.spec, context.continuation.run
    cal, method, need, step = fitted.cal, fitted.method, fitted.need, fitted.step
    device_type = fitted.device_type
    # A 1-process calibration's probes held the whole model; an FSDP process holds its shard.
    memory_offset, gradient_shards = 0.0, 1
    if cal.world_size == 1 and step.sharding == "fsdp":
        memory_offset = need.per_process_bytes(step.sharding, step.world_size, device_type) - need.total_bytes
        gradient_shards = step.world_size
    # A 1-process calibration measured no NCCL communicator: each GPU of N holds its buffers (and
    # NVLS memory on an NVSwitch) besides; an N-process calibration measured them in its peak.
    if cal.world_size == 1:
        memory_offset += communicator_bytes(fitted.hardware, step.world_size)
    # On CPU this process's own libraries and data beyond the bench process's, measured now (its data loaded, its model not yet built).
    memory_offset += host_excess_bytes(cal.hardware.record, device_type)
    merge = bool(config.output.merge_lora and method.is_lora)
    # --push-to-hub: the bytes uploaded at the bandwidth the last push measured, else a stated default.
    upload_seconds = (
        upload_bytes(need, method.is_lora, merge, device_type) / upload_rate()[0] if config.output.push_to_hub else 0.0
    )
    return PlanRequest(
        data_prep_seconds=context.data_prep_seconds,
        data_uncertainty=context.data_uncertainty,
        epochs=resumed.epochs if resumed else config.plan.epochs,
        deadline=config.run_deadline,
        elapsed_seconds=context.elapsed_seconds,
        priority=config.plan.priority,
        effective_batch=config.plan.effective_batch,
        max_length=resumed.configuration.seq_len if resumed else config.plan.max_length,
        world_size=step.world_size,
        num_workers=config.plan.workers,
        checkpoint_interval_seconds=config.guard.checkpoint_interval_seconds,
        price_per_hour=fitted.price_per_hour,
        max_steps=config.plan.max_steps,
        fit_deadline=config.plan.fit_deadline,
        seed=config.seed,
        max_positions=spec.max_positions,
        completed_steps=context.continuation.completed,
        configuration=resumed.configuration if resumed else None,
        switches=config.plan.switches,
        eval_schedule=config.data.eval_schedule if context.eval_data is not None else None,
        with_report=not config.output.no_report,
        compiled=step.compiled,
        comm_seconds_per_step=comm.per_step,
        comm_seconds_per_micro_step=comm.per_micro_step,
        comm_overlap=comm_overlap,
        memory_offset_bytes=memory_offset,
        gradient_shards=gradient_shards,
        export_bytes=export_bytes(need, method.is_lora, not spec.has_weights, merge, device_type),
        upload_seconds=upload_seconds,
    )


def planned_compute(spec: ModelSpec, run: FittedVariant, chosen: Candidate) -> JsonDict:
    """The plan's predicted TFLOP/s and MFU on the plan's device, at its recorded peak FLOP/s, else its datasheet's."""
    hardware = run.hardware
    peak = hardware.peak_bf16_flops or (peak_flops(hardware.name) or (None, None))[1]
    if not peak or not chosen.step_seconds:
        return {"mfu": None}
    shape = model_shape(meta_model(spec, run.method))
    flops = shape.flops_per_token(chosen.config.seq_len, lora=run.method.is_lora, switches=chosen.config.switches)
    return planned_figures(chosen.padded_tokens, chosen.step_seconds, chosen.world_size, flops, peak)


def learning_rate_record(config: TrainConfig, plan: Plan) -> JsonDict:
    """The learning rate this run uses, and how it was scaled from --learning-rate."""
    effective = plan.chosen.config.micro_batch_size * plan.chosen.world_size * plan.chosen.config.grad_accum
    return {
        "learning_rate": scaled_learning_rate(
            config.tuning.learning_rate, config.tuning.lr_scaling, config.tuning.base_batch, effective
        ),
        "base_learning_rate": config.tuning.learning_rate,
        "lr_scaling": config.tuning.lr_scaling,
        "base_batch": config.tuning.base_batch or effective,
    }


def deadline_message(plan: Plan, resumed: bool) -> str:
    what = "the steps left need" if resumed else "the plan needs"
    return (
        f"{what} up to {format_duration(plan.chosen.total_seconds_promised)} but only "
        f"{format_duration(max(0.0, plan.available_seconds))} are left before the deadline; options: {deadline_options(plan, resumed)}"
    )


def print_plan(run: RunPlan, context: PlanContext, loaded: LoadedData) -> None:
    """The plan as the console shows it (rank 0)."""
    plan, fitted, spec, resumed = run.plan, run.fitted, context.spec, context.continuation.run
    rate = learning_rate_record(context.config, plan)
    if resumed:
        total = resumed.total_steps
        stop = (
            f", stopping at step {plan.step_limit or plan.chosen.optimizer_steps:,}"
            if (plan.step_limit or plan.chosen.optimizer_steps) < total
            else ""
        )
        left = f"planning the {plan.chosen.remaining_steps:,} steps left"
        if context.continuation.steps_done:
            done = ", ".join(context.continuation.phases_done) or "none"
            left = f"every step ran; doing what came after them from its last checkpoint (already done: {done})"
        print(
            f"resuming from step {context.continuation.completed:,} of {total:,} with the run's configuration and learning-rate schedule{stop}: "
            f"{left}",
            flush=True,
        )
    notes = tuple(loaded.prepared.describe())
    print(
        "\n".join(describe_plan(plan, loaded.profile, fitted.cal, is_byte_tokenizer(loaded.tokenizer), notes)),
        flush=True,
    )
    compute = describe_compute(planned_compute(spec, fitted, plan.chosen), fitted.hardware)
    if compute:
        print(compute, flush=True)
    communication_line = describe_communication(run.communication)
    if communication_line:
        print(f"  {communication_line}", flush=True)
    if rate["lr_scaling"] != "none":
        print(
            f"  learning rate {rate['learning_rate']:.3g}: {rate['lr_scaling']} scaling of {rate['base_learning_rate']:.3g} "
            f"from base batch {rate['base_batch']} to this plan's effective batch",
            flush=True,
        )
    needs = describe_needs(
        spec, fitted.method, fitted.hardware, fitted.step.sharding, fitted.step.world_size, fitted.foreign
    )
    print(
        f"  training {fitted.method.describe()}: {fitted.need.trainable_parameters:,} of {fitted.need.total_parameters:,} parameters trainable; {needs}",
        flush=True,
    )
    for warning in plan.warnings:
        say(f"warning: {warning}")


def push_note(target: PushTarget, run: FittedVariant, merge: bool) -> str:
    """The plan's line on the push (`merge`: final-merged/ pushed too): what, where, how long and at what bandwidth."""
    size = upload_bytes(run.need, run.method.is_lora, merge, run.device_type)
    rate, source = upload_rate()
    details = [*([f"branch {target.revision}"] if target.revision else []), *(["private"] if target.private else [])]
    where = target.repo_id + (f" ({', '.join(details)})" if details else "")
    return f"--push-to-hub {where}: ≈{size / 1e6:,.0f} MB at {rate / 1e6:,.0f} MB/s, {source}"
