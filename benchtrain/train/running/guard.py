"""The deadline guard: from live step times, will the run finish in time, and what to do if not
(`--on-overrun`: OVERRUN_ACTIONS). The projection and why: docs/design.md#guard."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

from benchtrain.calibration.run_file import INTERRUPTED, STOPPED_FOR_DEADLINE
from benchtrain.common.durations import parse_duration
from benchtrain.common.errors import BenchtrainError
from benchtrain.train.planning.deadline import Deadline

WINDOW_STEPS = 20
NEXT_STEP_SAFETY = 1.5  # the next step may take this much longer than the slowest recent one
# Over budget → back on track only with this share of the time left before the budget to spare.
HYSTERESIS_FRACTION = 0.05
ON_TRACK, OVER_BUDGET, WARMING_UP = "on track", "over budget", "warming up"


class Move(Enum):
    """What the loop does after a step, weakest first: the processes agree on the strongest any of
    them asks, so that all of them checkpoint or stop together."""

    CONTINUE = "continue"
    SHRINK = "shrink"  # the step limit was cut (Verdict.limit); the run ends there, STEP_LIMIT
    CHECKPOINT = "checkpoint"  # save a checkpoint now and go on
    STOP = "stop"  # checkpoint and stop: STOPPED_FOR_DEADLINE
    INTERRUPT = "interrupt"  # not the guard's: SIGINT/SIGTERM, checkpoint and stop: INTERRUPTED

    @property
    def strength(self) -> int:
        return list(Move).index(self)

    @staticmethod
    def of_strength(strength: int) -> Move:
        return list(Move)[strength]

    @property
    def status(self) -> str | None:
        """The status word the run ends with after this move (None: it goes on)."""
        return {Move.STOP: STOPPED_FOR_DEADLINE, Move.INTERRUPT: INTERRUPTED}.get(self)


@dataclass(frozen=True)
class OverrunAction:
    """One `--on-overrun` choice: what the guard does once the projection passes the budget."""

    word: str  # --on-overrun WORD (GuardSettings.on_overrun, run.json's config.on_overrun)
    help: str  # its phrase in --on-overrun's help
    then: str  # what the guard says it does about being over budget (the warning, the live line, the log)
    # What the guard asks of the loop as the projection passes the budget: SHRINK at every step
    # over it (the live speed moves), any other move once per change of state.
    when_over: Move = Move.CONTINUE
    stops: bool = True  # stop at the last safe moment (the run checkpointed, STOPPED_FOR_DEADLINE)


DEFAULT_OVERRUN_ACTION = "stop"
# --on-overrun's choices, in the order its help lists them.
OVERRUN_ACTIONS: dict[str, OverrunAction] = {
    action.word: action
    for action in (
        OverrunAction("stop", "checkpoint and stop", "will checkpoint and stop at the last safe moment"),
        OverrunAction("shrink", "shrink the remaining steps", "shrinking", when_over=Move.SHRINK),
        OverrunAction("warn", "warn", "continuing (--on-overrun warn)", stops=False),
    )
}


def overrun_help() -> str:
    """--on-overrun's help: each action's phrase, the default marked."""
    phrases = [
        f"{action.help} (default)" if word == DEFAULT_OVERRUN_ACTION else action.help
        for word, action in OVERRUN_ACTIONS.items()
    ]
    listed = f"{', '.join(phrases[:-1])}, or {phrases[-1]}" if len(phrases) > 1 else phrases[0]
    return f"when live speed says the deadline will be missed: {listed}"


@dataclass(frozen=True)
class GuardSection:
    """The command's guard options: what to do on an overrun, how often to checkpoint, how many to keep."""

    on_overrun: str = DEFAULT_OVERRUN_ACTION  # --on-overrun: a word of OVERRUN_ACTIONS (GuardSettings checks it)
    checkpoint_interval: str = "10m"  # --checkpoint-interval as written
    keep_checkpoints: int = 2
    checkpoint_interval_seconds: float = field(init=False)  # derived: checkpoint_interval in seconds

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "checkpoint_interval_seconds", parse_duration(self.checkpoint_interval, "--checkpoint-interval")
        )
        if self.keep_checkpoints < 1:
            raise BenchtrainError("--keep-checkpoints must be at least 1")


@dataclass(frozen=True)
class GuardSettings:
    """The command's deadline (whole, as the command built it), and how the guard keeps it."""

    deadline: Deadline
    reserve_seconds: float  # what must still fit after the last step
    on_overrun: str = DEFAULT_OVERRUN_ACTION  # a word of OVERRUN_ACTIONS
    warmup_steps: int = 1
    # The periodic checkpoints and evaluations the plan puts between the steps, per second of
    # steps: the steps left bring theirs with them (the projection and a shrink count them).
    periodic_share: float = 0.0

    def __post_init__(self) -> None:
        if self.on_overrun not in OVERRUN_ACTIONS:
            raise ValueError(f"on_overrun must be one of {tuple(OVERRUN_ACTIONS)}")

    @property
    def action(self) -> OverrunAction:
        return OVERRUN_ACTIONS[self.on_overrun]


@dataclass(frozen=True)
class Verdict:
    move: Move  # what the loop does now: CONTINUE | SHRINK | CHECKPOINT | STOP
    limit: int  # the step limit from now on
    projected_finish: float  # seconds from the command's start
    ratio: float  # actual / predicted step time over the window
    message: str | None = None  # a change of state, to say once
    state: str = ON_TRACK  # WARMING_UP (no live speed yet) | ON_TRACK | OVER_BUDGET, with hysteresis
    budget_seconds: float = 0.0  # deadline − margin, from the command's start
    then: str = ""  # what the guard does about being over budget

    @property
    def summary(self) -> str:
        """The state as the live line and the log print it."""
        text = f"{self.state}: projected finish {self.projected_finish:.0f}s of {self.budget_seconds:.0f}s budget"
        return f"{text}; {self.then}" if self.state == OVER_BUDGET and self.then else text


class StepTime(NamedTuple):
    actual: float  # seconds, measured
    predicted: float  # seconds, as the calibration (or the estimate) predicted


@dataclass
class DeadlineGuard:
    settings: GuardSettings
    limit: int
    window: deque[StepTime] = field(default_factory=lambda: deque(maxlen=WINDOW_STEPS))
    seen: int = 0
    over_budget: bool = False

    def observe(
        self,
        step: int,
        elapsed: float,
        actual_seconds: float,
        predicted_seconds: float,
        remaining_predicted: float,
        compiled: bool = False,
        pending_compile_seconds: float = 0.0,
    ) -> Verdict:
        """Step `step` just finished at `elapsed` seconds, `remaining_predicted` seconds predicted for
        the steps left. `compiled`: the step compiled a new shape (its time is not its speed);
        `pending_compile_seconds`: the planned compilation of shapes not met yet."""
        s, budget = self.settings, self.settings.deadline.budget_seconds
        self.seen += 1
        if self.seen > s.warmup_steps and not compiled:
            self.window.append(StepTime(actual_seconds, predicted_seconds))
        # Until a steady step is seen, the prediction itself stands (not the warm-up step).
        ratio = sum(a for a, _ in self.window) / max(1e-12, sum(p for _, p in self.window)) if self.window else 1.0
        projected = (
            elapsed + remaining_predicted * ratio * (1 + s.periodic_share) + pending_compile_seconds + s.reserve_seconds
        )
        message = None
        move, action = Move.CONTINUE, s.action
        over = self.seen > s.warmup_steps and self._over_budget(projected, elapsed)
        then = action.then
        if over and action.when_over is Move.SHRINK:
            per_step = sum(a for a, _ in self.window) / len(self.window) * (1 + s.periodic_share)
            room = budget - elapsed - s.reserve_seconds
            new_limit = step + max(0, math.floor(room / per_step))
            if new_limit < self.limit:
                self.limit = new_limit
                move = Move.SHRINK
                message = f"step {step}: projected finish {projected:.0f}s > {budget:.0f}s budget at the live speed; shrinking to {new_limit} steps"
            then = f"shrunk to {self.limit} steps"
        elif over and not self.over_budget:
            message = f"step {step}: projected finish {projected:.0f}s passes the deadline budget {budget:.0f}s; {then}"
            move = action.when_over
        elif not over and self.over_budget and action.when_over is not Move.SHRINK:
            message = f"step {step}: back on track, projected finish {projected:.0f}s of {budget:.0f}s"
        self.over_budget = over
        if action.stops and step < self.limit and elapsed > self.last_safe_moment():
            move = Move.STOP
        state = OVER_BUDGET if over else (ON_TRACK if self.seen > s.warmup_steps else WARMING_UP)
        return Verdict(move, self.limit, projected, ratio, message, state, budget, then)

    def _over_budget(self, projected: float, elapsed: float) -> bool:
        """Over budget past the budget; back on track only with a margin to spare (hysteresis)."""
        budget = self.settings.deadline.budget_seconds
        if not self.over_budget:
            return projected > budget
        return projected > budget - HYSTERESIS_FRACTION * max(0.0, budget - elapsed)

    def last_safe_moment(self) -> float:
        """Past this, one more step and the reserve might not fit before the deadline."""
        slowest = max((a for a, _ in self.window), default=0.0)
        return self.settings.deadline.budget_seconds - self.settings.reserve_seconds - NEXT_STEP_SAFETY * slowest
