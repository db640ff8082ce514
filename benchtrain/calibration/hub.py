"""Calibrations people share: a dataset repository on the Hugging Face hub (`bench push`,
`--use-calibration hub:ORG/NAME[/ID]`). Plain data; huggingface_hub imported inside the functions.
What is trusted and why: docs/design.md#calibrations-on-the-hub"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchtrain.calibration.schema import SCHEMA_VERSION, ListedCalibration, read_calibration_file
from benchtrain.calibration.setup import measured_setup, variant_of
from benchtrain.common.errors import BenchtrainError, CalibrationFileError
from benchtrain.common.hub_access import (
    COMMIT_HASH,
    download_command,
    first_line,
    hub_cache_dir,
    refusal,
    snapshot,
    valid_repo_id,
)
from benchtrain.common.json_types import JsonDict

PREFIX = "hub:"
FOLDER = "calibrations"
CARD = "README.md"
# Past this a file is no calibration (the real H100 grid of 48 probes is 43 kB): refused unread.
MAX_FILE_BYTES = 32 * 2**20
# What `bench run` names a calibration (calibration.store.new_id): nothing that leaves calibrations/.
CALIBRATION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
FORMS = "hub:ORG/NAME (every calibration in that dataset repository) or hub:ORG/NAME/ID (one)"


@dataclass(frozen=True)
class HubReference:
    repo_id: str
    calibration_id: str | None = None  # None: every calibration in the repository

    @property
    def text(self) -> str:
        return f"{PREFIX}{self.repo_id}" + (f"/{self.calibration_id}" if self.calibration_id else "")

    @property
    def pattern(self) -> str:
        return f"{FOLDER}/{self.calibration_id or '*'}.json"


def is_hub_reference(reference: str) -> bool:
    return reference.strip().startswith(PREFIX)


def parse_reference(reference: str) -> HubReference:
    """`hub:ORG/NAME` or `hub:ORG/NAME/ID`, or a one-line error."""
    text = reference.strip()
    parts = text[len(PREFIX) :].split("/")
    if len(parts) not in (2, 3) or not all(parts):
        raise BenchtrainError(f"--use-calibration {text!r} is not a hub calibration: {FORMS}")
    repo_id = valid_repo_id("/".join(parts[:2]), f"--use-calibration {text}:")
    if len(parts) == 2:
        return HubReference(repo_id)
    calibration_id = parts[2].removesuffix(".json")
    if not CALIBRATION_ID.fullmatch(calibration_id):
        raise BenchtrainError(
            f"--use-calibration {text!r}: {calibration_id!r} is not a calibration id (letters, digits, '.', '_', '-')"
        )
    return HubReference(repo_id, calibration_id)


# -- reading what was downloaded ------------------------------------------------------------------


def cached_file(path: Path | str) -> tuple[str, str, str] | None:
    """(repository, file in it, commit) of a calibration in huggingface_hub's cache, laid out as
    <cache>/datasets--ORG--NAME/snapshots/<commit>/calibrations/<id>.json (a repository id never holds `--`); else None."""
    parts = Path(path).parts
    if len(parts) < 5 or parts[-2] != FOLDER or parts[-4] != "snapshots" or not COMMIT_HASH.fullmatch(parts[-3]):
        return None
    kind, *names = parts[-5].split("--")
    if kind != "datasets" or len(names) != 2 or not parts[-1].endswith(".json"):
        return None
    return "/".join(names), f"{FOLDER}/{parts[-1]}", parts[-3]


def read_shared(path: Path, repo_id: str) -> JsonDict:
    """A downloaded calibration, checked by calibration.schema, its id its file's name, with a `source` saying where it
    came from; a damaged one: CalibrationFileError naming the repository and the file."""
    repo, file, revision = cached_file(path) or (repo_id, f"{FOLDER}/{path.name}", None)
    where = f"hub:{repo}: {file} refused"
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise CalibrationFileError(f"{where}: {size:,} bytes, more than any calibration holds")
    try:
        data = read_calibration_file(path)
    except CalibrationFileError as error:
        reason = (
            str(error)
            .replace(f"calibration {path}", "the file")
            .replace(str(path), file)
            .removesuffix("; re-run `bench run`")
        )
        raise CalibrationFileError(f"{where} ({reason})") from None
    if data["id"] != path.stem:
        raise CalibrationFileError(f"{where}: it calls itself {data['id']!r}, not {path.stem!r}")
    data["source"] = {"kind": "hub", "repo": repo, "file": file, "revision": revision, "measured_by": measured_by(data)}
    return data


def measured_by(data: JsonDict) -> str | None:
    """Who measured it, as `bench push` wrote it (the token's user): one short line, or None."""
    who = data.get("measured_by")
    if not isinstance(who, str) or not who.strip():
        return None
    return who.strip().splitlines()[0][:80]


def read_calibration(path: Path) -> JsonDict:
    """calibration.schema's reader; a file in huggingface_hub's cache is read as a shared one (its
    id checked, its `source` added), also when named by its path (a resumed run's calibration)."""
    found = cached_file(path)
    return read_shared(Path(path), found[0]) if found else read_calibration_file(Path(path))


def _hub_source(data: JsonDict) -> JsonDict | None:
    source = data.get("source")
    return source if isinstance(source, dict) and source.get("kind") == "hub" else None


def hub_provenance(data: JsonDict) -> str | None:
    """ "hub:ORG/NAME (by USER)" for a calibration read from the hub; None for any other."""
    source = _hub_source(data)
    if source is None:
        return None
    who = source.get("measured_by")
    return f"{PREFIX}{source.get('repo')}" + (f" (by {who})" if who else "")


def hub_reference(data: JsonDict) -> str | None:
    """How --use-calibration names a calibration read from the hub: hub:ORG/NAME/ID."""
    source = _hub_source(data)
    return None if source is None else f"{PREFIX}{source.get('repo')}/{data.get('id')}"


# -- pulling --------------------------------------------------------------------------------------


def shared_calibrations(reference: str, on_skip: Callable[[str], None] | None = None) -> list[ListedCalibration]:
    """(path in the cache, data with its source) for each calibration `hub:ORG/NAME[/ID]` names, newest first. A damaged file is refused: an error when it was
    named (`/ID`) or no `on_skip` hears of it, else one line through `on_skip` and the others are used."""
    ref = parse_reference(reference)
    try:
        folder = snapshot(ref.repo_id, None, [ref.pattern], repo_type="dataset")
    except BenchtrainError as error:
        raise BenchtrainError(f"{ref.text}: {error}") from None
    files = sorted((folder / FOLDER).glob(f"{ref.calibration_id or '*'}.json"))
    if not files:
        raise BenchtrainError(nothing_there(ref))
    entries: list[ListedCalibration] = []
    for path in files:
        try:
            entries.append(ListedCalibration(path, read_shared(path, ref.repo_id)))
        except CalibrationFileError as error:
            if ref.calibration_id is not None or on_skip is None:
                raise
            on_skip(str(error))
    if not entries:
        raise BenchtrainError(f"{ref.text}: none of its {len(files)} calibration files can be used")
    return sorted(entries, key=lambda entry: str((entry.data or {}).get("created_at", "")), reverse=True)


def nothing_there(ref: HubReference) -> str:
    from huggingface_hub import is_offline_mode

    what = f"{ref.pattern} is" if ref.calibration_id else "no calibrations/*.json are"
    if is_offline_mode():
        command = download_command(ref.repo_id, None, "dataset")
        return f"{ref.text}: {what} not in the hub cache {hub_cache_dir()} and HF_HUB_OFFLINE is set: download the repository with `{command}`"
    if ref.calibration_id:
        return (
            f"{ref.text}: the repository has no {ref.pattern}: `{PREFIX}{ref.repo_id}` names every calibration it has"
        )
    return f"{ref.text}: the repository holds no calibrations/*.json: is it one `bench push` wrote?"


# -- the card: what each calibration measured, on what, with what, and who measured it ------------
# Every cell is escaped: a value is data from someone else's file, never markdown of ours.

COLUMNS = (
    "id",
    "device",
    "interconnect",
    "model",
    "method",
    "quantization",
    "processes",
    "software",
    "created",
    "measured by",
)


def card_text(repo_id: str, calibrations: dict[str, JsonDict | None]) -> str:
    """The card for `calibrations` (file in the repository → its data; None: a file that cannot be read), newest first."""
    readable = sorted(
        (data for data in calibrations.values() if data), key=lambda data: str(data.get("created_at", "")), reverse=True
    )
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
        lines += [
            "",
            "Files that cannot be read as calibrations (left out of every plan): "
            + ", ".join(f"`{cell(name)}`" for name in damaged),
        ]
    return "\n".join(lines) + "\n"


def card_row(data: JsonDict) -> list[str]:
    hardware, software = data.get("hardware") or {}, data.get("software") or {}
    setup = measured_setup(data)
    # Each variant the file measured (calibration.schema.variant_data).
    quantizations = [variant_of(entry).quantize for entry in (data, *(data.get("variants") or []))]
    return [
        str(data.get("id", "?")),
        str(hardware.get("name", "?")),
        interconnect(hardware.get("interconnect")),
        setup.model_name,
        f"LoRA r{setup.lora_rank}" if setup.method == "lora" and setup.lora_rank else setup.method,
        ", ".join(dict.fromkeys(quantizations)),
        f"{setup.world_size}" + (f" ({setup.sharding})" if setup.sharding != "none" else ""),
        versions(software, hardware),
        str(data.get("created_at", "?")),
        str(data.get("measured_by") or "unknown"),
    ]


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


# -- pushing --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pushed:
    repo_id: str
    files: list[str]  # what this push sent, the card aside
    listed: int  # calibrations the card lists: those sent and those already there
    commit_url: str

    @property
    def url(self) -> str:
        from huggingface_hub import constants

        return f"{constants.ENDPOINT}/datasets/{self.repo_id}"


def shareable(data: JsonDict, user: str) -> JsonDict:
    """The copy of a calibration that goes up: who measured it (kept when it says), local paths cut to their names, no `source` (a download writes its own)."""
    shared = copy.deepcopy(data)
    shared.pop("source", None)
    shared["measured_by"] = measured_by(data) or user or "unknown"
    for section in ("data", "model"):
        entry = shared.get(section)
        if (
            isinstance(entry, dict)
            and isinstance(entry.get("source"), str)
            and os.path.isabs(os.path.expanduser(entry["source"]))
        ):
            entry["source"] = Path(entry["source"]).name
    return shared


def push_calibrations(repo_id: str, calibrations: list[JsonDict], user: str) -> Pushed:
    """One commit to the dataset repository `repo_id` (made when missing): each calibration as calibrations/<id>.json and
    README.md listing them with those already there. Any failure is one line; the commit is all or nothing."""
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub import errors as hub_errors

    unnamed = [str(data.get("id")) for data in calibrations if not CALIBRATION_ID.fullmatch(str(data.get("id")))]
    if unnamed:
        raise BenchtrainError(
            f"bench push: {unnamed[0]!r} cannot name a file on the hub (letters, digits, '.', '_', '-'): push calibrations `bench run` wrote"
        )
    api = HfApi()
    sending = {f"{FOLDER}/{data['id']}.json": shareable(data, user) for data in calibrations}
    try:
        api.create_repo(repo_id, repo_type="dataset", exist_ok=True)
        present = [name for name in api.list_repo_files(repo_id, repo_type="dataset") if is_calibration_file(name)]
        # Those already there stay, and the card lists them too (an id sent again replaces its file).
        listed = {**{name: fetch_earlier(api, repo_id, name) for name in present if name not in sending}, **sending}
        files = {name: (json.dumps(data, indent=2) + "\n").encode("utf-8") for name, data in sending.items()}
        operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=content) for name, content in files.items()]
        operations.append(
            CommitOperationAdd(path_in_repo=CARD, path_or_fileobj=card_text(repo_id, listed).encode("utf-8"))
        )
        message = f"benchtrain: {len(sending)} calibration(s) measured by {user or 'unknown'}"
        commit = api.create_commit(repo_id, operations, commit_message=message, repo_type="dataset")
        return Pushed(repo_id, list(sending), len(listed), str(getattr(commit, "commit_url", "") or ""))
    except hub_errors.HfHubHTTPError as error:  # the hub answered: not found, forbidden, …
        reason = refusal(error, repo_id, None, "dataset") or first_line(error)
    except hub_errors.HTTPError as error:  # no answer: no connection, a timeout
        reason = f"cannot reach the hub ({type(error).__name__}: {first_line(error)}): check the network and push again"
    except (
        OSError,
        ValueError,
    ) as error:  # a file of the push that cannot be read, an argument the hub's client refuses
        reason = f"{type(error).__name__}: {first_line(error)}"
    raise BenchtrainError(f"bench push {repo_id}: {reason}; nothing was committed")


def is_calibration_file(name: str) -> bool:
    """calibrations/<id>.json, and nothing deeper or else."""
    folder, _, file = name.partition("/")
    return (
        folder == FOLDER
        and "/" not in file
        and file.endswith(".json")
        and bool(CALIBRATION_ID.fullmatch(file.removesuffix(".json")))
    )


def fetch_earlier(api: Any, repo_id: str, name: str) -> JsonDict | None:
    """A calibration already in the repository, read to list it on the card (None: damaged)."""
    path = Path(api.hf_hub_download(repo_id, name, repo_type="dataset"))
    try:
        return read_shared(path, repo_id)
    except CalibrationFileError:
        return None
