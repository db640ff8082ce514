"""Models named as on the Hugging Face hub, `ORG/NAME[@REVISION]`: resolved to a commit in the hub
cache, config and tokenizer first, the weights when training needs them. docs/design.md#models-from-the-hub"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from benchtrain.common.disk_space import GB, free_bytes
from benchtrain.common.errors import BenchtrainError, DiskSpaceError

# Where the hub is reached for every part of benchtrain (calibration.hub too, which cannot import train).
from benchtrain.common.hub_access import download_command, guarded, hub_cache_dir, snapshot
from benchtrain.common.json_types import JsonDict

if TYPE_CHECKING:
    from huggingface_hub.file_download import DryRunFileInfo

HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")
# What bench and the data need: the config, the tokenizer and its chat template (a few MB at most).
SMALL_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
]
SMALL_FILES += ["chat_template.jinja", "chat_template.json"]
# Safetensors when the repository has them (transformers prefers them too); else PyTorch files.
WEIGHT_PATTERNS = (
    ["*.safetensors", "*.safetensors.index.json"],
    ["pytorch_model*.bin", "pytorch_model.bin.index.json"],
)
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


@dataclass(frozen=True)
class HubModel:
    repo_id: str
    revision: str  # the commit the reference resolved to
    requested: str | None  # the branch, tag or commit asked for; None: the default branch
    snapshot: Path  # the hub cache's folder for that commit

    @property
    def reference(self) -> str:
        """What resolves to exactly this commit again (in another process, say)."""
        return f"{self.repo_id}@{self.revision}"

    def record(self) -> JsonDict:
        return {"hub_id": self.repo_id, "revision": self.revision, "requested_revision": self.requested or "main"}


@dataclass(frozen=True)
class WeightFetch:
    """The weight files of a hub model that are not in the cache yet."""

    patterns: list[str]
    files: list[str]
    total_bytes: int
    cache_dir: str


def parse_hub_id(reference: str) -> tuple[str, str | None] | None:
    """(ORG/NAME, revision or None) when `reference` is written like a hub id, else None."""
    match = HUB_ID.match(reference.strip())
    return (match["repo"], match["revision"]) if match else None


def has_weight_files(folder: Path) -> bool:
    """A single weight file, or an index whose every shard is there (a half-finished download is not)."""
    for name in WEIGHT_FILES:
        path = folder / name
        if not path.is_file():
            continue
        if not name.endswith(".index.json"):
            return True
        try:
            shards = set(json.loads(path.read_text()).get("weight_map", {}).values())
        except (OSError, ValueError, AttributeError):
            continue
        if shards and all((folder / shard).is_file() for shard in shards):
            return True
    return False


def resolve_hub_model(repo_id: str, revision: str | None) -> HubModel:
    """The commit `repo_id@revision` names and its cache folder, with the config and tokenizer in it."""
    from huggingface_hub import is_offline_mode

    try:
        folder = snapshot(repo_id, revision, SMALL_FILES)
    except BenchtrainError:
        if not is_offline_mode():
            raise
        # Offline, a cache with the config but not every tokenizer file still serves bench.
        folder = snapshot(repo_id, revision, ["config.json"])
    label = f"{repo_id}@{revision}" if revision else repo_id
    if not (folder / "config.json").is_file():
        raise BenchtrainError(f"hub model {label} has no config.json: is it a transformers model?")
    # snapshot_download returns <cache>/models--ORG--NAME/snapshots/<commit>.
    return HubModel(repo_id, folder.name, revision, folder)


def _dry_run(hub: HubModel, patterns: list[str]) -> list[DryRunFileInfo]:
    from huggingface_hub import snapshot_download

    return snapshot_download(hub.repo_id, revision=hub.revision, allow_patterns=patterns, dry_run=True)


def weights_to_fetch(hub: HubModel) -> WeightFetch:
    """What `fetch_weights` will download (nothing when the cache has the weights); offline and missing: one line with the download command."""
    from huggingface_hub import is_offline_mode

    cache = hub_cache_dir()
    if has_weight_files(hub.snapshot):
        return WeightFetch([], [], 0, cache)
    if is_offline_mode():
        raise BenchtrainError(
            f"the weights of {hub.repo_id}@{hub.revision[:12]} are not in the hub cache {cache} and HF_HUB_OFFLINE is set: "
            f"download them with `{download_command(hub.repo_id, hub.revision)}`, or unset HF_HUB_OFFLINE"
        )
    for patterns in WEIGHT_PATTERNS:
        # A dry run lists the files with their sizes and whether each is cached already.
        listed = guarded(hub.repo_id, hub.revision, "model", partial(_dry_run, hub, patterns))
        if listed:
            missing = [info for info in listed if info.will_download]
            return WeightFetch(
                patterns, [info.filename for info in missing], sum(info.file_size or 0 for info in missing), cache
            )
    raise BenchtrainError(
        f"hub model {hub.repo_id}@{hub.revision[:12]} has no weights (no safetensors or pytorch_model.bin files)"
    )


def fetch_weights(hub: HubModel, fetch: WeightFetch) -> None:
    """Download the missing weight files into the hub cache, after checking there is room."""
    free = free_bytes(Path(fetch.cache_dir))
    if fetch.total_bytes > free:
        raise DiskSpaceError(
            f"{hub.repo_id} needs {fetch.total_bytes / GB:.1f} GB in the hub cache {fetch.cache_dir}, {free / GB:.1f} GB free: "
            "free space, or point HF_HOME at a larger disk"
        )
    snapshot(hub.repo_id, hub.revision, fetch.patterns)
    if not has_weight_files(hub.snapshot):
        raise BenchtrainError(
            f"the weights of {hub.repo_id}@{hub.revision[:12]} are still incomplete in {hub.snapshot} after the download"
        )
