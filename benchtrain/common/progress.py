"""Progress bars that redraw in a terminal and stay quiet (a line every 10 s) in logs."""

from __future__ import annotations

import sys
import time
from typing import Protocol, TextIO

from tqdm.auto import tqdm


class Bar(Protocol):
    """What benchtrain's loops use of a progress bar: a tqdm bar and a BudgetBar alike."""

    def update(self, count: int = 1) -> object: ...

    def set_postfix_str(self, text: str, refresh: bool = True) -> object: ...

    def write(self, text: str) -> object: ...

    def close(self) -> object: ...


def progress_bar(total: int, description: str, unit: str, initial: int = 0, file: TextIO | None = None) -> tqdm:
    return tqdm(
        total=total,
        initial=initial,
        desc=description,
        unit=unit,
        dynamic_ncols=True,
        mininterval=_refresh_seconds(file),
        file=file,
    )


def _refresh_seconds(file: TextIO | None) -> float:
    stream = file if file is not None else sys.stderr
    return 0.2 if getattr(stream, "isatty", lambda: False)() else 10.0


class BudgetBar:
    """A bar over a time budget: its length and time left are the budget's, not a guess from the
    probes done so far (which under a budget would promise far more time than the budget allows).
    The description counts the probes. Same interface as a tqdm bar for what the runner uses."""

    def __init__(self, budget_seconds: float, probes: int, file: TextIO | None = None) -> None:
        self.budget_seconds, self.probes, self.done = budget_seconds, probes, 0
        self.started = time.monotonic()
        shape = "{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f}s of the budget, {remaining} left{postfix}"
        self.bar = tqdm(
            total=round(budget_seconds),
            desc=self._description(),
            bar_format=shape,
            dynamic_ncols=True,
            mininterval=_refresh_seconds(file),
            file=file,
        )

    def _description(self) -> str:
        return f"probe {self.done}/{self.probes}"

    def _tick(self) -> None:
        self.bar.n = min(round(time.monotonic() - self.started), round(self.budget_seconds))
        self.bar.set_description_str(self._description(), refresh=False)
        self.bar.refresh()

    def update(self, count: int = 1) -> None:
        self.done += count
        self._tick()

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.bar.set_postfix_str(text, refresh=False)
        if refresh:
            self._tick()

    def write(self, text: str) -> None:
        self.bar.write(text)

    def close(self) -> None:
        self._tick()
        self.bar.close()
