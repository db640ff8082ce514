"""Free space on a disk, before anything is written to it."""

from __future__ import annotations

import shutil
from pathlib import Path

GB = 1e9


def free_bytes(folder: Path) -> int:
    """Free space where `folder` is (or would be created)."""
    probe = Path(folder).resolve()
    while not probe.exists():
        probe = probe.parent
    return shutil.disk_usage(probe).free
