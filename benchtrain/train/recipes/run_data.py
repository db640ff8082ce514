"""The data of a `train` command (or a comparison): the tokenizer, the data as the planner sees it
(exact where the cache holds it, else from a sample) and the way to every record tokenized; and a
hub model's weights, fetched before it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from benchtrain.common.console import say
from benchtrain.common.errors import BenchtrainError
from benchtrain.common.json_types import JsonDict
from benchtrain.train.recipes.config import DataSection
from benchtrain.train.step.evaluation import split_eval
from benchtrain.train.workload.data import length_profile, resolve_data_path
from benchtrain.train.workload.model import ModelSpec, with_hub_weights
from benchtrain.train.workload.prepare import DataSpec, PreparedData, prepare_data
from benchtrain.train.workload.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class LoadedData:
    """The data as the planner sees it (`data`, `eval_data`: exact, or from a sample), and every record tokenized (`exact`)."""

    data_path: str
    tokenizer: PreTrainedTokenizerBase
    prepared: PreparedData
    eval_prepared: PreparedData | None  # the same for --eval-data
    # Any until the training loop's TrainingData takes a DataView: its caller (recipe.py's
    # _train_loop) passes these after _with_exact_data made them exact (TokenizedData).
    data: Any
    eval_data: Any
    profile: JsonDict

    @property
    def sampled(self) -> bool:
        return not self.prepared.exact or (self.eval_prepared is not None and not self.eval_prepared.exact)

    @property
    def prep_seconds(self) -> float:
        """Tokenizing still to do before training: at the rate measured on the samples."""
        return sum(p.predicted_seconds for p in (self.prepared, self.eval_prepared) if p is not None and not p.exact)

    @property
    def uncertainty(self) -> float:
        """The token total's relative 95% half-width (0 for an exact profile)."""
        return self.prepared.estimate.relative_half_width if self.prepared.estimate else 0.0

    def exact(self, section: DataSection, seed: int) -> tuple[Any, Any]:
        """(data, eval data) of every record, tokenized (the cache built where it is cold)."""
        data = self.prepared.tokenized(say)
        eval_data = self.eval_prepared.tokenized(say) if self.eval_prepared is not None else None
        return split_data(data, eval_data, section, seed)


def split_data(data: Any, eval_data: Any, section: DataSection, seed: int) -> tuple[Any, Any]:
    """--eval-split holds out a share of the data (deterministically, by `seed`); --eval-data is its own."""
    return split_eval(data, section.eval_split, seed) if section.eval_split is not None else (data, eval_data)


def load_data(section: DataSection, spec: ModelSpec, seed: int) -> LoadedData:
    """The tokenizer and the data: exact where cached (or --exact-profile), else from a sample; `seed` draws --eval-split's."""
    data_path = resolve_data_path(section.data)
    tokenizer = load_tokenizer(spec.directory, section.tokenizer)
    prepared = prepare_data(
        DataSpec(data_path, section.train_on, section.schema, section.data_split), tokenizer, say, section.exact_profile
    )
    eval_prepared = None
    if section.eval_split is None and section.eval_data:
        eval_spec = DataSpec(resolve_data_path(section.eval_data), section.train_on, section.schema)
        eval_prepared = prepare_data(eval_spec, tokenizer, say, section.exact_profile)
    data, eval_data = split_data(prepared.view, eval_prepared.view if eval_prepared else None, section, seed)
    profile = {**length_profile(data.lengths), "sampled": not prepared.exact}
    return LoadedData(data_path, tokenizer, prepared, eval_prepared, data, eval_data, profile)


def hub_weights(spec: ModelSpec, dry_run: bool) -> ModelSpec:
    """The spec that loads a hub model's weights, fetched if missing (size said first); a dry run only says what it would fetch."""
    if not dry_run:
        return with_hub_weights(spec, say)
    try:
        return with_hub_weights(spec, say, fetch=False)
    except BenchtrainError as error:
        say(f"warning: {error}")
        return spec
