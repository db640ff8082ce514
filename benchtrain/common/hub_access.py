"""The Hugging Face hub, as every part of benchtrain reaches it (downloads, the push of a trained
model, shared calibrations: calibration.hub stands below train, so this lives on the ground floor):
a snapshot's cache folder, huggingface_hub's errors as one line that says what to do, and the checks
before anything is written. huggingface_hub is imported inside the functions: importing this is free.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from benchtrain.common.errors import BenchtrainError

T = TypeVar("T")

COMMIT_HASH = re.compile(r"^[0-9a-f]{40}$")
NETWORK_ADVICE = "check the network, or download it where there is one with"


def download_command(repo_id: str, revision: str | None = None, repo_type: str = "model") -> str:
    kind = "" if repo_type == "model" else f" --repo-type {repo_type}"
    return f"hf download {repo_id}{kind}" + (f" --revision {revision}" if revision else "")


def hub_cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def snapshot(repo_id: str, revision: str | None, patterns: list[str] | None, repo_type: str = "model") -> Path:
    """The cache folder of `repo_id@revision` holding the files that match `patterns`, fetched when online and missing."""
    from huggingface_hub import is_offline_mode, snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    def fetch(local_only: bool) -> Path:
        return Path(
            snapshot_download(
                repo_id, repo_type=repo_type, revision=revision, allow_patterns=patterns, local_files_only=local_only
            )
        )

    if revision and COMMIT_HASH.fullmatch(revision) and not is_offline_mode():
        # A commit never changes: a cached one needs no question to the hub.
        try:
            return fetch(True)
        except (LocalEntryNotFoundError, IncompleteSnapshotError):
            pass
    return guarded(repo_id, revision, repo_type, lambda: fetch(is_offline_mode()))


def guarded(repo_id: str, revision: str | None, repo_type: str, call: Callable[[], T]) -> T:
    """`call()`, with huggingface_hub's errors turned into one line that says what to do."""
    try:
        return call()
    except Exception as error:
        message = refusal(error, repo_id, revision, repo_type)
        if message is None:
            raise
        raise BenchtrainError(message) from None


def refusal(error: BaseException, repo_id: str, revision: str | None, repo_type: str) -> str | None:
    """The one line for a huggingface_hub error (None: not one of its errors)."""
    from huggingface_hub import errors as hub_errors
    from huggingface_hub import get_token, is_offline_mode

    what = "dataset" if repo_type == "dataset" else "model"
    label = f"{repo_id}@{revision}" if revision else repo_id
    command = download_command(repo_id, revision, repo_type)
    cache = hub_cache_dir()
    if isinstance(error, hub_errors.HFValidationError):
        return f"{label} is not a valid hub {what} id (ORG/NAME[@REVISION]): {first_line(error)}"
    if isinstance(error, hub_errors.GatedRepoError):
        access = "the token in use has no access to it" if get_token() else "no token is set"
        page = f"https://huggingface.co/{'datasets/' if what == 'dataset' else ''}{repo_id}"
        return f"hub {what} {repo_id} is gated and {access}: accept its terms on {page} and set HF_TOKEN (or run `hf auth login`)"
    if isinstance(error, hub_errors.RepositoryNotFoundError):
        private = "" if get_token() else " (if it is private, set HF_TOKEN)"
        return f"no {what} {repo_id} on the hub{private}: check the id (ORG/NAME)"
    if isinstance(error, hub_errors.RevisionNotFoundError):
        return f"hub {what} {repo_id} has no revision {revision!r}: name a branch, tag or commit that exists"
    if isinstance(
        error, (hub_errors.LocalEntryNotFoundError, hub_errors.IncompleteSnapshotError, hub_errors.DryRunError)
    ):
        if is_offline_mode():
            return f"{what} {label} is not in the hub cache {cache} and HF_HUB_OFFLINE is set: download it with `{command}`"
        cause = error.__cause__
        if isinstance(cause, hub_errors.HfHubHTTPError):  # the hub answered (gated, not found, …): say what it said
            return refusal(cause, repo_id, revision, repo_type)
        reason = f" ({first_line(cause)})" if cause is not None else ""
        return f"cannot reach the hub for {what} {label}{reason} and it is not in the hub cache {cache}: {NETWORK_ADVICE} `{command}`"
    if isinstance(error, hub_errors.HfHubHTTPError):
        return f"the hub refused {what} {label}: {first_line(error)}"
    if isinstance(error, hub_errors.HTTPError):  # no connection, a timeout
        return f"cannot reach the hub for {what} {label} ({first_line(error)}): {NETWORK_ADVICE} `{command}`"
    return None


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


# -- before writing to the hub -----------------------------------------------------------------


def valid_repo_id(repo_id: str, option: str) -> str:
    """ORG/NAME (or NAME, the token's own namespace) as the hub accepts it, or a one-line error naming `option` (`--push-to-hub`, `bench push`)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise BenchtrainError(
            f"{option} {repo_id!r} is not a hub repository name (ORG/NAME): {first_line(error)}"
        ) from None
    return repo_id


def writing_user(option: str, again: str, otherwise: str = "") -> str:
    """Whom the token belongs to, checked before anything is written to the hub; refused in one
    line that names `option`: the hub switched off, no token, a token the hub rejects, or no way to
    reach it. `again`: what to do once a token is set ("train again"); `otherwise`: the way out
    (", or drop --push-to-hub")."""
    from huggingface_hub import HfApi, get_token

    # as the user set it in this process
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "on", "yes", "true"):
        raise BenchtrainError(f"{option}: HF_HUB_OFFLINE is set, so nothing can be pushed: unset it{otherwise}")
    token = get_token()
    if not token:
        raise BenchtrainError(f"{option}: no Hugging Face token: run `hf auth login` or set HF_TOKEN, then {again}")
    try:
        user = HfApi().whoami(token=token)
    except Exception as error:  # httpx's connection errors and the hub's HTTP errors alike
        status = getattr(getattr(error, "response", None), "status_code", None)
        if status == 401:
            raise BenchtrainError(
                f"{option}: the hub rejects this token: run `hf auth login` with a token that can write"
            ) from None
        reason = f"{type(error).__name__}: {first_line(error)}" if str(error).strip() else type(error).__name__
        raise BenchtrainError(f"{option}: cannot reach the hub ({reason}): check the network{otherwise}") from None
    return str(user.get("name") or "")
