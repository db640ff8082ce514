"""Two captures of benchmarks/same_behaviour.sh compared: the exit codes exactly; every run.json's
and saved JSON's key tree (a key's value type aside from null vs a number), and the key tree of a
command's JSON output; every command's output with numbers, durations, run folders, time stamps and
the words that follow the clock (higher/lower, took longer/less) masked and the live progress lines
left out; the files each command left, by
name. A bench's measured figures differ at every run: its calibration is compared by its keys
(what is null in either capture aside) and its output by the labels of its lines, not its numbers.

    python benchmarks/same_behaviour.py BEFORE AFTER    # prints each difference, then their count
"""

from __future__ import annotations

import difflib
import json
import re
import sys
from pathlib import Path
from typing import Any

PROGRESS = re.compile(r"^(train|tokenizing|Writing|Loading|probe)\S*[: ]")
# Said every few seconds of a run, and by the guard as the live speed changes: how many, and whether
# on track, follow the machine's load.
LIVE = re.compile(r"^(step N: N tok/s actual|deadline: step N: |warning: the calibration's Nth-percentile error)")
BENCH_OUTPUT = "bench.out"
BENCH_CALIBRATION = Path("bench") / "calibration.json"
# What a bench says only when the machine was busy, a probe unsteady, or the fit chose the overlap form.
MEASURED_ONLY = re.compile(r"^(warning|note|re-measured|Host and device overlap)\b")


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


def dict_keys(value: Any, prefix: str = "") -> tuple[set[str], set[str]]:
    """The key paths of the dicts inside dicts (lists not entered: how many probes, warnings or
    re-measurements a bench has depends on the machine), and the paths whose value is null."""
    keys: set[str] = set()
    nulls: set[str] = set()
    if isinstance(value, dict):
        for key, inner in value.items():
            path = f"{prefix}/{key}"
            keys.add(path)
            if inner is None:
                nulls.add(path)
            inner_keys, inner_nulls = dict_keys(inner, path)
            keys |= inner_keys
            nulls |= inner_nulls
    return keys, nulls


# Which of the fit's forms could be fitted (and so compared) follows the measurements.
MEASURED_KEYS = ("/fit/alternatives/",)


def bench_key_differences(old: Any, new: Any) -> list[str]:
    (old_keys, old_nulls), (new_keys, new_nulls) = dict_keys(old), dict_keys(new)
    left_out = tuple(null + "/" for null in old_nulls | new_nulls) + MEASURED_KEYS
    return sorted(path for path in old_keys ^ new_keys if not path.startswith(left_out))


def masked(text: str, folder: Path) -> list[str]:
    text = text.replace("\r", "\n").replace(str(folder), "DIR")
    for pattern, mask in (
        (r"\d{8}-\d{6}", "STAMP"),
        (r"[0-9a-f]{24}", "HASH"),
        (r"\d[\d,.]*", "N"),
        (r"[+-]N", "±N"),
        (r"\b(higher|lower)\b", "H/L"),
    ):
        text = re.sub(pattern, mask, text)
    text = re.sub(r"took (longer|less time) than", "took L/S than", text)
    # A resume plans from the history its interrupted run left: how fast that went decides which
    # bound the deadline is checked against, and whether the spread is too wide to promise one.
    text = re.sub(r"(upper bound|central estimate) fits", "BOUND fits", text)
    # A duration's units follow its size (58.9s, 1m02s, 2h00m): masked whole.
    text = re.sub(r"\bN[hms](?:N[hms])*\b", "DURATION", text)
    return [
        line.rstrip()
        for line in text.split("\n")
        if line.strip() and not PROGRESS.match(line.strip()) and not LIVE.match(line.strip())
    ]


def labels(lines: list[str]) -> list[str]:
    """A bench's output as the labels of its lines (what precedes the first colon, else the first
    word), each once: which lines it prints, not what it measured."""
    found = set()
    for line in lines:
        line = line.strip()
        if MEASURED_ONLY.match(line):
            continue
        found.add(line.split(":")[0] + ":" if ":" in line else line.split()[0])
    return sorted(found)


def json_output(text: str) -> Any:
    """The JSON a command printed (after any progress lines), or None."""
    start = re.search(r"^[{\[]", text, flags=re.M)
    if start is None:
        return None
    try:
        return json.loads(text[start.start() :])
    except json.JSONDecodeError:
        return None


def compare_lines(name: str, old: list[str], new: list[str]) -> list[str]:
    lines = list(difflib.unified_diff(old, new, lineterm="", n=0))
    return [f"{name}:\n" + "\n".join(lines[2:40])] if lines else []


def differences(before: Path, after: Path) -> list[str]:
    found = []
    old_codes, new_codes = (
        sorted((before / "rc.txt").read_text().split("\n")),
        sorted((after / "rc.txt").read_text().split("\n")),
    )
    found += compare_lines("rc.txt", [line for line in old_codes if line], [line for line in new_codes if line])
    for path in sorted(before.rglob("run.json")) + sorted(before.glob("*.json")):
        other = after / path.relative_to(before)
        if not other.exists():
            found.append(f"{other} is missing")
            continue
        old, new = key_tree(json.loads(path.read_text())), key_tree(json.loads(other.read_text()))
        if old != new:
            found.append(f"{path.relative_to(before)}: only before {sorted(old - new)}, only after {sorted(new - old)}")
    if (before / BENCH_CALIBRATION).exists():
        other = after / BENCH_CALIBRATION
        if not other.exists():
            found.append(f"{other} is missing")
        else:
            keys = bench_key_differences(
                json.loads((before / BENCH_CALIBRATION).read_text()), json.loads(other.read_text())
            )
            found += [f"{BENCH_CALIBRATION}: keys in one capture only {keys}"] if keys else []
    for path in sorted(before.glob("*.out")):
        other = after / path.name
        if not other.exists():
            found.append(f"{other} is missing")
            continue
        old_text, new_text = path.read_text(), other.read_text()
        old_lines, new_lines = masked(old_text, before), masked(new_text, after)
        if path.name == BENCH_OUTPUT:
            found += compare_lines(path.name, labels(old_lines), labels(new_lines))
            continue
        found += compare_lines(path.name, old_lines, new_lines)
        old_json, new_json = json_output(old_text), json_output(new_text)
        if old_json is not None and key_tree(old_json) != key_tree(new_json):
            old, new = key_tree(old_json), key_tree(new_json)
            found.append(f"{path.name} (its JSON): only before {sorted(old - new)}, only after {sorted(new - old)}")
    if (before / "files.txt").exists():
        old_files = sorted(set(masked((before / "files.txt").read_text(), before)))
        new_files = sorted(set(masked((after / "files.txt").read_text(), after)))
        found += compare_lines("files.txt", old_files, new_files)
    return found


if __name__ == "__main__":
    found = differences(Path(sys.argv[1]), Path(sys.argv[2]))
    print("\n".join(found))
    print(f"differences: {len(found)}")
