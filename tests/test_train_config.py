"""One validated configuration for `train` (issue 13)."""

from __future__ import annotations

import pytest

from benchtrain.common.errors import BenchtrainError
from benchtrain.train.cli import build_parser
from benchtrain.train.recipes.config import TrainConfig
from benchtrain.train.step.evaluation import EvalSchedule


def test_the_command_line_becomes_one_validated_config() -> None:
    args = build_parser().parse_args(
        ["--data", "sample", "--deadline", "1h30m", "--lora", "--eval-split", "0.1", "--eval-every", "50steps"]
    )
    config = TrainConfig.from_args(args)
    assert config.plan.deadline_seconds == 5400 and config.guard.checkpoint_interval_seconds == 600
    assert config.tuning.method.is_lora and config.tuning.method.lora_rank == 16
    assert config.data.eval_schedule == EvalSchedule(every_steps=50) and config.output.trackers == ()
    written = config.to_json()
    assert (
        written["deadline_seconds"] == 5400
        and written["method"]["method"] == "lora"
        and written["eval_schedule"]["every_steps"] == 50
    )


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"epochs": 0}, "--epochs must be positive"),
        ({"keep_checkpoints": 0}, "--keep-checkpoints"),
        ({"margin": 0.7}, "--margin"),
        ({"resume": True}, "--resume needs --out"),
        ({"max_length": "x"}, "--max-length"),
        ({"eval_every": "5steps"}, "--eval-every needs an eval set"),
        ({"deadline": "-5m"}, "--deadline must be positive"),
    ],
)
def test_every_bad_value_is_one_line(overrides: dict, fragment: str) -> None:
    with pytest.raises(BenchtrainError, match=fragment):
        TrainConfig.of(**{"data": "sample", "deadline": "5m", **overrides})


def test_the_parsers_defaults_are_the_configurations() -> None:
    """Every option of `train` whose field has a default in the configuration (TrainConfig, its sections, StepOptions,
    MethodConfig) shows that default: the parser reads it (config.option_default), it does not repeat it."""
    from dataclasses import MISSING, fields

    from benchtrain.train.recipes.config import SECTIONS, option_default
    from benchtrain.train.step.engine import StepOptions
    from benchtrain.train.workload.method import MethodConfig

    defaulted = {
        each.name
        for holder in (TrainConfig, *SECTIONS.values(), StepOptions, MethodConfig)
        for each in fields(holder)
        if each.init and each.default is not MISSING
    }
    checked = [
        action.dest
        for action in build_parser()._actions
        if action.dest in defaulted and action.default is not None and not isinstance(action.default, bool)
    ]
    assert len(checked) >= 10
    for name in checked:
        action = next(action for action in build_parser()._actions if action.dest == name)
        assert action.default == option_default(name), name
