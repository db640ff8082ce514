"""Which calibration a run plans with (`--use-calibration`, `latest` and what it prefers, a resumed
run's own), and whether it suits the run: model, device, method, base, optimizer, compile."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from calibration.run_file import ResumedRun
from calibration.schema import read_calibration_file
from calibration.setup import Setup, describe_setup, quantization_name, setup_difference
from calibration.topology import same_interconnect
from common.console import say
from common.errors import BenchtrainError
from train.recipes.config import TrainConfig
from train.step.runtime import run_precision
from train.workload.method import METHODS


def load_calibration(
    config: TrainConfig,
    resumed: ResumedRun | None,
    calibration_api: Any,
    spec: Any,
    method: Any,
    processes: tuple[int, str],
    interconnect: str | None = None,
) -> Any:
    """The calibration to plan with: --use-calibration (default latest); a resumed run plans with
    the calibration it started with, and another one is refused unless --force. `latest` is the
    newest of this model and method measured with this run's (processes, sharding) over this
    machine's `interconnect`, else over another, else the newest of one process (communication is
    then predicted), else the newest; when that is not the newest, it says why."""
    on_skip = lambda message: say(f"warning: {message}")  # noqa: E731
    if resumed is None:
        reference = config.plan.use_calibration or "latest"
        if reference != "latest":
            return calibration_api.load(reference, on_skip=on_skip)
        passed_over: list[Path] = []
        chosen = calibration_api.load("latest", on_skip, calibration_preferences(spec, method, processes, interconnect), passed_over.append)
        if passed_over:
            say(f"calibration: {why_chosen(chosen, passed_over[0], spec, method, processes)}")
        return chosen
    own_id, own_path = resumed.calibration_id, resumed.calibration_path
    if config.plan.use_calibration is not None:
        chosen = calibration_api.load(config.plan.use_calibration, on_skip=on_skip)
        if chosen.id != own_id and not config.force:
            raise BenchtrainError(f"--resume: this run was planned with calibration {own_id}, not {chosen.id}; drop --use-calibration, or pass --force")
        return chosen
    for stored in (own_path, own_id):
        if stored and (Path(stored).is_file() or "/" not in str(stored)):
            try:
                return calibration_api.load(stored)
            except BenchtrainError:
                continue
    raise BenchtrainError(f"--resume: the run's calibration {own_id} is gone ({own_path}); pass --use-calibration ID --force to plan with another")


def why_chosen(chosen: Any, newer: Path, spec: Any, method: Any, processes: tuple[int, str]) -> str:
    """`latest` took `chosen` over the newer file: what it measured, and the difference that decided."""
    run = Setup(spec.name, spec.fingerprint, method.method, method.lora_rank if method.is_lora else None, quantization_name(method.quantize), *processes)
    return f"{chosen.id} ({describe_setup(chosen.data)}) suits this run better than {setup_difference(chosen.data, read_calibration_file(newer), run)}"


def calibration_preferences(spec: Any, method: Any, processes: tuple[int, str], interconnect: str | None = None) -> tuple[Any, ...]:
    """Which stored calibrations `latest` prefers for this run, best first (calibration.store): a
    calibration of another interconnect than `interconnect` (this machine's) is a preference
    missed, not a refusal (one that recorded none matches any: calibration.topology)."""
    def measured(data: dict[str, Any]) -> tuple[str | None, str, str, int, str]:
        distributed = data.get("distributed") or {}
        training = data.get("training") or {}
        size = int(distributed.get("world_size", 1))
        quantize = training.get("quantization") or "none"
        return (data.get("model") or {}).get("fingerprint"), training.get("method", "full"), quantize, size, str(distributed.get("sharding", "none"))

    mine = (spec.fingerprint, method.method, method.quantize)
    return (
        lambda data: measured(data) == (*mine, *processes) and same_interconnect((data.get("hardware") or {}).get("interconnect"), interconnect),
        lambda data: measured(data) == (*mine, *processes),
        lambda data: measured(data)[:4] == (*mine, 1),
    )


def check_compatible(
    calibration: Any, spec: Any, hardware: dict[str, Any], force: bool, method: Any, compiled: bool = False, loss: str | None = None
) -> list[str]:
    """A calibration for another model, device, training method or compile setting is refused
    unless --force (then warned); other LoRA settings than measured are only warned about (they
    barely move the speed)."""
    problems = []
    measured = calibration.training
    if bool(measured.get("compile")) != compiled:
        states = {True: "a compiled step", False: "an eager step"}
        problems.append(
            f"calibration {calibration.id} measured {states[bool(measured.get('compile'))]}, this run would use {states[compiled]}: "
            f"pass --compile {'on' if measured.get('compile') else 'off'}, or run `bench run --compile {'on' if compiled else 'off'}` here, or pass --force"
        )
    if measured["method"] != method.method:
        names = {name: entry.phrase for name, entry in METHODS.items()}
        rerun = {"full": "bench run", "lora": "bench run --lora"}.get(method.method, f"bench run --method {method.method}")
        measured_name = names.get(measured["method"], measured["method"])
        problems.append(f"calibration {calibration.id} measured {measured_name}, not {names[method.method]}: run `{rerun}` here, or pass --force")
    measured_quantize = measured.get("quantization") or "none"
    if measured_quantize != method.quantize:
        problems.append(
            f"calibration {calibration.id} measured a {measured_quantize} base, this run asks for --quantize {method.quantize}: "
            f"run `bench run --lora --quantize {method.quantize}` here, or pass --force"
        )
    measured_optimizer = measured.get("optimizer") or "adamw"
    if measured_optimizer != method.optimizer:
        problems.append(
            f"calibration {calibration.id} measured the {measured_optimizer} optimizer, this run asks for --optimizer {method.optimizer}: "
            f"run `bench run --optimizer {measured_optimizer},{method.optimizer}` here to measure both, or pass --force"
        )
    measured_precision = measured.get("precision")  # absent: not recorded (the bundled H100 calibration): not checked
    if measured_precision and measured_precision != run_precision(hardware["device_type"]):
        problems.append(
            f"calibration {calibration.id} measured a {measured_precision} step, this run would train in {run_precision(hardware['device_type'])} "
            f"(BENCHTRAIN_CPU_BF16): run `bench run` with the same setting here, or pass --force"
        )
    if calibration.model["fingerprint"] != spec.fingerprint:
        problems.append(f"calibration {calibration.id} was measured for model {calibration.model['name']}, not {spec.name}")
    if calibration.hardware["name"] != hardware["name"] or calibration.hardware["device_type"] != hardware["device_type"]:
        problems.append(f"calibration {calibration.id} was measured on {calibration.hardware['name']}, this is {hardware['name']}")
    if problems and not force:
        first = problems[0]
        raise BenchtrainError(first if "--force" in first else f"{first}: run `bench run` here with this model, or pass --force")
    notes = list(problems)
    if loss and measured.get("loss") and measured["loss"] != loss:  # calibrations before --loss did not record it
        notes.append(f"calibration {calibration.id} measured the {measured['loss']} loss, this run uses {loss}: speed and memory may differ")
    lora = measured.get("lora") or {}
    if method.is_lora and lora and (lora.get("rank") != method.lora_rank):
        notes.append(f"calibration {calibration.id} measured LoRA rank {lora.get('rank')}, this run uses rank {method.lora_rank}")
    return notes
