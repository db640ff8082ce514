"""A test-only hook that stops a process at a named phase, so a test can kill it there and no sooner or later: the
kill-at-every-phase tests of the launch scripts (tests/test_launch_phases.py) kill a run during bench, a step, a
checkpoint write, an evaluation, the export and the report, each time at that moment. The phases, as the code names
them: bench (a probe), step (before it runs), checkpoint (its files written, not sealed), evaluation, export (final/
written, not yet in place), report (its figures drawn, the page not written).

`BENCHTRAIN_TEST_PAUSE_AT=PHASE` (or `PHASE:STEP`, the optimizer step it is at) makes every process that reaches
`pause_at(PHASE)` add a line to `BENCHTRAIN_TEST_PAUSE_FILE` (where set: a test waits for as many lines as processes
it expects there) and sleep until it is killed. `BENCHTRAIN_TEST_STEP_SECONDS=S` makes each step wait S seconds before
it runs: a run on the tiny model then lasts long enough for a scheduler's signal to reach it mid-run (SLURM checks its
`--signal` times about every 30 s) without spending CPU. Unset, as they are outside the tests, each costs one look at
the environment and does nothing; they never run anything and never change what is written."""

from __future__ import annotations

import os
import time
from pathlib import Path

PAUSE_AT = "BENCHTRAIN_TEST_PAUSE_AT"
PAUSE_FILE = "BENCHTRAIN_TEST_PAUSE_FILE"
STEP_SECONDS = "BENCHTRAIN_TEST_STEP_SECONDS"


def pause_at(phase: str, step: int | None = None) -> None:
    """Sleep here until killed when BENCHTRAIN_TEST_PAUSE_AT names `phase` (and `step`, where it names one); before a
    step, wait BENCHTRAIN_TEST_STEP_SECONDS where set."""
    delay = os.environ.get(STEP_SECONDS) if phase == "step" else None
    if delay:
        time.sleep(float(delay))
    wanted = os.environ.get(PAUSE_AT)
    if not wanted:
        return
    name, _, at = wanted.partition(":")
    if name != phase or (at and str(step) != at):
        return
    marker = os.environ.get(PAUSE_FILE)
    if marker:
        with Path(marker).open("a") as paused:
            paused.write(f"{phase} {step if step is not None else ''} {os.getpid()}\n")
    while True:
        time.sleep(3600)
