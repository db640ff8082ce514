"""What a device costs: `--price-per-hour` (a number, KEY=USD pairs or a file of them) per
device-hour, and `run_cost`. The forms: docs/design.md#prices."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from benchtrain.calibration.hardware import Hardware
from benchtrain.common.errors import BenchtrainError

USAGE = "a number (USD per device-hour), KEY=USD pairs (h100=2.5,h200=3.8) or a file of them"


def words(text: str) -> set[str]:
    return {word for word in re.split(r"[^a-z0-9]+", text.lower()) if word}


@dataclass(frozen=True)
class Prices:
    """Prices per device-hour as given: by key (words of a device's name, or a calibration id), in
    the order given; `default` applies to any device no key names."""

    default: float | None = None
    by_key: Mapping[str, float] = field(default_factory=dict)

    def for_device(self, calibration_id: str, hardware: Hardware) -> float | None:
        """The price of the device a calibration measured: a key equal to its id, else the most
        specific key whose words all name the device (its name, table entry, or `cpu`/`cuda`),
        else the default; None when no price was given; an error when prices were given but none
        is for this device."""
        if self.default is None and not self.by_key:
            return None
        if calibration_id in self.by_key:
            return self.by_key[calibration_id]
        device = words(f"{hardware.name} {hardware.peak_flops_entry or ''} {hardware.device_type}")
        matching = [
            (len(words(key)), key, price) for key, price in self.by_key.items() if words(key) and words(key) <= device
        ]
        if matching:
            best = max(size for size, _, _ in matching)
            named = {price for size, _, price in matching if size == best}
            if len(named) > 1:
                keys = ", ".join(key for size, key, _ in matching if size == best)
                raise BenchtrainError(
                    f"--price-per-hour: {keys} all name {hardware.name} with different prices: keep one"
                )
            return named.pop()
        if self.default is not None:
            return self.default
        given = ", ".join(self.by_key)
        raise BenchtrainError(
            f"--price-per-hour has no price for {hardware.name} (calibration {calibration_id}; prices given for {given}): "
            f"add {suggested_key(hardware)}=USD"
        )


def suggested_key(hardware: Hardware) -> str:
    """The key a user would write for a device: its table entry's first word (h100), else `cpu`."""
    if hardware.device_type == "cpu":
        return "cpu"
    entry = hardware.peak_flops_entry or (hardware.name or "gpu").replace("NVIDIA", "")
    return entry.split()[0].lower() if entry.split() else "gpu"


def parse_prices(value: str | float | None) -> Prices:
    """`--price-per-hour` as given: None, a number, KEY=USD pairs, or a file of them."""
    if value is None:
        return Prices()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return Prices(default=_price(str(value), str(value)))
    text = str(value).strip()
    path = Path(text).expanduser()
    if "=" not in text and path.is_file():
        return _parse_file(path)
    return _parse_pairs([part for part in text.split(",") if part.strip()], text)


def _parse_file(path: Path) -> Prices:
    try:
        content = path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise BenchtrainError(f"--price-per-hour: cannot read {path}: {error}") from None
    if content.lstrip().startswith("{"):
        try:
            table = json.loads(content)
        except json.JSONDecodeError as error:
            raise BenchtrainError(f"--price-per-hour: {path} is not valid JSON: {error}") from None
        return _parse_pairs([f"{key}={price}" for key, price in table.items()], str(path))
    lines = [line.split("#", 1)[0].strip() for line in content.splitlines()]
    return _parse_pairs([line for line in lines if line], str(path))


def _parse_pairs(parts: list[str], source: str) -> Prices:
    if not parts:
        raise BenchtrainError(f"--price-per-hour {source!r} holds no price: {USAGE}")
    default: float | None = None
    by_key: dict[str, float] = {}
    for part in parts:
        if "=" not in part:
            if default is not None:
                raise BenchtrainError(
                    f"--price-per-hour {source!r} has two prices without a device: name the devices (h100=2.5)"
                )
            default = _price(part, source)
            continue
        key, _, amount = part.partition("=")
        key = key.strip()
        if not key or key.lower() in {known.lower() for known in by_key}:
            raise BenchtrainError(
                f"--price-per-hour {source!r}: {'an empty' if not key else 'a repeated'} device name in {part.strip()!r}"
            )
        by_key[key] = _price(amount, source)
    return Prices(default, by_key)


def _price(text: str, source: str) -> float:
    try:
        price = float(text.strip().lstrip("$"))
    except ValueError:
        raise BenchtrainError(f"--price-per-hour {source!r}: {text.strip()!r} is not a price; give {USAGE}") from None
    if not (price >= 0 and math.isfinite(price)):
        raise BenchtrainError(
            f"--price-per-hour {source!r}: a price must be a non-negative number, got {text.strip()!r}"
        )
    return price


def run_cost(seconds: float, price_per_hour: float | None, processes: int = 1) -> float | None:
    """Hours × the price per device-hour × the devices (one per process); None without a price."""
    if price_per_hour is None:
        return None
    return seconds / 3600 * price_per_hour * max(1, processes)
