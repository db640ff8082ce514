"""Tokenizers: a local model directory's own, or a byte-level tokenizer built offline (256 byte ids
and a chat template). docs/design.md#tokenizers"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel

from benchtrain.common.errors import BenchtrainError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|eos|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
BYTE_TOKENIZER_NAME = "benchtrain-bytes"
# For a base model whose tokenizer has no chat template, ChatML as TRL gives it, its markers plain text
# (no tokens added: the embeddings keep their size). Why: docs/design.md#tokenizers
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TEMPLATE_SOURCE = "benchtrain_chat_template_source"  # set on a tokenizer whose template benchtrain added


def byte_tokenizer() -> PreTrainedTokenizerFast:
    from transformers import PreTrainedTokenizerFast

    vocabulary = {symbol: index for index, symbol in enumerate(sorted(ByteLevel.alphabet()))}
    core = Tokenizer(models.BPE(vocab=vocabulary, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.name_or_path = BYTE_TOKENIZER_NAME
    return tokenizer


def is_byte_tokenizer(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether token counts are bytes (a preset without a tokenizer of its own)."""
    return getattr(tokenizer, "name_or_path", None) == BYTE_TOKENIZER_NAME


def load_tokenizer(model_dir: Path | None, tokenizer_dir: str | None) -> PreTrainedTokenizerBase:
    """`--tokenizer DIR`, else the model directory's own, else (presets) the byte tokenizer."""
    folder = Path(tokenizer_dir).expanduser() if tokenizer_dir else model_dir
    if folder is None:
        return byte_tokenizer()
    if not folder.is_dir() or not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise BenchtrainError(
            f"no tokenizer in {folder} (looked for {', '.join(TOKENIZER_FILES)}); pass --tokenizer DIR"
        )
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as error:
        raise BenchtrainError(f"cannot load the tokenizer in {folder}: {error}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def ensure_chat_template(tokenizer: PreTrainedTokenizerBase) -> str:
    """Give a tokenizer without a chat template ChatML (plain text, no tokens added); the template's source:
    "tokenizer" (its own) or "chatml" (added here). Before the data's cache key is taken: the key digests the template
    (train.workload.prepare.tokenizer_fingerprint)."""
    if getattr(tokenizer, "chat_template", None):
        return str(getattr(tokenizer, TEMPLATE_SOURCE, "tokenizer"))
    tokenizer.chat_template = CHATML_TEMPLATE
    setattr(tokenizer, TEMPLATE_SOURCE, "chatml")
    return "chatml"


def chat_template_note(source: str | None) -> str | None:
    """The plan's line when the chat template is not the tokenizer's own."""
    if source != "chatml":
        return None
    return (
        "chat template: ChatML (<|im_start|>role\\n…<|im_end|>), added because the tokenizer has none (a base model), as TRL does; "
        "plain text, no tokens added; saved with final/'s tokenizer"
    )
