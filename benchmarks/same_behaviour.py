"""Two captures of benchmarks/same_behaviour.sh compared: every run.json's key tree (a key's
value type aside from null vs a number) and every command's output with numbers, run folders,
time stamps and the words that follow the clock (higher/lower, took longer/less) masked.

    python benchmarks/same_behaviour.py BEFORE AFTER    # prints each difference, then their count
"""

from __future__ import annotations

import difflib
import json
import re
import sys
from pathlib import Path
from typing import Any

PROGRESS = re.compile(r"^(train|tokenizing|Writing|Loading)\S*[: ]")


def key_tree(value: Any, prefix: str = "") -> set[str]:
    keys: set[str] = set()
    if isinstance(value, dict):
        for key, inner in value.items():
            leaf = not isinstance(inner, (dict, list)) or not inner
            kind = {"NoneType": "num", "int": "num", "float": "num"}.get(type(inner).__name__, type(inner).__name__)
            keys.add(f"{prefix}/{key}:{kind}" if leaf else f"{prefix}/{key}")
            keys |= key_tree(inner, f"{prefix}/{key}")
    elif isinstance(value, list) and value:
        keys |= key_tree(value[0], prefix + "[]")
    return keys


def masked(text: str, folder: Path) -> list[str]:
    text = text.replace("\r", "\n").replace(str(folder), "DIR")
    for pattern, mask in ((r"\d{8}-\d{6}", "STAMP"), (r"[0-9a-f]{24}", "HASH"), (r"\d[\d,.]*", "N"), (r"[+-]N", "±N"), (r"\b(higher|lower)\b", "H/L")):
        text = re.sub(pattern, mask, text)
    text = re.sub(r"took (longer|less time) than", "took L/S than", text)
    return [line.rstrip() for line in text.split("\n") if line.strip() and not PROGRESS.match(line.strip())]


def differences(before: Path, after: Path) -> list[str]:
    found = []
    for path in sorted(before.rglob("run.json")) + sorted(before.glob("*.json")):
        other = after / path.relative_to(before)
        if not other.exists():
            found.append(f"{other} is missing")
            continue
        old, new = key_tree(json.loads(path.read_text())), key_tree(json.loads(other.read_text()))
        if old != new:
            found.append(f"{path.relative_to(before)}: only before {sorted(old - new)}, only after {sorted(new - old)}")
    for path in [*sorted(before.glob("*.out")), before / "rc.txt"]:
        diff = difflib.unified_diff(masked(path.read_text(), before), masked((after / path.name).read_text(), after), lineterm="", n=0)
        lines = list(diff)
        if lines:
            found.append(f"{path.name}:\n" + "\n".join(lines[2:40]))
    return found


if __name__ == "__main__":
    found = differences(Path(sys.argv[1]), Path(sys.argv[2]))
    print("\n".join(found))
    print(f"differences: {len(found)}")
