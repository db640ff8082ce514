"""The README.md card of a repository of shared calibrations (calibration.hub): what each one
measured, on what, with what, and who measured it — a table a person reads before renting.

Pure functions over the calibrations' JSON dicts; every cell is escaped (a value is data from
someone else's file, never markdown of ours).
"""

from __future__ import annotations

from typing import Any

from calibration.schema import SCHEMA_VERSION
from calibration.setup import Variant, measured_setup, quantization_name, variant_of
from common.json_types import JsonDict

COLUMNS = ("id", "device", "interconnect", "model", "method", "quantization", "processes", "software", "created", "measured by")


def card_text(repo_id: str, calibrations: dict[str, JsonDict | None]) -> str:
    """The card for `calibrations` (file in the repository → its data; None: a file that cannot be
    read), newest first."""
    readable = sorted((data for data in calibrations.values() if data), key=lambda data: str(data.get("created_at", "")), reverse=True)
    damaged = sorted(name for name, data in calibrations.items() if not data)
    lines = [
        "---",
        "tags:",
        "- benchtrain",
        "- benchtrain-calibration",
        "---",
        "",
        f"# Training-step calibrations: {repo_id}",
        "",
        "Each file in `calibrations/` is one benchtrain calibration "
        f"(JSON, schema version {SCHEMA_VERSION}): a training step measured across micro batch, accumulation, workers and "
        "sequence length on one machine, the throughput and memory model fitted to it, and its held-out error. "
        "Plan a run with them before renting the machine:",
        "",
        "```bash",
        f"train --dry-run --use-calibration hub:{repo_id} --model MODEL --data DATA --deadline 12h       # every calibration here of that model",
        f"train --dry-run --use-calibration all,hub:{repo_id} --model MODEL --data DATA --deadline 12h   # beside your own",
        f"train --use-calibration hub:{repo_id}/ID --model MODEL --data DATA --deadline 12h              # one of them",
        "```",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
        *("| " + " | ".join(cell(value) for value in card_row(data)) + " |" for data in readable),
    ]
    if damaged:
        lines += ["", "Files that cannot be read as calibrations (left out of every plan): " + ", ".join(f"`{cell(name)}`" for name in damaged)]
    return "\n".join(lines) + "\n"


def card_row(data: JsonDict) -> list[str]:
    hardware, software = data.get("hardware") or {}, data.get("software") or {}
    setup = measured_setup(data)
    return [
        str(data.get("id", "?")),
        str(hardware.get("name", "?")),
        interconnect(hardware.get("interconnect")),
        setup.model_name,
        f"LoRA r{setup.lora_rank}" if setup.method == "lora" and setup.lora_rank else setup.method,
        ", ".join(dict.fromkeys(quantization_name(quantize) or "none" for quantize, _ in variants(data))),
        f"{setup.world_size}" + (f" ({setup.sharding})" if setup.sharding != "none" else ""),
        versions(software, hardware),
        str(data.get("created_at", "?")),
        str(data.get("measured_by") or "unknown"),
    ]


def variants(data: JsonDict) -> list[Variant]:
    """Each variant the file measured (calibration.schema.variant_data)."""
    return [variant_of(entry) for entry in (data, *(data.get("variants") or []))]


def interconnect(value: Any) -> str:
    """What joined the devices, as the hardware record says it (absent from older calibrations)."""
    if isinstance(value, dict):
        value = value.get("kind") or value.get("name") or ", ".join(f"{key} {item}" for key, item in value.items())
    return str(value) if value else "–"


def versions(software: JsonDict, hardware: JsonDict) -> str:
    cuda = software.get("cuda") or hardware.get("cuda_version")
    named = [("torch", software.get("torch")), ("transformers", software.get("transformers")), ("CUDA", cuda)]
    return ", ".join(f"{name} {version}" for name, version in named if version) or "–"


def cell(value: Any) -> str:
    """A table cell: on one line, its pipes escaped, HTML's angle brackets as entities."""
    text = " ".join(str(value).split())
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
