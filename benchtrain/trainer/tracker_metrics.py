"""What the callback adds to the Trainer's log reaches its `report_to` trackers (TensorBoard, W&B,
MLflow...) too, not only the log line. The Trainer calls its callbacks in order, and puts the
trackers' callbacks before the user's: a DeadlineCallback in `callbacks=[...]` adding keys to
`logs` in its own `on_log` would come after the trackers had written them. So at the run's start a
small callback is placed just before the first tracker in the Trainer's callback handler (the one
calling us; transformers hands callbacks no handle on it); its `on_log` asks the DeadlineCallback
for the values, into the same `logs` dict every later callback reads. Every other event keeps the
user's order."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from transformers import TrainerCallback

from benchtrain.common.json_types import JsonDict

if TYPE_CHECKING:
    from transformers import TrainerControl, TrainerState, TrainingArguments


class LogSource(Protocol):
    def add_log_values(self, logs: JsonDict) -> None: ...


class BeforeTrackers(TrainerCallback):
    """Placed before the trackers: the values of the handler's `source_type` callback on their log."""

    def __init__(self, handler: Any, source_type: type[LogSource]) -> None:
        self.handler, self.source_type = handler, source_type

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: JsonDict | None = None,
        **kwargs: object,
    ) -> None:
        if logs is None:
            return
        # Looked up each time: with restore_callback_states_from_checkpoint the Trainer replaces the callback.
        for callback in self.handler.callbacks:
            if isinstance(callback, self.source_type):
                callback.add_log_values(logs)


def place_before_trackers(handler: Any, callback: LogSource) -> bool:
    """Put a BeforeTrackers for `callback`'s type before the first tracker of `handler` (once).
    False: no tracker before `callback` (its own `on_log` serves)."""
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    callbacks = handler.callbacks
    if any(isinstance(existing, BeforeTrackers) for existing in callbacks):
        return True
    trackers = tuple(INTEGRATION_TO_CALLBACK.values())
    first = next((index for index, existing in enumerate(callbacks) if isinstance(existing, trackers)), None)
    if first is None or callback not in callbacks or first > callbacks.index(callback):
        return False
    callbacks.insert(first, BeforeTrackers(handler, type(callback)))
    return True
