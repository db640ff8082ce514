"""`bench push ORG/NAME [IDS...]`: share calibrations in a dataset repository on the Hugging Face
hub (calibration.hub), for anyone to plan with as `--use-calibration hub:ORG/NAME`."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from common.errors import EXIT_OK, BenchtrainError

PUSH_EXAMPLES = """examples:
  bench push my-org/gpu-calibrations                  every stored calibration (`bench list`)
  bench push my-org/gpu-calibrations latest           the newest one
  bench push my-org/gpu-calibrations ID1 ./other.json these (ids, bundled names or paths)

then, on any machine (a dry run needs no GPU):
  train --dry-run --use-calibration hub:my-org/gpu-calibrations --model llama-3.2-1b --data chats.jsonl --deadline 12h
  train --dry-run --use-calibration all,hub:my-org/gpu-calibrations --model llama-3.2-1b --data chats.jsonl --deadline 12h
  train --use-calibration hub:my-org/gpu-calibrations/ID --model llama-3.2-1b --data chats.jsonl --deadline 12h

One commit: calibrations/<id>.json for each (an id pushed again replaces its file) and a README.md
card listing every calibration in the repository (device, interconnect, model, method, quantization,
processes, software, who measured it). The token comes from `hf auth login` or HF_TOKEN, as for
`train --push-to-hub`; its user is written into each file as who measured it. Local paths of the
data or a model folder go up as their file names only."""


def add_parser(commands: Any) -> None:
    push = commands.add_parser(
        "push",
        help="share calibrations on the Hugging Face hub (a dataset repository)",
        description="Upload calibrations to a dataset repository on the Hugging Face hub, with a card listing them.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=PUSH_EXAMPLES,
    )
    push.add_argument("repo", metavar="ORG/NAME", help="the dataset repository (made when missing); NAME alone: the token's own namespace")
    push.add_argument("ids", nargs="*", metavar="ID", help="latest, ids (`bench list`), bundled names or paths; default: every stored calibration")
    push.add_argument("--debug", action="store_true", help="show tracebacks")
    push.set_defaults(handler=lambda args: push_command(args.repo, args.ids))


def push_command(repo: str, references: list[str]) -> int:
    from calibration.hub import push_calibrations
    from common.hub_access import valid_repo_id, writing_user

    valid_repo_id(repo, "bench push")
    calibrations = calibrations_to_push(references)
    user = writing_user("bench push", again="push again")
    if "/" not in repo:  # NAME alone: the token's own namespace, as the hub reads it
        if not user:
            raise BenchtrainError(f"bench push {repo}: the token names no user: name the repository as ORG/NAME")
        repo = f"{user}/{repo}"
    pushed = push_calibrations(repo, calibrations, user)
    print(f"pushed {len(pushed.files)} calibration(s) to {pushed.url} ({pushed.listed} there now): {', '.join(data['id'] for data in calibrations)}")
    if pushed.commit_url:
        print(f"  commit: {pushed.commit_url}")
    print(f"  plan with them anywhere: train --dry-run --use-calibration hub:{repo} --model MODEL --data DATA --deadline DURATION")
    return EXIT_OK


def calibrations_to_push(references: list[str]) -> list[dict[str, Any]]:
    """The calibrations named (each once), or every readable one in the store; an unreadable one in
    the store is said and left out."""
    from calibration.schema import read_calibration_file
    from calibration.store import calibrations_dir, home_hint, list_calibrations, resolve_calibration

    def warn(message: str) -> None:
        print(f"warning: {message}", file=sys.stderr)

    if references:
        return [read_calibration_file(resolve_calibration(reference, on_skip=warn)) for reference in dict.fromkeys(references)]
    found = []
    for path, data, error in list_calibrations():
        if data is None:
            warn(f"left out {path}: {error}")
        else:
            found.append(data)
    if not found:
        raise BenchtrainError(f"bench push: no calibration in {calibrations_dir()} to push: run `bench run` first, or name one{home_hint()}")
    return found
