"""Data at our users' scale: N synthetic ShareGPT chats, a BPE tokenizer trained offline, and the
time and memory from the data to the first plan (issue 30).

    python benchmarks/data_scale.py                         # 600,000 chats of ≈500 tokens
    python benchmarks/data_scale.py --records 100000 --workdir /tmp/scale-100k
    python benchmarks/data_scale.py --steps plain,full       # only these rows

Rows (each a fresh process; peak memory is the PSS of the whole process tree, sampled every 50 ms):
  plain   `datasets.load_dataset("json")` + `map(batched=True, num_proc=cores)` rendering each chat
          with the chat template and tokenizing it (no loss mask): the bar the first tokenization is held to
  cold    `train --dry-run` with empty caches (a plan from a sample of the records)
  warm    the same dry run again (the sample is cached)
  full    `bench data prepare`: every record tokenized, loss masks included, into the cache
  exact   `train --dry-run` once the cache holds every record (the exact profile)
and the sampled token total against the exact one. The chats, the tokenizer and the home stay in
--workdir, so a second invocation skips writing them (pass --fresh to start over).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SYLLABLES = "ka lo mi ne ru sa ti vo ze pa de gu hi jo la me no pi qu re si to un ve wa xi yo zu an el in or".split()


def vocabulary(rng: np.random.Generator, size: int = 6000) -> np.ndarray:
    """Pseudo-words of 1–4 syllables, for text a BPE tokenizer splits like prose."""
    words = {"".join(rng.choice(SYLLABLES, rng.integers(1, 5))) for _ in range(size * 2)}
    return np.array(sorted(words)[:size])


def write_chats(path: Path, count: int, seed: int = 0, mean_words: int = 450) -> None:
    """`count` ShareGPT chats (1–4 exchanges, a system prompt in one of four), lengths log-normal
    around `mean_words` words (≈500 tokens of the benchmark's tokenizer once rendered)."""
    rng = np.random.default_rng(seed)
    words = vocabulary(rng)
    zipf = 1.0 / np.arange(1, len(words) + 1)
    zipf /= zipf.sum()
    sigma = 0.6
    with path.open("w") as handle:
        for start in range(0, count, 10_000):
            block = min(10_000, count - start)
            totals = np.maximum(20, rng.lognormal(np.log(mean_words) - sigma**2 / 2, sigma, block).astype(int))
            pool = words[rng.choice(len(words), int(totals.sum()) + 8 * block, p=zipf)].tolist()
            taken = 0
            lines = []
            for total in totals.tolist():
                exchanges = int(rng.integers(1, 5))
                cuts = np.sort(rng.integers(1, max(2, total), 2 * exchanges - 1)).tolist()
                sizes = np.diff([0, *cuts, total]).tolist()
                turns = [{"from": "system", "value": "You are a helpful assistant."}] if rng.random() < 0.25 else []
                for index, size in enumerate(sizes):
                    size = max(1, size)
                    text = " ".join(pool[taken : taken + size])
                    taken += size
                    turns.append({"from": "human" if index % 2 == 0 else "gpt", "value": text})
                lines.append(json.dumps({"conversations": turns}))
            handle.write("\n".join(lines) + "\n")


def train_tokenizer(chats: Path, folder: Path, vocab_size: int = 16_000, sample_lines: int = 20_000) -> None:
    """A byte-level BPE tokenizer trained on the first chats, with ChatML special tokens and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    def texts() -> Any:
        with chats.open() as handle:
            for number, line in enumerate(handle):
                if number >= sample_lines:
                    return
                for turn in json.loads(line)["conversations"]:
                    yield turn["value"]

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    core.train_from_iterator(texts(), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(str(folder))


PLAIN = """
import json, sys, datasets, transformers
data, tok, procs = sys.argv[1], sys.argv[2], int(sys.argv[3])
tokenizer = transformers.AutoTokenizer.from_pretrained(tok)
roles = {"system": "system", "human": "user", "gpt": "assistant"}
def encode(batch):
    texts = [tokenizer.apply_chat_template([{"role": roles[t["from"]], "content": t["value"]} for t in turns], tokenize=False)
             for turns in batch["conversations"]]
    return {"input_ids": tokenizer(texts, add_special_tokens=False)["input_ids"]}
dataset = datasets.load_dataset("json", data_files=data, split="train")
tokenized = dataset.map(encode, batched=True, num_proc=procs, remove_columns=dataset.column_names)
print(json.dumps({"records": len(tokenized), "tokens": sum(len(ids) for ids in tokenized["input_ids"])}))
"""


def timed(command: list[str], environment: dict[str, str]) -> dict[str, Any]:
    """Wall seconds, exit code, output and peak memory of a command: the proportional set size (PSS)
    summed over its process tree, so pages forked workers share are counted once."""
    import psutil

    started = time.perf_counter()
    process = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watched = psutil.Process(process.pid)
    peak = 0
    output: list[str] = []
    import threading

    reader = threading.Thread(
        target=lambda: output.append(process.stdout.read() if process.stdout else ""), daemon=True
    )
    reader.start()
    while process.poll() is None:
        try:
            tree = [watched, *watched.children(recursive=True)]
            peak = max(peak, sum(member.memory_full_info().pss for member in tree if member.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.05)
    reader.join()
    return {
        "seconds": time.perf_counter() - started,
        "code": process.returncode,
        "output": "".join(output),
        "peak_rss": peak,
    }


def prepare(workdir: Path, records: int, fresh: bool) -> tuple[Path, Path]:
    if fresh and workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    chats, tokenizer = workdir / "chats.jsonl", workdir / "tok"
    marker = workdir / "chats.count"
    if not chats.exists() or not marker.exists() or int(marker.read_text()) != records:
        started = time.perf_counter()
        write_chats(chats, records)
        marker.write_text(str(records))
        print(
            f"wrote {records:,} chats ({chats.stat().st_size / 1e6:,.0f} MB) in {time.perf_counter() - started:.0f}s",
            flush=True,
        )
        shutil.rmtree(tokenizer, ignore_errors=True)
    if not (tokenizer / "tokenizer.json").exists():
        train_tokenizer(chats, tokenizer)
    return chats, tokenizer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=600_000)
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="where the chats, tokenizer and home stay (default: a folder under the temp dir)",
    )
    parser.add_argument("--steps", default="plain,cold,warm,full,exact")
    parser.add_argument("--fresh", action="store_true", help="write the chats and the tokenizer again")
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--use-calibration", default="h100-llama-3.2-1b")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.gettempdir()) / f"benchtrain-data-scale-{args.records}"
    chats, tokenizer = prepare(workdir, args.records, args.fresh)
    home, hf_cache = workdir / "home", workdir / "hf-cache"
    environment = {
        **os.environ,
        "BENCHTRAIN_HOME": str(home),
        "HF_DATASETS_CACHE": str(hf_cache),
        "TOKENIZERS_PARALLELISM": "false",
    }
    cores = os.cpu_count() or 1
    dry_run = [
        sys.executable,
        "-m",
        "benchtrain.train",
        "--dry-run",
        "--use-calibration",
        args.use_calibration,
        "--model",
        args.model,
    ]
    dry_run += ["--tokenizer", str(tokenizer), "--data", str(chats), "--epochs", "3", "--deadline", "12h"]
    commands = {
        "plain": [sys.executable, "-c", PLAIN, str(chats), str(tokenizer), str(cores)],
        "cold": dry_run,
        "warm": dry_run,
        "full": [
            sys.executable,
            "-m",
            "benchtrain.bench",
            "data",
            "prepare",
            "--model",
            args.model,
            "--tokenizer",
            str(tokenizer),
            "--data",
            str(chats),
        ],
        "exact": dry_run,
    }
    print(f"{args.records:,} chats, {cores} cores, workdir {workdir}\n", flush=True)
    print(f"| {'step':<6} | {'wall':>8} | {'peak PSS':>9} | exit |")
    print(f"|{'-' * 8}|{'-' * 10}|{'-' * 11}|------|")
    results = {}
    for step in args.steps.split(","):
        if step in ("plain", "cold"):
            shutil.rmtree(hf_cache, ignore_errors=True)
        if step == "cold":
            shutil.rmtree(home, ignore_errors=True)
        result = results[step] = timed(commands[step], environment)
        print(
            f"| {step:<6} | {result['seconds']:>7.1f}s | {result['peak_rss'] / 1e9:>6.2f} GB | {result['code']:>4} |",
            flush=True,
        )
        if result["code"] != 0 or os.environ.get("DATA_SCALE_VERBOSE"):
            print(result["output"][-3000:])
    print()
    for step, result in results.items():
        for line in result["output"].splitlines():
            if "tokens" in line and ("records" in line or "lengths" in line):
                print(f"{step}: {line.strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
