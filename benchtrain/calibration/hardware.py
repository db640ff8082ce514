"""The device a calibration measured, or the one a plan is for (train.step.hardware.detect_hardware writes the
same record): typed once where a record is read, so that its readers name fields, not keys."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from benchtrain.common.json_types import JsonDict


@dataclass(frozen=True)
class Hardware:
    """One device record: what plans and checks read, typed; the rest (versions, cores, the host's resident bytes)
    kept in `record` as stored, so that a run.json or a translated calibration writes the record it read."""

    device_type: str  # "cuda" | "cpu"
    name: str
    count: int
    memory_bytes: int
    peak_flops_entry: str | None = None  # calibration.datasheets' `peak_entry` ("A100"); None: unknown or a CPU
    peak_bf16_flops: float | None = None
    interconnect: str | None = None  # calibration.topology's word; absent from older records
    nvlinks: int | None = None
    compute_capability: str | None = None  # "9.0"; CUDA only
    memory_from: str | None = None  # "--device-memory" where the user gave the memory, not the device
    translated: bool = False  # a datasheet's figures, not a measured device's (calibration.translate)
    record: JsonDict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_record(cls, record: JsonDict) -> Hardware:
        """A stored or detected record (calibration.schema checked the four required keys of a calibration's)."""
        peak = record.get("peak_bf16_flops")
        return cls(
            device_type=str(record.get("device_type", "")),
            name=str(record.get("name", "")),
            count=int(record.get("count") or 1),
            memory_bytes=int(record.get("memory_bytes") or 0),
            peak_flops_entry=_text(record.get("peak_flops_entry")),
            peak_bf16_flops=float(peak) if peak is not None else None,
            interconnect=_text(record.get("interconnect")),
            nvlinks=int(record["nvlinks"]) if record.get("nvlinks") is not None else None,
            compute_capability=_text(record.get("compute_capability")),
            memory_from=_text(record.get("memory_from")),
            translated=bool(record.get("translated")),
            record=dict(record),
        )

    def to_record(self) -> JsonDict:
        """The record as stored, with the typed fields as they now are (a field the record lacked and left unset stays out)."""
        out = dict(self.record)
        for one in fields(self):
            value = getattr(self, one.name)
            if one.name != "record" and (one.name in out or value not in (None, False)):
                out[one.name] = value
        return out

    def with_memory(self, memory_bytes: int, source: str | None = None) -> Hardware:
        """This device planned with `memory_bytes` (`train --device-memory`, `--device-memory` of a comparison)."""
        return replace(self, memory_bytes=memory_bytes, memory_from=source or self.memory_from)

    def same_device(self, other: Hardware) -> bool:
        return self.name == other.name and self.device_type == other.device_type


def _text(value: object) -> str | None:
    return None if value is None else str(value)
