"""A plan for someone else's Trainer: the chosen configuration as `TrainingArguments` / TRL
`SFTConfig` fields, as JSON and as a snippet, and where their step is not the one the calibration
measured. Why: docs/design.md#trainer-fields."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from benchtrain.calibration.model import Calibration
from benchtrain.common.json_types import JsonDict
from benchtrain.train.planning.types import Plan

# Losses of ours that differ from the model's own cross-entropy over full logits (train.step.loss).
FUSED_LOSSES = ("chunked", "liger")
SFT_ONLY = ("max_length", "packing")  # TRL's SFTConfig takes these beside TrainingArguments' fields


@dataclass(frozen=True)
class TrainerFields:
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    dataloader_num_workers: int
    activation_checkpointing: bool  # `gradient_checkpointing` before transformers 5.24 (an alias since)
    bf16: bool
    max_steps: int
    torch_compile: bool
    max_length: int  # max_seq_length in TRL before 0.20
    packing: bool
    calibration_id: str
    differences: tuple[str, ...]  # where their step is not the one measured

    def sft_config(self) -> JsonDict:
        """Every field TRL's SFTConfig takes: TrainingArguments' and SFT_ONLY."""
        return {name: value for name, value in asdict(self).items() if name not in ("calibration_id", "differences")}

    def to_json(self) -> JsonDict:
        fields = self.sft_config()
        return {
            "training_arguments": {name: value for name, value in fields.items() if name not in SFT_ONLY},
            "sft_config": {name: fields[name] for name in SFT_ONLY},
            "calibration_id": self.calibration_id,
            "differences": list(self.differences),
        }

    def snippet(self) -> str:
        """The Python a user pastes: TRL's SFTConfig (a TrainingArguments) and the callback."""
        lines = "\n".join(f"    {name}={value!r}," for name, value in self.sft_config().items())
        return (
            "from benchtrain import DeadlineCallback\n"
            "from trl import SFTConfig  # transformers.TrainingArguments takes the same fields but max_length and packing\n\n"
            f"args = SFTConfig(\n    output_dir=...,\n{lines}\n)\n"
            f'callbacks = [DeadlineCallback(deadline=..., calibration="{self.calibration_id}")]\n'
        )

    def describe(self) -> str:
        """The fields as JSON, the snippet, and the differences, for the console."""
        differences = "\n".join(f"  - {line}" for line in self.differences)
        return (
            f"TrainingArguments / SFTConfig fields:\n{json.dumps(self.sft_config(), indent=2)}\n\n"
            f"{self.snippet()}\nwhere your Trainer's step differs from the one calibration {self.calibration_id} measured:\n{differences}"
        )


def step_differences(calibration: Calibration) -> tuple[str, ...]:
    """Where a Trainer's step is not the one a calibration of our own step measured: its loss and its compile setting."""
    measured = calibration.training
    compiled = measured.compiled
    loss = measured.loss
    fused = (
        f"loss: the calibration measured benchtrain's {loss} loss, which never holds full-vocabulary logits; a Trainer's model computes its "
        "cross-entropy over full logits (slower, more memory for a large vocabulary): the callback's first steps correct the step time"
    )
    return (
        *([fused] if loss in FUSED_LOSSES else []),
        f"compile: the calibration measured {'a compiled' if compiled else 'an eager'} step; torch_compile={compiled} keeps yours the same "
        "(the first compiled steps are slow: the callback measures after its warm-up)",
    )


def trainer_fields(plan: Plan, calibration: Calibration, precision: str) -> TrainerFields:
    """`plan`'s chosen configuration as a Trainer's fields; `precision`: the step's (bf16 or fp32)."""
    chosen, compiled = plan.chosen, calibration.training.compiled
    padded = (
        "batches: benchtrain groups samples of similar length into a batch (less padding); a Trainer pads random batches to their longest "
        "sample unless group_by_length=True (or TRL's padding_free/packing): more padded tokens per real one"
    )
    differences = [
        *step_differences(calibration),
        *([] if plan.packing else [padded]),
        "to hold your run to the plan: DeadlineCallback(calibration=...) predicts from the same calibration and corrects from your measured steps",
    ]
    step = chosen.config
    return TrainerFields(
        per_device_train_batch_size=step.micro_batch_size,
        gradient_accumulation_steps=step.grad_accum,
        dataloader_num_workers=step.num_workers,
        activation_checkpointing=step.gradient_checkpointing,
        bf16=precision == "bf16",
        max_length=step.seq_len,
        packing=plan.packing,
        torch_compile=compiled,
        max_steps=min(plan.step_limit, chosen.optimizer_steps) if plan.step_limit else chosen.optimizer_steps,
        calibration_id=calibration.id,
        differences=tuple(differences),
    )
