"""Data formats: which one a dataset is in, and each record as text, a conversation, or a prompt
and its completion.

- `text`: a `text` (or `content`, `body`) column; packed, the loss on every token;
- `messages`: OpenAI-style `messages`, a list of {role, content} with system, user and assistant turns;
- `sharegpt`: `conversations`, a list of {from, value} with human, gpt and system (and the aliases in
  ROLE_ALIASES); a `system` column, when there is one, opens the conversation;
- `alpaca`: `instruction`, an optional `input`, `output` (Dolly's `context` and `response` too) and an
  optional `system`: one user turn and the answer;
- `prompt_completion`: `prompt` + `completion`, the loss on the completion;
- `tokens`: an `input_ids` column of token ids (pre-tokenized); packed, the loss on every token
  (raw .bin/.npy token files: train.workload.pretokenized).

The three chat formats are rendered with the tokenizer's own chat template and the loss is on the
assistant's turns (for Alpaca, the output). Detection is automatic; `--data-format` and the column
options name what it cannot guess.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from common.errors import BenchtrainError

FORMATS = ("text", "messages", "sharegpt", "alpaca", "prompt_completion", "tokens")
CHAT_FORMATS = ("messages", "sharegpt", "alpaca")
TEXT_FIELDS = ("text", "content", "body")
CONVERSATION_FIELDS = ("messages", "conversations", "conversation")
INSTRUCTION_FIELDS = ("instruction",)
INPUT_FIELDS = ("input", "context")
OUTPUT_FIELDS = ("output", "response")
# Speaker names used by ShareGPT-style data (FastChat, axolotl, LLaMA-Factory, OpenAssistant) and
# the chat-template role each one is.
ROLE_ALIASES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "prompter": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "bot": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "tool": "tool",
    "observation": "tool",
}
# What each format's loss is on, as run.json says it (`--train-on all`: every token).
LOSS_ON = {
    "messages": "assistant turns",
    "sharegpt": "assistant turns",
    "alpaca": "outputs",
    "prompt_completion": "completions",
    "text": "all tokens",
    "tokens": "all tokens",
}
TOKEN_FIELD = "input_ids"


@dataclass(frozen=True)
class DataSchema:
    """What the user said about the data's layout: a format (or auto) and column names."""

    format: str = "auto"
    text_field: str | None = None
    messages_field: str | None = None
    prompt_field: str | None = None
    completion_field: str | None = None
    input_field: str | None = None
    system_field: str | None = None
    # Raw token files (train.workload.pretokenized): the ids' dtype and the separator ending each document.
    token_dtype: str | None = None
    document_separator: int | None = None

    def __post_init__(self) -> None:
        if self.format not in ("auto", *FORMATS):
            raise BenchtrainError(f"--data-format must be auto or one of {', '.join(FORMATS)}, got {self.format!r}")


@dataclass(frozen=True)
class Layout:
    """The format found and the columns it reads."""

    format: str
    text: str | None = None
    messages: str | None = None
    prompt: str | None = None  # prompt_completion's prompt, Alpaca's instruction
    completion: str | None = None  # prompt_completion's completion, Alpaca's output
    input: str | None = None  # Alpaca's optional input
    system: str | None = None  # an optional system prompt column (sharegpt, alpaca)

    @property
    def is_chat(self) -> bool:
        return self.format in CHAT_FORMATS

    def column(self, name: str | None) -> str:
        """A column this format needs (set whenever the format is: detect_layout)."""
        if name is None:
            raise BenchtrainError(f"the {self.format} format needs a column that was not named")
        return name

    def messages_of(self, record: dict[str, Any], where: str) -> list[dict[str, str]]:
        """A chat record as {role, content} turns for the chat template."""
        system = str(record.get(self.system) or "") if self.system else ""
        opening = [{"role": "system", "content": system}] if system else []
        if self.format == "alpaca":
            instruction = str(record.get(self.column(self.prompt)) or "")
            extra = str(record.get(self.input) or "") if self.input else ""
            question = f"{instruction}\n\n{extra}" if extra else instruction
            answer = str(record.get(self.column(self.completion)) or "")
            return [*opening, {"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        turns = record.get(self.column(self.messages))
        if not isinstance(turns, list) or not turns:
            raise BenchtrainError(f"{where}: a {self.messages!r} value is not a non-empty list of turns")
        messages = [normalise_turn(turn, where) for turn in turns]
        return messages if messages[0]["role"] == "system" else [*opening, *messages]


def normalise_turn(turn: Any, where: str) -> dict[str, Any]:
    """One turn for the chat template: ShareGPT's {from, value} as {role, content}; OpenAI's
    {role, content, ...} kept whole (tool calls and names too), its role's aliases mapped."""
    if not isinstance(turn, dict):
        raise BenchtrainError(f"{where}: a turn is {type(turn).__name__}, not an object with role/content or from/value")
    if "role" in turn:
        named = str(turn["role"])
        return {**turn, "role": ROLE_ALIASES.get(named.strip().lower(), named)}
    speaker = turn.get("from")
    role = ROLE_ALIASES.get(str(speaker).strip().lower())
    if role is None:
        raise BenchtrainError(f"{where}: unknown speaker {speaker!r} in a turn; accepted: {', '.join(ROLE_ALIASES)}")
    content = turn.get("value", turn.get("content"))
    return {"role": role, "content": "" if content is None else str(content)}


def detect_layout(columns: list[str], schema: DataSchema, where: str, first: dict[str, Any] | None = None) -> Layout:
    """The layout of a dataset with these columns (`first`: its first record, which tells OpenAI
    turns from ShareGPT turns), or a one-line error naming the columns and the formats accepted."""
    present = set(columns)
    fmt = schema.format if schema.format != "auto" else guess_format(present, schema)

    def pick(explicit: str | None, option: str, candidates: tuple[str, ...], required: bool = True) -> str | None:
        if explicit is not None:
            if explicit not in present:
                raise BenchtrainError(f"{where}: {option} {explicit!r} is not a column; columns: {columns}")
            return explicit
        found = next((name for name in candidates if name in present), None)
        if found is None and required:
            raise BenchtrainError(f"{where}: {fmt} data needs a column for {option} ({' or '.join(candidates)}); columns: {columns}")
        return found

    if fmt is None:
        raise BenchtrainError(
            f"{where}: no usable text field in columns {columns}; formats accepted: text (text), messages (role/content turns), "
            "sharegpt (conversations of from/value), alpaca (instruction, input, output), prompt + completion; "
            "or name the columns with --data-format and --text-field, --messages-field, --prompt-field, --completion-field"
        )
    system = pick(schema.system_field, "--system-field", ("system",), required=False)
    if fmt == "tokens":
        return Layout("tokens", text=pick(None, "--data-format tokens", (TOKEN_FIELD,)))
    if fmt == "text":
        return Layout("text", text=pick(schema.text_field, "--text-field", TEXT_FIELDS))
    if fmt in ("messages", "sharegpt"):
        column = pick(schema.messages_field, "--messages-field", CONVERSATION_FIELDS)
        if schema.format == "auto":
            fmt = turn_style(first, column)
        return Layout(fmt, messages=column, system=system)
    if fmt == "alpaca":
        instruction = pick(schema.prompt_field, "--prompt-field", INSTRUCTION_FIELDS)
        output = pick(schema.completion_field, "--completion-field", OUTPUT_FIELDS)
        extra = pick(schema.input_field, "--input-field", INPUT_FIELDS, required=False)
        return Layout("alpaca", prompt=instruction, completion=output, input=extra, system=system)
    prompt = pick(schema.prompt_field, "--prompt-field", ("prompt",))
    return Layout("prompt_completion", prompt=prompt, completion=pick(schema.completion_field, "--completion-field", ("completion",)))


def guess_format(present: set[str], schema: DataSchema) -> str | None:
    """The format the column options or the column names point at, most specific first."""
    if schema.messages_field:
        return "messages"
    if schema.text_field:
        return "text"
    if schema.prompt_field or schema.completion_field:
        return "alpaca" if schema.input_field or (present & set(INSTRUCTION_FIELDS)) else "prompt_completion"
    if TOKEN_FIELD in present and not present & {*TEXT_FIELDS, *CONVERSATION_FIELDS, *INSTRUCTION_FIELDS, "prompt"}:
        return "tokens"
    if present & set(CONVERSATION_FIELDS):
        return "messages"
    if present & set(INSTRUCTION_FIELDS) and present & set(OUTPUT_FIELDS):
        return "alpaca"
    if {"prompt", "completion"} <= present:
        return "prompt_completion"
    if present & set(TEXT_FIELDS):
        return "text"
    return None


def turn_style(first: dict[str, Any] | None, column: str | None) -> str:
    """`sharegpt` when the turns are {from, value} (or, with no record to look at, the column is
    ShareGPT's `conversations`), else `messages`."""
    turns = (first or {}).get(column) if column else None
    if isinstance(turns, list) and turns and isinstance(turns[0], dict):
        return "sharegpt" if "from" in turns[0] and "role" not in turns[0] else "messages"
    return "sharegpt" if column in ("conversations", "conversation") else "messages"


def schema_from_args(args: argparse.Namespace) -> DataSchema:
    return DataSchema(
        format=getattr(args, "data_format", "auto") or "auto",
        text_field=getattr(args, "text_field", None),
        messages_field=getattr(args, "messages_field", None),
        prompt_field=getattr(args, "prompt_field", None),
        completion_field=getattr(args, "completion_field", None),
        input_field=getattr(args, "input_field", None),
        system_field=getattr(args, "system_field", None),
        token_dtype=getattr(args, "token_dtype", None),
        document_separator=getattr(args, "document_separator", None),
    )
