"""`BENCHTRAIN_HOME` (default `~/.benchtrain`): `calibrations/`, `runs/`, `studies/`."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from benchtrain.common.errors import BenchtrainError


def benchtrain_home() -> Path:
    return Path(os.environ.get("BENCHTRAIN_HOME", "~/.benchtrain")).expanduser()


def writable_subdir(name: str) -> Path:
    """`BENCHTRAIN_HOME/name`, created and checked writable, or a one-line error."""
    folder = benchtrain_home() / name
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".probe-"):
            pass
    except OSError as error:
        raise BenchtrainError(
            f"BENCHTRAIN_HOME folder {folder} is not writable ({error.strerror or error}); set BENCHTRAIN_HOME to a folder you can write"
        ) from None
    return folder
