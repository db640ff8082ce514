"""The bundled sample data: `--data sample` (text) and `--data sample-chat` (messages)."""

from __future__ import annotations

from pathlib import Path

SAMPLES = {"sample": "sample.jsonl", "sample-chat": "sample_chat.jsonl"}
SAMPLE_FOLDER = Path(__file__).resolve().parents[1] / "sample_data"


def bundled_sample(name: str) -> str:
    return str(SAMPLE_FOLDER / SAMPLES[name])


def resolve_data_path(value: str) -> str:
    return bundled_sample(value) if value in SAMPLES else value
