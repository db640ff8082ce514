"""The plan of a setup (train.recipes.chosen_setup decided its device, processes, step and price):
what the processes' communication adds, the data, and the planner's request from them. Shared by
a `train` command (train.recipes.recipe) and a comparison of calibrations (train.recipes.compare),
so that both plan alike."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from calibration.nccl_memory import communicator_bytes
from calibration.run_file import ResumedRun
from common.console import say
from common.errors import BenchtrainError
from common.json_types import JsonDict
from train.planning.comm import Traffic, plan_communication, traffic_of
from train.planning.disk import export_bytes, upload_bytes
from train.planning.memory_check import MemoryNeed, meta_model
from train.planning.planner import make_plan
from train.planning.types import Candidate, Plan, PlanRequest
from train.recipes.config import DataSection, TrainConfig
from train.recipes.hub_push import upload_rate
from train.step.evaluation import split_eval
from train.step.hardware import peak_flops
from train.step.metrics import planned_figures
from train.step.peak_memory import host_excess_bytes
from train.workload.data import length_profile
from train.workload.model import ModelSpec, model_shape, with_hub_weights
from train.workload.prepare import DataSpec, PreparedData, prepare_data
from train.workload.samples import resolve_data_path
from train.workload.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from calibration.model import Calibration
    from train.recipes.chosen_setup import ChosenSetup
    from train.workload.batching import DataView
    from train.workload.method import MethodConfig

# What a comparison's predicted row prices the traffic with: (seconds per optimizer step, per
# micro-step, the communication record), train.recipes.compare.plan_row.
Communicate = Callable[["Traffic"], tuple[float, float, JsonDict]]


@dataclass(frozen=True)
class PlanContext:
    """What every plan of one command shares, whichever calibration or setup it is for: the
    command's configuration and model, the data as the planner sees it, the time already spent,
    and for a resumed run the interrupted run's epochs and configuration (train.running.resume)."""

    config: TrainConfig
    spec: ModelSpec
    data: DataView
    eval_data: DataView | None
    elapsed_seconds: float
    data_prep_seconds: float = 0.0
    data_uncertainty: float = 0.0
    resumed: ResumedRun | None = None  # the run a resume continues: its epochs and configuration
    completed: int = 0


@dataclass(frozen=True)
class PlacedPlan:
    """A fitted setup planned: where it runs, what communication adds, what was asked, the plan."""

    placement: Placement
    communication: JsonDict
    request: PlanRequest
    plan: Plan


@dataclass(frozen=True)
class Placement:
    """Where a plan runs: the setup (its device, processes and sharding, price per device-hour),
    what communication adds that the calibration's step times lack (per optimizer step, per
    micro-step, none of it hidden), and whether that communication may hide behind backward (a row
    predicted from a 1-process step, train.recipes.compare: the planner brackets it)."""

    setup: ChosenSetup
    comm_seconds: tuple[float, float] = (0.0, 0.0)
    comm_overlap: bool = False

    @property
    def hardware(self) -> JsonDict:
        return self.setup.hardware

    @property
    def world_size(self) -> int:
        return self.setup.world_size

    @property
    def sharding(self) -> str:
        return self.setup.sharding

    @property
    def price_per_hour(self) -> float | None:
        return self.setup.price_per_hour


@dataclass
class LoadedData:
    """The data of a command: as the planner sees it (`data`, `eval_data`: exact, or from a sample)
    and how to get every record tokenized for training (`exact`)."""

    data_path: str
    tokenizer: PreTrainedTokenizerBase
    prepared: PreparedData
    eval_prepared: PreparedData | None  # the same for --eval-data
    # Any until the training loop's TrainingData takes a DataView: its caller (recipe.py's
    # _train_loop) passes these after _with_exact_data made them exact (TokenizedData).
    data: Any
    eval_data: Any
    profile: JsonDict

    @property
    def sampled(self) -> bool:
        return not self.prepared.exact or (self.eval_prepared is not None and not self.eval_prepared.exact)

    @property
    def prep_seconds(self) -> float:
        """Tokenizing still to do before training: at the rate measured on the samples."""
        return sum(p.predicted_seconds for p in (self.prepared, self.eval_prepared) if p is not None and not p.exact)

    @property
    def uncertainty(self) -> float:
        """The token total's relative 95% half-width (0 for an exact profile)."""
        return self.prepared.estimate.relative_half_width if self.prepared.estimate else 0.0

    def exact(self, section: DataSection, seed: int) -> tuple[Any, Any]:
        """(data, eval data) of every record, tokenized (the cache built where it is cold)."""
        data = self.prepared.tokenized(say)
        eval_data = self.eval_prepared.tokenized(say) if self.eval_prepared is not None else None
        return split_data(data, eval_data, section, seed)


def split_data(data: Any, eval_data: Any, section: DataSection, seed: int) -> tuple[Any, Any]:
    """--eval-split holds out a share of the data (deterministically, by `seed`); --eval-data is its own."""
    if section.eval_split is not None:
        return split_eval(data, section.eval_split, seed)
    return data, eval_data


def load_data(section: DataSection, spec: ModelSpec, seed: int) -> LoadedData:
    """The tokenizer and the data (the command's data section, whole): exact when the cache holds it
    (or --exact-profile), else from a sample; `seed` draws --eval-split's share."""
    data_path = resolve_data_path(section.data)
    tokenizer = load_tokenizer(spec.directory, section.tokenizer)
    prepared = prepare_data(DataSpec(data_path, section.train_on, section.schema, section.data_split), tokenizer, say, section.exact_profile)
    eval_prepared = None
    if section.eval_split is None and section.eval_data:
        eval_spec = DataSpec(resolve_data_path(section.eval_data), section.train_on, section.schema)
        eval_prepared = prepare_data(eval_spec, tokenizer, say, section.exact_profile)
    data, eval_data = split_data(prepared.view, eval_prepared.view if eval_prepared else None, section, seed)
    profile = {**length_profile(data.lengths), "sampled": not prepared.exact}
    return LoadedData(data_path, tokenizer, prepared, eval_prepared, data, eval_data, profile)


def hub_weights(spec: ModelSpec, dry_run: bool) -> ModelSpec:
    """The spec that loads a hub model's weights, fetched into the hub cache if missing (said first,
    with the size); a dry run only says what a run would fetch, and plans without them."""
    if not dry_run:
        return with_hub_weights(spec, say)
    try:
        return with_hub_weights(spec, say, fetch=False)
    except BenchtrainError as error:
        say(f"warning: {error}")
        return spec


def planned_upload_seconds(config: TrainConfig, need: MemoryNeed, method: MethodConfig, device_type: str) -> float:
    """--push-to-hub: the bytes uploaded at the bandwidth the last push measured, else a stated default."""
    if not config.output.push_to_hub:
        return 0.0

    rate, _ = upload_rate()
    return upload_bytes(need, method.is_lora, bool(config.output.merge_lora and method.is_lora), device_type) / rate


def plan_request(context: PlanContext, method: MethodConfig, cal: Calibration, placement: Placement, need: MemoryNeed) -> PlanRequest:
    """What the planner is asked for this command, calibration and placement."""
    config, spec, resumed = context.config, context.spec, context.resumed

    device_type = placement.setup.device_type
    # A 1-process calibration's probes held the whole model; an FSDP process holds its shard.
    memory_offset, gradient_shards = 0.0, 1
    if cal.world_size == 1 and placement.sharding == "fsdp":
        memory_offset = need.per_process_bytes(placement.sharding, placement.world_size, device_type) - need.total_bytes
        gradient_shards = placement.world_size
    # A 1-process calibration measured no NCCL communicator: each GPU of N holds its buffers (and
    # NVLS memory on an NVSwitch) besides; an N-process calibration measured them in its peak.
    if cal.world_size == 1:
        memory_offset += communicator_bytes(placement.hardware, placement.world_size)
    # On CPU this process's own libraries and data beyond the bench process's, measured now (its
    # data loaded, its model not yet built).
    memory_offset += host_excess_bytes(cal.hardware, device_type)
    return PlanRequest(
        data_prep_seconds=context.data_prep_seconds,
        data_uncertainty=context.data_uncertainty,
        epochs=resumed.epochs if resumed else config.plan.epochs,
        deadline=config.run_deadline,
        elapsed_seconds=context.elapsed_seconds,
        priority=config.plan.priority,
        effective_batch=config.plan.effective_batch,
        max_length=resumed.configuration.seq_len if resumed else config.plan.max_length,
        world_size=placement.world_size,
        num_workers=config.plan.workers,
        checkpoint_interval_seconds=config.guard.checkpoint_interval_seconds,
        price_per_hour=placement.price_per_hour,
        max_steps=config.plan.max_steps,
        fit_deadline=config.plan.fit_deadline,
        seed=config.seed,
        max_positions=spec.max_positions,
        completed_steps=context.completed,
        configuration=resumed.configuration if resumed else None,
        switches={"gradient_checkpointing": config.plan.gradient_checkpointing},
        eval_schedule=config.data.eval_schedule if context.eval_data is not None else None,
        with_report=not config.output.no_report,
        compiled=placement.setup.compiled,
        comm_seconds_per_step=placement.comm_seconds[0],
        comm_seconds_per_micro_step=placement.comm_seconds[1],
        memory_offset_bytes=memory_offset,
        gradient_shards=gradient_shards,
        export_bytes=export_bytes(need, method.is_lora, not spec.has_weights, bool(config.output.merge_lora and method.is_lora), device_type),
        upload_seconds=planned_upload_seconds(config, need, method, device_type),
        comm_overlap=placement.comm_overlap,
    )


def plan_json(cal: Calibration, plan: Plan, placement: Placement, communication: JsonDict, compute: JsonDict) -> JsonDict:
    """A dry run's plan as `--json` prints it (also each row of a comparison, train.recipes.compare)."""
    return {
        "calibration_id": cal.id,
        "calibration_path": str(cal.path) if cal.path else None,
        "device": placement.hardware["name"],
        "device_type": placement.hardware["device_type"],
        "memory_bytes": placement.hardware["memory_bytes"],
        "world_size": placement.world_size,
        "sharding": placement.sharding,
        "plan": plan.to_json(),
        "communication": communication,
        "compute": compute,
    }


def planned_compute(spec: ModelSpec, method: MethodConfig, chosen: Candidate, hardware: JsonDict) -> JsonDict:
    """The plan's predicted TFLOP/s and MFU on `hardware` (the calibration's device in a dry run
    for another): its peak FLOP/s as recorded, else train.step.hardware's table for its name."""
    peak = hardware.get("peak_bf16_flops") or (peak_flops(hardware["name"]) or (None, None))[1]
    if not peak or not chosen.step_seconds:
        return {"mfu": None}
    shape = model_shape(meta_model(spec, method))
    flops = shape.flops_per_token(chosen.config.seq_len, lora=method.is_lora, recompute=chosen.config.gradient_checkpointing)
    return planned_figures(chosen.padded_tokens, chosen.step_seconds, chosen.world_size, flops, peak)


def plan_fitted(setup: ChosenSetup, context: PlanContext, communicate: Communicate | None = None) -> PlacedPlan:
    """A setup planned (train.recipes.chosen_setup decided it): what communication adds (measured
    among the calibration's processes, or `communicate(traffic)` → (per step, per micro-step,
    record) where a comparison predicts it: the collectives' seconds with none hidden, which the
    planner brackets between full overlap with backward and none,
    train.planning.planner.exposed_floor), the placement, the request and the planner's plan."""
    traffic = traffic_of(setup.sharding, setup.need, setup.device_type)
    if communicate is None:
        per_step, per_micro_step, communication = plan_communication(setup.cal, setup.world_size, traffic, context.config.force)
    else:
        per_step, per_micro_step, communication = communicate(traffic)
    placement = Placement(setup, (per_step, per_micro_step), comm_overlap=communicate is not None)
    request = plan_request(context, setup.method, setup.cal, placement, setup.need)
    return PlacedPlan(placement, communication, request, make_plan(setup.cal, context.data, request, context.eval_data))


def plan_again(cal: Calibration, request: PlanRequest, data: DataView, eval_data: DataView | None) -> Plan:
    """The planner on a request already made, for other data: the exact tokens once a plan made from
    a sample is kept (train.recipes.recipe.TrainRecipe._with_exact_data)."""
    return make_plan(cal, data, request, eval_data)
