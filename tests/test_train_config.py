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
