"""The measurements of a bench under way, on disk after every probe (never a calibration).
Why: docs/design.md#bench-unfinished
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any, ClassVar

from calibration.store import UNFINISHED_KEY, keep_unfinished, list_unfinished, new_id
from common.console import say
from common.errors import EXIT_INTERNAL, BenchtrainError

WHAT_IT_IS = "the measurements of a bench that had not finished: not a calibration (no fit); `bench run` measures again"


class BenchStopped(BenchtrainError):
    """A bench that failed after some probes: what failed, and where the rows measured are."""

    exit_code = EXIT_INTERNAL


class KeptRows:
    """Rank 0's measurements so far, rewritten whole (atomically) after every probe."""

    # This process's files (one per setup of `bench run --quantize/--optimizer …`): not earlier benches'.
    written_here: ClassVar[set[Path]] = set()

    def __init__(self, task: Any, started: datetime | None = None) -> None:
        started = started or datetime.now(timezone.utc)
        self.path: Path | None = None
        self.rows: list[dict[str, Any]] = []
        self.head = {
            "id": new_id(task.device_label, task.model.get("name", "model"), started),
            "created_at": started.isoformat(timespec="seconds"),
            "unfinished": WHAT_IT_IS,
            "hardware": task.hardware,
            "software": task.software,
            "model": task.model,
            "training": task.training,
            "requested_device": task.requested_device,
            "data": task.data,
            "processes": {"world_size": task.world_size, "sharding": task.sharding},
            "search": {"method": task.search, "space": task.space.as_dict()},
        }

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        first = self.path is None
        self.path = keep_unfinished({**self.head, "measurements": self.rows}, self.path)
        if first:
            KeptRows.written_here.add(self.path)
            others = [path for path, _, _ in list_unfinished() if path not in KeptRows.written_here]
            earlier = f"; earlier benches that did not finish left theirs in {', '.join(map(str, others))}" if others else ""
            say(f"measurements so far are kept in {self.path} until the calibration is stored{earlier}")

    def name_in(self, record: dict[str, Any]) -> None:
        """Let `record` name the file, which storing it (or keeping it as failed) removes."""
        if self.path is not None:
            record[UNFINISHED_KEY] = str(self.path)

    def stopped(self, error: BaseException) -> BenchStopped:
        """What to raise (from `error`, which --debug shows) for a bench that failed with `error`
        after some rows were kept: one line that says where they are."""
        ok = sum(1 for row in self.rows if row.get("status") == "ok")
        cause = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"[:300]
        stopped = BenchStopped(
            f"the bench stopped after {len(self.rows)} probes ({ok} ok), on {cause}; "
            f"the measurements so far are kept in {self.path} (not a calibration; `bench list` names it)"
        )
        stopped.exit_code = getattr(error, "exit_code", EXIT_INTERNAL)  # a problem the user can fix keeps its code
        return stopped
