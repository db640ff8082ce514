"""The Trainer's training loop as a frame on the main thread's stack: while it is there, the run
the callback started is alive; once it is gone, train() has exited — normally, or by an exception
(after which the Trainer calls no callback). Handlers and hooks the callback left behind check it
and step aside, so a failed run never keeps the user's signals or counts their forward passes."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any, NamedTuple

# How far up the stack the callback's caller is looked for (the handler's frames, a subclass's super() calls).
SEARCH_DEPTH = 12


@dataclass(frozen=True)
class TrainingFrame:
    frame_id: int  # the loop's frame, by identity (holding the frame itself would keep the run's objects alive)
    code: CodeType

    def live(self, frame: FrameType | None) -> bool:
        """Whether the training loop is still on the stack that `frame` (the running one) sits on."""
        while frame is not None:
            if id(frame) == self.frame_id and frame.f_code is self.code:
                return True
            frame = frame.f_back
        return False


def current_frame() -> FrameType:
    """The caller's frame (for a hook's check)."""
    return sys._getframe(1)


class Caller(NamedTuple):
    handler: Any  # the transformers CallbackHandler calling the callback
    training: TrainingFrame | None  # the frame that called the handler: the training loop


def find_caller(callback: object) -> Caller | None:
    """Who called `callback` (from inside one of its events): the Trainer's CallbackHandler and the
    frame that called it, or None where no CallbackHandler called it."""
    from transformers.trainer_callback import CallbackHandler

    frame: FrameType | None = sys._getframe(1)
    handler: Any = None
    for _ in range(SEARCH_DEPTH):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if isinstance(owner, CallbackHandler) and callback in owner.callbacks:
            handler = owner
        elif handler is not None:
            return Caller(handler, TrainingFrame(id(frame), frame.f_code))
        frame = frame.f_back
    return Caller(handler, None) if handler is not None else None
