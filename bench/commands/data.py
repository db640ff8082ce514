"""`bench data`: the tokenized-data cache ($BENCHTRAIN_HOME/data): list it, clear it, or fill it
ahead of a run (every record tokenized once, in parallel, for `train` and `bench --data`)."""

from __future__ import annotations

import argparse
import time
from datetime import datetime
from typing import Any

from common.errors import EXIT_OK, BenchtrainError

DATA_EXAMPLES = """examples:
  bench data list                                              # every cached dataset: key, source, records, tokens, size, last used
  bench data prepare --data chats.jsonl --model llama-3.2-1b --tokenizer tok/   # tokenize everything now (train then plans exactly)
  bench data clear 3fa2c81e09d4b7aa51c6e2d0                    # one dataset's tokens (and its samples)
  bench data clear --all                                       # the whole cache
"""


def add_parser(commands: Any) -> None:
    from train.arguments import add_data_arguments

    data = commands.add_parser(
        "data",
        help="the tokenized-data cache: list, clear, prepare",
        description="Tokenized data is cached once per dataset under $BENCHTRAIN_HOME/data, keyed by the data's content, the tokenizer, "
        "its chat template, the format and columns and what the loss is on.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=DATA_EXAMPLES,
    )
    actions = data.add_subparsers(dest="data_command", metavar="{list,clear,prepare}", required=True)
    listing = actions.add_parser("list", help="the cached datasets, newest use first")
    listing.add_argument("--debug", action="store_true")
    listing.set_defaults(handler=lambda args: list_command())
    clear = actions.add_parser("clear", help="remove cached datasets by key (or --all)")
    clear.add_argument("keys", nargs="*", metavar="KEY")
    clear.add_argument("--all", action="store_true", help="remove every cached dataset")
    clear.add_argument("--debug", action="store_true")
    clear.set_defaults(handler=clear_command)
    prepare = actions.add_parser("prepare", help="tokenize every record of --data now, into the cache")
    prepare.add_argument("--data", required=True, metavar="PATH|ORG/NAME", help="the data, as train --data takes it")
    prepare.add_argument("--model", default="tiny", metavar="PRESET|DIR|ORG/NAME[@REV]", help="whose tokenizer (default: tiny)")
    prepare.add_argument("--tokenizer", metavar="DIR", help="tokenizer folder (default: the model's)")
    prepare.add_argument("--train-on", default="assistant", choices=("assistant", "all"), help="chat data: the loss on the assistant's turns or all")
    add_data_arguments(prepare)
    prepare.add_argument("--debug", action="store_true")
    prepare.set_defaults(handler=prepare_command)


def list_command() -> int:
    from train.workload.data_cache import data_root, list_stores

    rows = list_stores()
    if not rows:
        print(f"no tokenized data in {data_root()}")
        return EXIT_OK
    total = sum(row["bytes"] for row in rows)
    print(f"tokenized data in {data_root()}: {len(rows)} stores, {total / 1e9:,.2f} GB (clear with `bench data clear KEY` or `--all`)")
    for row in sorted(rows, key=lambda row: -row["used"]):
        documents = f"{row['documents']:,}" if row["documents"] is not None else "?"
        tokens = f"{row['tokens']:,}" if row["tokens"] is not None else "?"
        state = "" if row["complete"] else "  (incomplete: rebuilt when used)"
        used = datetime.fromtimestamp(row["used"]).strftime("%Y-%m-%d %H:%M")
        size = f"{row['bytes'] / 1e6:,.1f} MB"
        print(f"{row['key']:<38} {row['kind']:<6} {documents:>11} records {tokens:>15} tokens {size:>12}  used {used}  {row['source']}{state}")
    return EXIT_OK


def clear_command(args: argparse.Namespace) -> int:
    from train.workload.data_cache import clear_stores

    if not args.keys and not args.all:
        raise BenchtrainError("bench data clear: name the KEYs to remove (bench data list shows them), or pass --all")
    removed = clear_stores(None if args.all else list(args.keys))
    if not removed and args.keys:
        raise BenchtrainError(f"bench data clear: no cached data with key {', '.join(args.keys)} (bench data list shows them)")
    print(f"removed {len(removed)} store(s): {', '.join(removed) if removed else 'none'}")
    return EXIT_OK


def prepare_command(args: argparse.Namespace) -> int:
    from common.console import say
    from train.workload.data import resolve_data_path
    from train.workload.formats import schema_from_args
    from train.workload.model import resolve_model
    from train.workload.prepare import DataSpec, prepare_data
    from train.workload.tokenizer import load_tokenizer

    started = time.perf_counter()
    spec = resolve_model(args.model)
    tokenizer = load_tokenizer(spec.directory, args.tokenizer)
    path = resolve_data_path(args.data)
    prepared = prepare_data(DataSpec(path, args.train_on, schema_from_args(args), args.data_split), tokenizer, say, exact=True)
    data = prepared.view
    size = sum(path.stat().st_size for path in prepared.folder.rglob("*") if path.is_file())
    print(
        f"{prepared.records:,} records of {args.data}: {len(data):,} samples, {int(data.lengths.sum()):,} tokens "
        f"in {prepared.folder} ({size / 1e6:,.1f} MB; {time.perf_counter() - started:.1f}s)"
    )
    return EXIT_OK
