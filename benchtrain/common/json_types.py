"""The one name for a JSON object as read from, or bound for, a file: its values stay `Any` (a
reader checks them where it reads them), and the name keeps `Any` out of signatures between rooms
(tests/test_layers.py): anywhere else, a bare `Any` or a `dict[str, Any]` says a type is missing."""

from __future__ import annotations

from typing import Any, TypeAlias

JsonDict: TypeAlias = dict[str, Any]
