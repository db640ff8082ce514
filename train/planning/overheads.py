"""Everything a run spends besides its training steps, in one record: the planner prices it from
bench's measurements (train.planning.planner.candidate_overheads) and adds it to the estimate, the
deadline guard keeps what comes after the last step in reserve, run.json records it, `train
--dry-run` shows it; and what a write into the run folder costs at bench's measured bandwidth.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from common.durations import format_duration
from common.json_types import JsonDict


@dataclass(frozen=True)
class Overheads:
    model_build_seconds: float
    warmup_seconds: float
    checkpoint_seconds: float  # one checkpoint save
    checkpoint_count: int  # periodic ones + the final one
    export_seconds: float  # final/ (and final-merged/): their bytes at the write bandwidth
    eval_pass_seconds: float  # one pass over the eval set
    eval_count: int
    report_seconds: float  # 0 with --no-report
    compile_seconds: float = 0.0  # torch.compile: every distinct batch shape once
    compile_shapes: int = 0
    export_bytes: int = 0  # 0: not known (one checkpoint save is counted)
    data_prep_seconds: float = 0.0  # tokenizing the data before training (cold cache), at the sample's measured rate
    upload_seconds: float = 0.0  # --push-to-hub: the upload's bytes at the measured (or stated default) bandwidth

    @property
    def evaluation_seconds(self) -> float:
        return self.eval_pass_seconds * self.eval_count

    @property
    def total_seconds(self) -> float:
        startup = (self.data_prep_seconds, self.model_build_seconds, self.warmup_seconds, self.compile_seconds)
        rest = (self.export_seconds, self.evaluation_seconds, self.report_seconds, self.upload_seconds)
        return sum((*startup, self.checkpoint_seconds * self.checkpoint_count, *rest))

    @property
    def after_training_seconds(self) -> float:
        """What must still fit after the last step: the final checkpoint, the export, the final
        evaluation and the report. The deadline guard keeps it in reserve."""
        return self.checkpoint_seconds + self.export_seconds + self.eval_pass_seconds + self.report_seconds + self.upload_seconds

    @property
    def during_training_seconds(self) -> float:
        """What the run spends between its steps: the periodic checkpoints and evaluations (the
        final ones come after the last step: after_training_seconds)."""
        return self.checkpoint_seconds * max(0, self.checkpoint_count - 1) + self.eval_pass_seconds * max(0, self.eval_count - 1)

    def to_json(self) -> JsonDict:
        return {**asdict(self), "evaluation_seconds": self.evaluation_seconds, "total_seconds": self.total_seconds}

    def lines(self) -> list[str]:
        parts = [
            *([f"tokenizing {format_duration(self.data_prep_seconds)} (rate measured on the sample)"] if self.data_prep_seconds else []),
            f"model build {format_duration(self.model_build_seconds)}",
            f"warm-up {format_duration(self.warmup_seconds)}",
            *([f"compile {format_duration(self.compile_seconds)} ({self.compile_shapes} batch shapes)"] if self.compile_shapes else []),
            f"{self.checkpoint_count} checkpoint{'s' if self.checkpoint_count != 1 else ''} × {format_duration(self.checkpoint_seconds)}",
            f"final/ export {format_duration(self.export_seconds)}" + (f" ({self.export_bytes / 1e6:,.1f} MB)" if self.export_bytes else ""),
        ]
        if self.eval_count:
            parts.append(f"{self.eval_count} evaluation{'s' if self.eval_count != 1 else ''} × {format_duration(self.eval_pass_seconds)}")
        if self.upload_seconds:
            parts.append(f"hub push {format_duration(self.upload_seconds)}")
        parts.append(f"report {format_duration(self.report_seconds)}" if self.report_seconds else "no report")
        return [f"overheads {format_duration(self.total_seconds)} (measured by bench): " + ", ".join(parts)]


def checkpoint_save_seconds(measured: dict[str, float]) -> float:
    """One save: the checkpoint's bytes at the measured write bandwidth, or the timed save."""
    return write_seconds(measured, measured.get("checkpoint_bytes"))


def write_seconds(measured: dict[str, float], size_bytes: float | None) -> float:
    """Seconds to write `size_bytes` into the run folder: at bench's measured write bandwidth, or
    (older calibrations) the timed checkpoint save scaled by bytes, or that save itself."""
    bandwidth, timed = measured.get("disk_write_bytes_per_second"), float(measured.get("checkpoint_save_seconds", 0.0))
    if size_bytes and bandwidth:
        return float(size_bytes) / float(bandwidth)
    checkpoint = measured.get("checkpoint_bytes")
    if size_bytes and checkpoint:
        return timed * float(size_bytes) / float(checkpoint)
    return timed
