"""The package that made a plan, as a wheel the launched task installs: the files of the benchtrain that is running now
(its source tree when installed editable), zipped as pip installs them, with the installed distribution's metadata and
commands. A task then installs exactly the code that planned it, never a registry name. docs/launch.md#what-the-task-holds-and-where-each-figure-comes-from."""

from __future__ import annotations

import base64
import hashlib
import io
import zipfile
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from benchtrain.common.atomic import write_bytes_atomic

NAME = "benchtrain"
WHEEL_FILE = "Wheel-Version: 1.0\nGenerator: benchtrain (train --emit)\nRoot-Is-Purelib: true\nTag: py3-none-any\n"


def wheel_name(version: str) -> str:
    return f"{NAME}-{version}-py3-none-any.whl"


def package_files() -> list[tuple[str, Path]]:
    """(name in the wheel, file here) for every file of the running package: code and data, no bytecode."""
    root = Path(__file__).resolve().parents[1]  # benchtrain/, this module being benchtrain/train/package_wheel.py
    return [
        (f"{NAME}/{path.relative_to(root).as_posix()}", path)
        for path in sorted(root.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts and path.suffix not in (".pyc", ".pyo")
    ]


def metadata_files(version: str) -> dict[str, str]:
    """METADATA (its dependencies: what pip installs beside it) and entry_points.txt (bench, train, report), as the
    installed distribution holds them; without one, the name and version alone."""
    try:
        installed = distribution(NAME)
        metadata = installed.read_text("METADATA")
        entry_points = installed.read_text("entry_points.txt")
    except PackageNotFoundError:
        metadata, entry_points = None, None
    lines = (metadata or f"Metadata-Version: 2.1\nName: {NAME}\n").splitlines()
    # The version the wheel is named by, whatever the installed metadata says.
    lines = [f"Version: {version}" if line.startswith("Version:") else line for line in lines]
    if not any(line.startswith("Version:") for line in lines):
        lines.insert(2, f"Version: {version}")
    files = {"METADATA": "\n".join(lines) + "\n", "WHEEL": WHEEL_FILE}
    if entry_points:
        files["entry_points.txt"] = entry_points
    return files


def record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build_wheel(folder: Path, version: str) -> Path:
    """The running benchtrain as `folder/benchtrain-VERSION-py3-none-any.whl`, written atomically (the folder exists)."""
    path = folder / wheel_name(version)
    info = f"{NAME}-{version}.dist-info"
    entries = [(name, file.read_bytes()) for name, file in package_files()]
    entries += [(f"{info}/{name}", text.encode()) for name, text in metadata_files(version).items()]
    record = [record_line(name, data) for name, data in entries] + [f"{info}/RECORD,,"]
    entries.append((f"{info}/RECORD", ("\n".join(record) + "\n").encode()))
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in entries:
            archive.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), data, zipfile.ZIP_DEFLATED)
    write_bytes_atomic(path, buffer.getvalue())  # the caller says what an OSError means
    return path
