"""What every process of a Trainer's run agrees at the end of an optimizer step, in ONE collective:
the real and padded tokens summed over the processes, the strongest move (a stop or a signal on
one process stops all), the lowest step limit, the signal that came, and whether the evaluation
the Trainer asks for fits on every process. One all-reduce of one small tensor (MAX): each process
writes its tokens into its own slot, so the sums are read from the maximum; a minimum is the
maximum of the negated values."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StepAgreement:
    tokens: int  # real tokens of the step (this process's; after `agree_step`, every process's)
    padded_tokens: int  # positions computed, padding included
    move_strength: int  # the guard's Move.strength
    limit: int  # the step limit
    signal: int  # the signal received (0: none)
    evaluation_fits: bool  # the evaluation now, a step and a save fit before the budget


def agree_step(state: Any, mine: StepAgreement) -> StepAgreement:
    """`mine` agreed over the processes of accelerate's `state` (a PartialState)."""
    processes = int(state.num_processes)
    if processes == 1:
        return mine
    import torch
    import torch.distributed as dist

    rank = int(state.process_index)
    values = torch.zeros(2 * processes + 4, dtype=torch.long)
    values[rank], values[processes + rank] = mine.tokens, mine.padded_tokens
    values[2 * processes :] = torch.tensor([mine.move_strength, -mine.limit, mine.signal, -int(mine.evaluation_fits)])
    values = values.to(state.device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    agreed = values.tolist()
    strength, negated_limit, signal, negated_fits = agreed[2 * processes :]
    return StepAgreement(
        sum(agreed[:processes]),
        sum(agreed[processes : 2 * processes]),
        strength,
        -negated_limit,
        signal,
        -negated_fits == 1,
    )
