"""The dimensions of a training step, one entry each in `DIMENSIONS` (sizes and switches): what bench
enumerates, a measurement row holds, the fits see and a plan chooses. Why: docs/design.md#dimensions-of-a-step"""

from __future__ import annotations

from dataclasses import dataclass

# What a term is proportional to, when its switch is on: once per micro-step, per token (B·S), or per token × length (B·S², attention).
SCALES = ("step", "tokens", "attention")


@dataclass(frozen=True)
class Term:
    name: str  # the fitted parameter's name in the calibration file
    scale: str  # one of SCALES
    device: bool = True  # device compute (overlaps with the host's launch time) or an added cost


@dataclass(frozen=True)
class Dimension:
    name: str  # StepConfig's field (sizes) or switch, and the measurement row's column
    axis: str  # the search space's name for its values (the calibration's `space`; a setup's: "checkpointing off+on")
    flag: str  # `bench run`'s option listing its values
    help: str  # that option's help
    minimum: int = 1  # a size's least value
    switch: bool = False
    # Switches only:
    label: str = ""  # bench's lines name a step with it on: B8/W0/A1/S512/ckpt
    phrase: str = ""  # plans name it: "batch 8 × accum 1, 0 workers, max length 512, gradient checkpointing"
    plan_flag: str = ""  # `train`'s option: auto (what the calibration measured), on or off
    plan_help: str = ""  # that option's help
    applier: str = ""  # what it does to a built model: its applier's name in train.step.switches.APPLIERS
    throughput: tuple[Term, ...] = ()  # the throughput fit's terms it adds
    memory: tuple[Term, ...] = ()  # the memory fit's terms it adds
    activations: tuple[str, str] | None = (
        None  # memory: the per-token and attention terms that replace the plain ones when on
    )
    leaner: bool = False  # on holds less memory than off
    smoother_spread: float | None = None  # its coordinate in the residual smoother when on (None: not a coordinate)


DIMENSIONS: dict[str, Dimension] = {
    "micro_batch_size": Dimension(
        "micro_batch_size",
        "batch_sizes",
        "--batch-sizes",
        "micro batch sizes, e.g. 1,2,4 (default: sized to the device)",
    ),
    "num_workers": Dimension("num_workers", "workers", "--workers", "DataLoader worker counts, e.g. 0,2", minimum=0),
    "grad_accum": Dimension("grad_accum", "accums", "--accum", "gradient accumulation values, e.g. 1,2"),
    "seq_len": Dimension("seq_len", "seq_lens", "--seq-lens", "sequence lengths, e.g. 256,512"),
    "gradient_checkpointing": Dimension(
        "gradient_checkpointing",
        "checkpointing",
        "--checkpointing",
        "gradient checkpointing modes to measure, e.g. off,on (default: off)",
        switch=True,
        label="/ckpt",
        phrase=", gradient checkpointing",
        plan_flag="--gradient-checkpointing",
        plan_help="recompute activations: auto (default) picks whichever measured mode finishes sooner and fits in memory",
        applier="gradient_checkpointing",
        # The forward pass again, per token and its attention part.
        throughput=(Term("recompute_per_token", "tokens"), Term("recompute_attention", "attention")),
        activations=("per_token_checkpointed", "attention_checkpointed"),
        leaner=True,
        # Far apart: residuals of one checkpointing mode say little about the other.
        smoother_spread=2.0,
    ),
}


def switches() -> list[Dimension]:
    """The switch dimensions, in the table's order."""
    return [dimension for dimension in DIMENSIONS.values() if dimension.switch]


def scaled(scale: str, tokens: float, seq_len: float) -> float:
    """A term's feature at this many tokens of this length (SCALES)."""
    return {"step": 1.0, "tokens": tokens, "attention": tokens * seq_len}[scale]
