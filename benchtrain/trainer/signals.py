"""SIGTERM and SIGUSR1 (SLURM's `--signal`, a spot instance's notice, `kill`) and a first Ctrl-C
(SIGINT; a second one interrupts at once, as without the callback) as a flag the
callback reads at the next point the Trainer allows a save: the end of a step, or a batch of an
evaluation under way. The handler only sets the flag: a save started inside a signal handler
would run in the middle of whatever the step was doing.

The handlers that were there before (a SLURM requeue handler the user installed) still run, after
the flag is set. They come back at any exit of train(): at its end; after an exception (the
Trainer calls no callback then) the first signal finds the training loop gone from the stack,
puts them back and hands itself to them, and the next train() (a retry, `auto_find_batch_size`'s
included) takes them over from the stale handler — ours is never recorded as the one to restore."""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from benchtrain.trainer.training_frame import TrainingFrame

SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")


@dataclass
class SignalFlag:
    received: int | None = None  # the signal's number, once one came
    _previous: dict[int, Any] = field(default_factory=dict)
    _training: TrainingFrame | None = None  # the run's loop; None: alive until restored

    def install(self, training: TrainingFrame | None = None) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # Python delivers signals to the main thread only: a Trainer on another thread is not signalled
        self._training = training
        for name in SIGNALS:
            number = getattr(signal, name, None)
            if number is None:
                continue
            current = signal.getsignal(number)
            owner = _flag_of(current)
            if owner is self:
                continue
            # A flag of a run that ended by an exception is still installed: the handler before it is the one to keep.
            self._previous[number] = owner._previous.get(number, signal.SIG_DFL) if owner is not None else current
            signal.signal(number, self._on_signal)

    def restore(self) -> None:
        """The handlers that were there before (the user's, or the default), where ours is still the
        one installed (one installed after ours during the run is the user's choice, and stays)."""
        if threading.current_thread() is threading.main_thread():
            for number, handler in self._previous.items():
                if _flag_of(signal.getsignal(number)) is self:
                    signal.signal(number, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def _on_signal(self, number: int, frame: FrameType | None) -> None:
        previous = self._previous.get(number, signal.SIG_DFL)
        if self._training is not None and not self._training.live(frame):
            self.restore()  # train() is over: the signal is the earlier handler's, as if we had never been here
            _deliver(previous, number, frame)
            return
        if number == signal.SIGINT and self.received is not None:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, as without the callback
        self.received = number
        if callable(previous) and previous is not signal.default_int_handler:
            previous(number, frame)  # the user's own handler, after ours (Python's own Ctrl-C would interrupt the save)


def _flag_of(handler: Any) -> SignalFlag | None:
    """The SignalFlag whose handler `handler` is, if it is one."""
    owner = getattr(handler, "__self__", None)
    return (
        owner if isinstance(owner, SignalFlag) and getattr(handler, "__func__", None) is SignalFlag._on_signal else None
    )


def _deliver(handler: Any, number: int, frame: FrameType | None) -> None:
    """What `handler` (a Python handler, SIG_DFL or SIG_IGN) does with the signal."""
    if callable(handler):
        handler(number, frame)
    elif handler == signal.SIG_IGN:
        return
    elif number == signal.SIGINT:
        raise KeyboardInterrupt
    else:
        signal.raise_signal(number)  # the default action (end the process), its handler now back
