"""What the Trainer's run really did, measured from its callbacks: each optimizer step's time and
micro-steps, the real and padded tokens of the batches the model was given, each save and each
evaluation.

The Trainer hands a callback no batches, so the tokens are read where the batches arrive: a
forward pre-hook on the model, in training mode only (an evaluation's forward passes are not
training tokens), counting what the collator made — a padded batch's attention mask, a packed
(padding-free) batch's every position. The counts stay on the device until the step ends: one
read per optimizer step, not one per micro-step.

A step's time runs from the end of what came before it (the previous step, its log, evaluation or
save: `mark`) to its `on_step_end`, so the data loading the Trainer does before `on_step_begin`
is in it; saves and evaluations are timed apart, from their step's end to `on_save` /
`on_evaluate`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from benchtrain.common.json_types import JsonDict
from benchtrain.trainer.training_frame import TrainingFrame, current_frame

# The counting hook on each model, by model: a run that ended by an exception left its hook there,
# and the next run's counter takes it off.
_HOOKS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


@dataclass
class StepRecord:
    """One optimizer step as run.json's `losses` holds it (the report draws these)."""

    step: int
    seconds: float
    elapsed: float  # from the run's start (a resumed run's earlier budget included)
    tokens: int  # real tokens, every process
    padded_tokens: int  # positions computed, padding included, every process
    micro_steps: int
    predicted_seconds: float = 0.0  # the plan's step time (set once the plan is made)
    loss: float | None = None  # where the Trainer logged one
    learning_rate: float | None = None

    def to_json(self) -> JsonDict:
        record: JsonDict = {
            "step": self.step,
            "seconds": self.seconds,
            "predicted_seconds": self.predicted_seconds,
            "elapsed": self.elapsed,
            "tokens": self.tokens,
            "padded_tokens": self.padded_tokens,
            "micro_steps": self.micro_steps,
            "loss": self.loss,
        }
        if self.learning_rate is not None:
            record["learning_rate"] = self.learning_rate
        return record


class TokenCounter:
    """Real and padded tokens of the training batches the model sees (a forward pre-hook). The hook
    comes off at the run's end, and after an exception at the model's next forward pass or the next
    run's start, whichever comes first (the Trainer calls no callback after an exception)."""

    def __init__(self) -> None:
        self._real: list[Any] = []  # per micro-step: a device tensor or an int
        self._padded = 0
        self._micro_steps = 0
        self._length_sum = 0
        self._handle: Any = None
        self._training: TrainingFrame | None = None

    def attach(self, model: Any, training: TrainingFrame | None = None) -> None:
        self._training = training
        stale = _HOOKS.pop(model, None)
        if stale is not None and stale is not self._handle:
            stale.remove()
        if self._handle is None:
            self._handle = model.register_forward_pre_hook(self._count, with_kwargs=True)
        _HOOKS[model] = self._handle

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _count(self, module: Any, args: tuple[Any, ...], kwargs: JsonDict) -> None:
        if self._training is not None and not self._training.live(current_frame()):
            self.detach()  # train() ended by an exception: this forward pass is the user's, not the run's
            return
        if not module.training:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None or not hasattr(ids, "numel"):
            ids = kwargs.get("inputs_embeds")
            if ids is None:
                return
            ids = ids[..., 0]
        mask = kwargs.get("attention_mask")
        self._padded += int(ids.numel())
        self._length_sum += int(ids.shape[-1])
        self._micro_steps += 1
        # A 2-D 0/1 mask counts the real tokens; a packed batch (no mask, or a 4-D one) is all real.
        self._real.append(
            mask.sum() if mask is not None and getattr(mask, "dim", lambda: 0)() == 2 else int(ids.numel())
        )

    def take(self) -> StepTokens:
        """This process's counts since the last take, read once (one device sync)."""
        real = int(sum(int(value) for value in self._real))
        taken = StepTokens(
            real, self._padded, self._micro_steps, self._length_sum / self._micro_steps if self._micro_steps else 0.0
        )
        self._real, self._padded, self._micro_steps, self._length_sum = [], 0, 0, 0
        return taken


@dataclass(frozen=True)
class StepTokens:
    tokens: int
    padded_tokens: int
    micro_steps: int
    mean_length: float  # padded length of a micro-batch, on average


@dataclass
class StepWatch:
    """The run's measured steps, saves and evaluations, on the callback's clock."""

    clock: Callable[[], float]
    started_at: float = 0.0  # the run's start on `clock` (moved back by a resumed run's budget used)
    mark: float = 0.0  # the end of the last thing timed: a step's time starts here
    step_end: float = 0.0  # when the last step ended
    steps: list[StepRecord] = field(default_factory=list)
    save_seconds: list[float] = field(default_factory=list)
    eval_seconds: list[float] = field(default_factory=list)
    lengths: list[float] = field(default_factory=list)  # mean padded length of each step's micro-batches

    def start(self, used_seconds: float) -> None:
        now = self.clock()
        self.started_at, self.mark, self.step_end = now - used_seconds, now, now

    def elapsed(self) -> float:
        return self.clock() - self.started_at

    def end_step(self, step: int, counted: StepTokens) -> StepRecord:
        now = self.clock()
        record = StepRecord(
            step, now - self.mark, now - self.started_at, counted.tokens, counted.padded_tokens, counted.micro_steps
        )
        self.steps.append(record)
        self.lengths.append(counted.mean_length)
        self.mark = self.step_end = now
        return record

    def saved(self) -> float:
        return self._timed(self.save_seconds)

    def evaluated(self) -> float:
        return self._timed(self.eval_seconds)

    def _timed(self, into: list[float]) -> float:
        """Seconds since the last mark (a save's or an evaluation's), kept in `into`."""
        now = self.clock()
        into.append(now - self.mark)
        self.mark = now
        return into[-1]

    def logged(self, logs: JsonDict) -> None:
        """The Trainer's log at a step: its loss and learning rate go onto the step's record; the time
        of logging belongs to the next step's `mark` (it is not the step's)."""
        if self.steps and "loss" in logs:
            self.steps[-1].loss = float(logs["loss"])
            if "learning_rate" in logs:
                self.steps[-1].learning_rate = float(logs["learning_rate"])

    def steady(self, warmup_steps: int) -> list[StepRecord]:
        """The steps after the warm-up ones (whose time is start-up, not speed)."""
        return self.steps[warmup_steps:]

    @property
    def periodic_share(self) -> float:
        """Saves and evaluations so far per second of steps: what the steps left bring with them."""
        stepped = sum(record.seconds for record in self.steps)
        return (sum(self.save_seconds) + sum(self.eval_seconds)) / stepped if stepped > 0 else 0.0
