"""The names for JSON as read from, or bound for, a file: an object (JsonDict) and one value in it
(JsonValue). A value is left untyped (a reader checks it where it reads it), and the names keep it
out of signatures between rooms (tests/test_layers.py): anywhere else, a bare `Any` says a type is
missing."""

from __future__ import annotations

from typing import Any, TypeAlias

JsonValue: TypeAlias = Any
JsonDict: TypeAlias = dict[str, JsonValue]
