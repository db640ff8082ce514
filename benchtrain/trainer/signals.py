"""SIGTERM and SIGUSR1 (SLURM's `--signal`, a spot instance's notice, `kill`) and a first Ctrl-C
(SIGINT; a second one interrupts at once, as without the callback) as a flag the
callback reads at the next point the Trainer allows a save: the end of a step, or a batch of an
evaluation under way. The handler only sets the flag: a save started inside a signal handler
would run in the middle of whatever the step was doing."""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")


@dataclass
class SignalFlag:
    received: int | None = None  # the signal's number, once one came
    _previous: dict[int, Any] = field(default_factory=dict)

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # Python delivers signals to the main thread only: a Trainer on another thread is not signalled
        for name in SIGNALS:
            number = getattr(signal, name, None)
            if number is not None:
                self._previous[number] = signal.signal(number, self._on_signal)

    def restore(self) -> None:
        """The handlers that were there before (the user's, or the default)."""
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}

    def _on_signal(self, number: int, frame: FrameType | None) -> None:
        if number == signal.SIGINT and self.received is not None:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, as without the callback
        self.received = number
