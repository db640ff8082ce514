"""The seeds' question, answered by `train --dry-run --use-calibration …` (docs/results.md has the table).

    python benchmarks/which_machine.py                       # 8,000 chats × ≈500 tokens, 3 epochs, 12 h
    python benchmarks/which_machine.py --use-calibration h100-llama-3.2-1b,my-h200.json --price-per-hour h100=2.5,h200=3.8
    python benchmarks/which_machine.py --samples 600000 --deadline 24h --consider h100:1,h100:2:nvlink,h200:1,a100-40gb:4:pcie \
        --price-per-hour h100=2.5,h200=3.8,a100=1.2        # the seeds' question, before renting any (docs/results.md)

Writes 8,000 synthetic chats (messages format; a user turn and an assistant turn, ≈500 tokens of
the byte-level tokenizer each once rendered with the chat template) into a temporary folder and
runs the comparison on them with a fresh BENCHTRAIN_HOME, so the calibrations it compares are
the bundled ones (`all`: h100-llama-3.2-1b for llama-3.2-1b) and whatever `--use-calibration` names by path.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

WORDS = (
    "the a plan run measure step batch token deadline model data train answer question why how when it we you".split()
)


def sentence(rng: random.Random, characters: int) -> str:
    text: list[str] = []
    while sum(len(word) + 1 for word in text) < characters:
        text.append(rng.choice(WORDS))
    return " ".join(text)


def write_chats(path: Path, count: int, seed: int = 0) -> None:
    """`count` chats whose rendered length is ≈500 bytes (the chat template adds a few around the turns)."""
    rng = random.Random(seed)
    with path.open("w") as handle:
        for _ in range(count):
            total = max(120, int(rng.gauss(495, 60)))
            question = max(20, int(total * rng.uniform(0.2, 0.4)))
            messages = [
                {"role": "user", "content": sentence(rng, question)},
                {"role": "assistant", "content": sentence(rng, total - question)},
            ]
            handle.write(json.dumps({"messages": messages}) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=8000)
    parser.add_argument("--use-calibration", default="all")
    parser.add_argument("--price-per-hour", default="h100=2.5")
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--epochs", default="3")
    parser.add_argument("--deadline", default="12h")
    parser.add_argument("--consider", help="machines to plan (train --consider): h100:1,h100:2:nvlink,…")
    parser.add_argument("extra", nargs="*", help="more train options (after --)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="which-machine-") as folder:
        data = Path(folder) / "chats.jsonl"
        write_chats(data, args.samples)
        command = [
            "train", "--dry-run", "--use-calibration", args.use_calibration, "--model", args.model, "--data", str(data),
            "--epochs", args.epochs, "--deadline", args.deadline, "--price-per-hour", args.price_per_hour, *args.extra,
        ]  # fmt: skip
        if args.consider:
            command += ["--consider", args.consider]
        print("$ " + " ".join(command).replace(str(data), "chats.jsonl"), flush=True)
        environment = {**os.environ, "BENCHTRAIN_HOME": str(Path(folder) / "home")}
        result = subprocess.run(
            [sys.executable, "-m", "benchtrain.train", *command[1:]],
            env=environment,
            check=False,
            capture_output=True,
            text=True,
        )
        # The data and the report are in a temporary folder, gone when this ends.
        print((result.stdout + result.stderr).replace(str(data), "chats.jsonl").replace(folder, "$TMP"), end="")
        return result.returncode


if __name__ == "__main__":
    sys.exit(main())
