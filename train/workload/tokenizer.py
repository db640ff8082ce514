"""Tokenizers: a local model directory's own, or a byte-level tokenizer built offline.

The byte-level tokenizer maps each UTF-8 byte to one id (256 ids) plus a few special tokens, and
carries a chat template, so presets need nothing downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common.errors import BenchtrainError

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|eos|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
BYTE_TOKENIZER_NAME = "benchtrain-bytes"


def byte_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocabulary = {symbol: index for index, symbol in enumerate(sorted(ByteLevel.alphabet()))}
    core = Tokenizer(models.BPE(vocab=vocabulary, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.name_or_path = BYTE_TOKENIZER_NAME
    return tokenizer


def is_byte_tokenizer(tokenizer: Any) -> bool:
    """Whether token counts are bytes (a preset without a tokenizer of its own)."""
    return getattr(tokenizer, "name_or_path", None) == BYTE_TOKENIZER_NAME


def has_tokenizer_files(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(model_dir: Path | None, tokenizer_dir: str | None) -> Any:
    """`--tokenizer DIR`, else the model directory's own, else (presets) the byte tokenizer."""
    folder = Path(tokenizer_dir).expanduser() if tokenizer_dir else model_dir
    if folder is None:
        return byte_tokenizer()
    if not folder.is_dir() or not has_tokenizer_files(folder):
        raise BenchtrainError(f"no tokenizer in {folder} (looked for {', '.join(TOKENIZER_FILES)}); pass --tokenizer DIR")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as error:
        raise BenchtrainError(f"cannot load the tokenizer in {folder}: {error}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
