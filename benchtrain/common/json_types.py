"""The names for JSON as read from, or bound for, a file: an object (JsonDict) and one value in it
(JsonValue). The values stay `Any` (a reader checks them where it reads them), and the names keep
`Any` out of signatures between rooms (tests/test_layers.py): anywhere else, a bare `Any` or a
`dict[str, Any]` says a type is missing."""

from __future__ import annotations

from typing import Any, TypeAlias

JsonValue: TypeAlias = Any
JsonDict: TypeAlias = dict[str, JsonValue]
