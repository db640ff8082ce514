"""Generate the bundled sample datasets (deterministic): heavy-tailed text lengths, and chat.

python scripts/make_sample_data.py   # rewrites train/sample_data/*.jsonl
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = (
    "the model learns to predict the next token from context while the optimizer follows the gradient "
    "batch size accumulation workers sequence length deadline throughput memory calibration measured "
    "estimate actual budget checkpoint resume epoch warmup schedule loss data loader padding packing "
    "attention layer head hidden vocabulary tokenizer prompt completion answer question because when"
).split()
OUT = Path(__file__).resolve().parent.parent / "benchtrain" / "train" / "sample_data"


def sentence(rng: random.Random, words: int) -> str:
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    return text[0].upper() + text[1:] + "."


def text_sample(rng: random.Random) -> str:
    # Log-normal byte lengths: most samples short, a long tail (the byte tokenizer makes bytes = tokens).
    target = min(4000, max(24, int(rng.lognormvariate(5.0, 0.9))))
    parts: list[str] = []
    while sum(len(p) + 1 for p in parts) < target:
        parts.append(sentence(rng, rng.randint(4, 14)))
    return " ".join(parts)[:target]


def main() -> None:
    rng = random.Random(20261121)
    OUT.mkdir(parents=True, exist_ok=True)
    with (OUT / "sample.jsonl").open("w") as handle:
        for _ in range(3000):
            handle.write(json.dumps({"text": text_sample(rng)}) + "\n")
    with (OUT / "sample_chat.jsonl").open("w") as handle:
        for _ in range(400):
            question = sentence(rng, rng.randint(5, 20)).rstrip(".") + "?"
            answer = text_sample(rng)
            messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            handle.write(json.dumps({"messages": messages}) + "\n")


if __name__ == "__main__":
    main()
