"""The hyper-parameters people set, under HF Trainer's names: learning rate and its scaling, schedule, warm-up,
weight decay, clipping, Adam's betas and epsilon; the optimizer built from them. Design: docs/design.md#hyper-parameters"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING

from benchtrain.common.errors import BenchtrainError
from benchtrain.common.json_types import JsonDict
from benchtrain.train.workload.optimizers import DEFAULT_OPTIMIZER, Betas, hf_optim, optimizer_named, parameter_groups

if TYPE_CHECKING:
    import torch
    from torch.optim.lr_scheduler import LambdaLR

DEFAULT_LEARNING_RATE = 3e-4
LR_SCALINGS = ("none", "linear", "sqrt")
SCHEDULER_CHOICES = ("cosine", "linear", "constant", "constant_with_warmup")
DEFAULT_WARMUP_RATIO = 0.05  # of the run's optimizer steps
DEFAULT_WEIGHT_DECAY = 0.1  # on matrices only (train.workload.optimizers.parameter_groups)
DEFAULT_MAX_GRAD_NORM = 1.0  # 0: no clipping
DEFAULT_BETAS = Betas(0.9, 0.95)
DEFAULT_EPSILON = 1e-8  # torch's AdamW default


def option_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


@dataclass(frozen=True)
class OptimizerSettings:
    """The schedule's and the optimizer's hyper-parameters (the learning rate and the optimizer
    itself are the plan's and the method's: train.recipes.run_plan, train.workload.method)."""

    lr_scheduler_type: str = "cosine"
    warmup_ratio: float = DEFAULT_WARMUP_RATIO
    warmup_steps: int | None = None  # overrides warmup_ratio when given
    weight_decay: float = DEFAULT_WEIGHT_DECAY
    max_grad_norm: float = DEFAULT_MAX_GRAD_NORM
    adam_beta1: float = DEFAULT_BETAS[0]
    adam_beta2: float = DEFAULT_BETAS[1]
    adam_epsilon: float = DEFAULT_EPSILON

    def __post_init__(self) -> None:
        if self.lr_scheduler_type not in SCHEDULER_CHOICES:
            raise BenchtrainError(
                f"--lr-scheduler-type must be one of {', '.join(SCHEDULER_CHOICES)}, got {self.lr_scheduler_type!r}"
            )
        if not (math.isfinite(self.warmup_ratio) and 0 <= self.warmup_ratio < 1):
            raise BenchtrainError(f"--warmup-ratio must be a fraction in [0, 1), got {self.warmup_ratio}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise BenchtrainError(f"--warmup-steps must be 0 or more, got {self.warmup_steps}")
        for name in ("weight_decay", "max_grad_norm"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise BenchtrainError(f"{option_name(name)} must be 0 or more, got {value}")
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0 <= value < 1):
                raise BenchtrainError(f"{option_name(name)} must be in [0, 1), got {value}")
        if not (math.isfinite(self.adam_epsilon) and self.adam_epsilon > 0):
            raise BenchtrainError(f"--adam-epsilon must be positive, got {self.adam_epsilon}")

    @property
    def betas(self) -> Betas:
        return Betas(self.adam_beta1, self.adam_beta2)

    def warmup_for(self, total_steps: int) -> int:
        """The warm-up's optimizer steps in a run of `total_steps`: --warmup-steps where given, else
        the ratio's share (at least one step for a ratio above 0); none for `constant`."""
        if self.lr_scheduler_type == "constant":
            return 0
        if self.warmup_steps is not None:
            return self.warmup_steps
        return max(1, int(self.warmup_ratio * total_steps)) if self.warmup_ratio > 0 else 0

    def scheduler(self, optimizer: torch.optim.Optimizer, total_steps: int) -> LambdaLR:
        """This schedule over the run's `total_steps` optimizer steps (the same on every process; a
        resume keeps the run's first horizon). transformers' get_scheduler takes what each kind needs."""
        from transformers import get_scheduler

        return get_scheduler(
            self.lr_scheduler_type,
            optimizer,
            num_warmup_steps=self.warmup_for(total_steps),
            num_training_steps=max(1, total_steps),
        )

    def record(self, learning_rate: float, optimizer: str, total_steps: int) -> JsonDict:
        """run.json's `hyperparameters`: the HF keys (HF_KEYS), `warmup_steps` the warm-up this run's
        schedule has over its `total_steps`, `optim` HF's name of the optimizer (its OPTIMIZERS entry's)."""
        return {
            "learning_rate": learning_rate,
            **asdict(self),
            "warmup_steps": self.warmup_for(total_steps),
            "optim": hf_optim(optimizer),
        }


# The fields of OptimizerSettings, which are also their options' names (--warmup-ratio: warmup_ratio).
SETTING_NAMES = tuple(setting.name for setting in fields(OptimizerSettings))
# The keys of run.json's `hyperparameters`, as HF TrainingArguments names them.
HF_KEYS = ("learning_rate", *SETTING_NAMES, "optim")


def settings_from(values: JsonDict) -> OptimizerSettings:
    """OptimizerSettings from named values (None or absent: the default)."""
    return OptimizerSettings(**{name: values[name] for name in SETTING_NAMES if values.get(name) is not None})


def scaled_learning_rate(learning_rate: float, scaling: str, base_batch: int | None, effective_batch: int) -> float:
    """`learning_rate`, right at `base_batch`, scaled to `effective_batch` linearly, by the square root, or not at all (docs/design.md#hardware)."""
    if scaling == "none" or not base_batch:
        return learning_rate
    ratio = effective_batch / base_batch
    return learning_rate * (ratio if scaling == "linear" else ratio**0.5)


def make_optimizer(
    model: torch.nn.Module,
    learning_rate: float = DEFAULT_LEARNING_RATE,
    name: str = DEFAULT_OPTIMIZER,
    settings: OptimizerSettings | None = None,
) -> torch.optim.Optimizer:
    """`name`'s optimizer over the trainable parameters, weight decay on matrices only (`settings`: None, the defaults)."""
    settings = settings or OptimizerSettings()
    return optimizer_named(name).build(
        parameter_groups(model, settings.weight_decay), learning_rate, settings.betas, settings.adam_epsilon
    )
