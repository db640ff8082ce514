"""What a calibration's probes trained (its `training` section): the method, LoRA's rank, the base's quantization,
the optimizer, the step's precision, compile setting and loss; typed once where the file is read."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from benchtrain.common.json_types import JsonDict

UNQUANTIZED = "none"


@dataclass(frozen=True)
class TrainerStep:
    """Whose step the probes timed when it was not ours: a user's own `transformers.Trainer` (its class, the loss it
    computes, its data collator), as `benchtrain.calibrate(trainer)` records it under `training.trainer`. A calibration
    with one is never planned as our `train`'s step, nor ours as theirs without saying how they differ."""

    class_name: str  # "Trainer", "SFTTrainer", or the user's subclass
    loss: str  # "the model's own" or the class that overrides compute_loss
    collator: str  # the data collator's class name

    @classmethod
    def from_record(cls, record: JsonDict) -> TrainerStep:
        return cls(str(record.get("class", "Trainer")), str(record.get("loss", "")), str(record.get("collator", "")))

    def to_record(self) -> JsonDict:
        return {"class": self.class_name, "loss": self.loss, "collator": self.collator}

    def words(self) -> str:
        """Whose step this is, in the words `bench show` and the calibration report use."""
        return (
            f"a {self.class_name}'s own step (loss: {self.loss}; collator {self.collator}), by benchtrain.calibrate: "
            "plan it with benchtrain.fit_to_deadline, not `train`"
        )


@dataclass(frozen=True)
class Training:
    """The `training` section as read; a record without one (a hand-made calibration) trained full fine-tuning."""

    method: str = "full"  # "full" | "lora" | another adapter method's name (train.workload.method.METHODS)
    lora_rank: int | None = None  # the adapters' rank as recorded; None: no LoRA settings recorded
    quantization: str = UNQUANTIZED  # the base as --quantize names it: "none", "4bit", "8bit"
    optimizer: str = "adamw"
    precision: str | None = None  # "bf16" | "fp32"; None: not recorded (older calibrations)
    compiled: bool = False
    loss: str | None = None  # None: not recorded (calibrations before --loss)
    compile_cache: dict[str, str] | None = None  # train.step.compile.compile_cache_record
    trainer: TrainerStep | None = None  # None: our own step (bench run); else a user's Trainer's (calibrate(trainer))
    record: JsonDict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_record(cls, record: JsonDict | None) -> Training:
        record = record or {}
        method = str(record.get("method", "full"))
        lora = record.get("lora") or {}
        rank = lora.get("rank") if isinstance(lora, dict) else None
        cache = record.get("compile_cache")
        trainer = record.get("trainer")
        return cls(
            method=method,
            lora_rank=int(rank) if rank is not None else None,
            quantization=quantize_value(record.get("quantization")),
            optimizer=str(record.get("optimizer") or "adamw"),
            precision=str(record["precision"]) if record.get("precision") else None,
            compiled=bool(record.get("compile")),
            loss=str(record["loss"]) if record.get("loss") else None,
            compile_cache={str(key): str(value) for key, value in cache.items()} if isinstance(cache, dict) else None,
            trainer=TrainerStep.from_record(trainer) if isinstance(trainer, dict) else None,
            record=dict(record),
        )


def quantize_value(recorded: object) -> str:
    """The base's quantization as --quantize names it ("none", "4bit", "8bit"), from whatever a calibration records: the
    value itself, a bit count, "nf4", "int8", "4-bit" or an object with `bits`."""
    if isinstance(recorded, dict):
        recorded = recorded.get("bits") or recorded.get("method") or recorded.get("type")
    if recorded in (None, False, 0, "", UNQUANTIZED):
        return UNQUANTIZED
    if isinstance(recorded, int) and not isinstance(recorded, bool):
        return f"{recorded}bit"
    digits = re.search(r"\d+", str(recorded))
    return f"{digits.group()}bit" if digits else str(recorded)


def base_phrase(quantize: str | None) -> str:
    """The base in prose: "a 4-bit base", "an 8-bit base", "an unquantized base"."""
    if not quantize or quantize == UNQUANTIZED:
        return "an unquantized base"
    words = quantize.replace("bit", "-bit") if re.fullmatch(r"\d+bit", quantize) else quantize
    article = "an" if words.startswith(("8", "11", "18")) else "a"
    return f"{article} {words} base"
