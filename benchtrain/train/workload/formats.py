"""Data formats, one `DataFormat` entry each in `FORMATS`: how a format is recognised from the columns, which
columns it reads, how records become token ids and what the loss is on. The design: docs/design.md#data-formats"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import numpy as np

from benchtrain.common.errors import BenchtrainError
from benchtrain.common.json_types import JsonDict, JsonValue

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
TOKEN_FIELD = "input_ids"
# A format's claim on a dataset (DataFormat.claim): the lowest wins. A column option (--text-field,
# ...) names a format more surely than the column names do, so its claims come first.
BY_OPTION = 0
BY_COLUMNS = 100

Record = JsonDict
Turns = list[JsonDict]
# What a batch of records becomes: ids per record, a loss mask per record (or None), the prompt's length per record.
Encoded = tuple[list[list[int]], list[np.ndarray] | None, list[int]]


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
    # Raw token files (train.workload.tokens): the ids' dtype and the separator ending each document.
    token_dtype: str | None = None
    document_separator: int | None = None

    def __post_init__(self) -> None:
        if self.format not in ("auto", *FORMATS):
            raise BenchtrainError(f"--data-format must be auto or one of {', '.join(FORMATS)}, got {self.format!r}")


@dataclass(frozen=True)
class Layout:
    """The format found and the columns it reads. Its fields are part of the data cache's key
    (train.workload.prepare.cache_key): a new format reuses them rather than adding its own."""

    format: str
    text: str | None = None
    messages: str | None = None
    prompt: str | None = None  # prompt_completion's prompt, Alpaca's instruction
    completion: str | None = None  # prompt_completion's completion, Alpaca's output
    input: str | None = None  # Alpaca's optional input
    system: str | None = None  # an optional system prompt column (sharegpt, alpaca)

    @property
    def data_format(self) -> DataFormat:
        return FORMATS[self.format]

    def column(self, name: str | None) -> str:
        """A column this format needs (set whenever the format is: detect_layout)."""
        if name is None:
            raise BenchtrainError(f"the {self.format} format needs a column that was not named")
        return name

    def messages_of(self, record: Record, where: str) -> Turns:
        """A chat record as {role, content} turns for the chat template."""
        turns = self.data_format.turns
        if turns is None:
            raise BenchtrainError(f"{where}: {self.format} records are not conversations")
        return turns(self, record, where)


@dataclass(frozen=True)
class Columns:
    """What a format's `layout` reads to choose its columns: the dataset's columns, the user's
    options, the first record, and the system column (checked for every format)."""

    format: str
    names: list[str]
    schema: DataSchema
    where: str
    first: Record | None
    system: str | None = None

    def pick(self, explicit: str | None, option: str, candidates: tuple[str, ...], required: bool = True) -> str | None:
        """The column `option` names, else the first of `candidates` present (a one-line error when
        a named column is missing, or a required one is not found)."""
        if explicit is not None:
            if explicit not in self.names:
                raise BenchtrainError(f"{self.where}: {option} {explicit!r} is not a column; columns: {self.names}")
            return explicit
        found = next((name for name in candidates if name in self.names), None)
        if found is None and required:
            raise BenchtrainError(
                f"{self.where}: {self.format} data needs a column for {option} ({' or '.join(candidates)}); columns: {self.names}"
            )
        return found


@dataclass(frozen=True)
class Tokenizing:
    """What a format's `encode` is handed (train.workload.encode.Encoder makes it): the layout, the
    tokenizer's ways from text to ids, and the end-of-sequence id (none when the tokenizer has none)."""

    layout: Layout
    ids: Callable[[list[str]], list[list[int]]]  # texts to ids, no special tokens added
    # conversations to ids and loss masks
    chat: Callable[[list[Turns]], tuple[list[list[int]], list[np.ndarray] | None]]
    eos: list[int]
    where: str

    def texts(self, records: list[Record], column: str | None) -> list[str]:
        name = self.layout.column(column)
        return [str(record[name] or "") for record in records]


@dataclass(frozen=True)
class DataFormat:
    """One data format, as every reader needs it. The functions are module-level (the encoder runs
    in forked worker processes and DataLoader workers may pickle what refers to it)."""

    name: str
    help: str  # its phrase in --data-format's help
    accepted: str | None  # its phrase in the error listing the formats detection recognises (None: not listed)
    # how surely the columns and options say this format (lowest wins; None: not at all)
    claim: Callable[[set[str], DataSchema], int | None]
    layout: Callable[[Columns], Layout]  # the columns it reads
    encode: Callable[[Tokenizing, list[Record]], Encoded]  # a batch of records to ids, masks, prompt lengths
    loss_on: str  # what the loss is on, as run.json says it (`--train-on all` on chat data: every token)
    packs: bool = False  # documents packed back to back into rows (else one padded sample each)
    prompts: bool = False  # the store keeps each document's prompt length: the loss starts after it
    chat: bool = False  # rendered with the chat template; masked to the assistant's turns unless --train-on all
    turns: Callable[[Layout, Record, str], Turns] | None = None  # chat formats: a record as its turns


def normalise_turn(turn: JsonValue, where: str) -> JsonDict:
    """One turn for the chat template: ShareGPT's {from, value} as {role, content}; OpenAI's
    {role, content, ...} kept whole (tool calls and names too), its role's aliases mapped."""
    if not isinstance(turn, dict):
        raise BenchtrainError(
            f"{where}: a turn is {type(turn).__name__}, not an object with role/content or from/value"
        )
    if "role" in turn:
        named = str(turn["role"])
        return {**turn, "role": ROLE_ALIASES.get(named.strip().lower(), named)}
    speaker = turn.get("from")
    role = ROLE_ALIASES.get(str(speaker).strip().lower())
    if role is None:
        raise BenchtrainError(f"{where}: unknown speaker {speaker!r} in a turn; accepted: {', '.join(ROLE_ALIASES)}")
    content = turn.get("value", turn.get("content"))
    return {"role": role, "content": "" if content is None else str(content)}


def detect_layout(columns: list[str], schema: DataSchema, where: str, first: Record | None = None) -> Layout:
    """The layout of a dataset with these columns (`first`: its first record, which tells OpenAI
    turns from ShareGPT turns), or a one-line error naming the columns and the formats accepted."""
    fmt = schema.format if schema.format != "auto" else guess_format(set(columns), schema)
    if fmt is None:
        accepted = ", ".join(entry.accepted for entry in FORMATS.values() if entry.accepted)
        raise BenchtrainError(
            f"{where}: no usable text field in columns {columns}; formats accepted: {accepted}; "
            "or name the columns with --data-format and --text-field, --messages-field, --prompt-field, --completion-field"
        )
    found = Columns(fmt, columns, schema, where, first)
    system = found.pick(schema.system_field, "--system-field", ("system",), required=False)
    return FORMATS[fmt].layout(replace(found, system=system))


def guess_format(present: set[str], schema: DataSchema) -> str | None:
    """The format whose claim on these columns and options is surest (the table's order breaks ties)."""
    claims = [
        (claim, order, name)
        for order, (name, entry) in enumerate(FORMATS.items())
        if (claim := entry.claim(present, schema)) is not None
    ]
    return min(claims)[2] if claims else None


def turn_style(first: Record | None, column: str | None) -> str:
    """`sharegpt` when the turns are {from, value} (or, with no record to look at, the column is ShareGPT's `conversations`), else `messages`."""
    turns = (first or {}).get(column) if column else None
    if isinstance(turns, list) and turns and isinstance(turns[0], dict):
        return "sharegpt" if "from" in turns[0] and "role" not in turns[0] else "messages"
    return "sharegpt" if column in ("conversations", "conversation") else "messages"


def format_help() -> str:
    """--data-format's help: the formats, as the table lists them."""
    return f"the data's format (default: auto, from the columns): {', '.join(entry.help for entry in FORMATS.values())}"


def schema_from_args(args: argparse.Namespace) -> DataSchema:
    """The schema the options say (each field's option has its name; the format's is --data-format)."""
    columns = {
        option.name: getattr(args, option.name, None) for option in fields(DataSchema) if option.name != "format"
    }
    return DataSchema(format=getattr(args, "data_format", "auto") or "auto", **columns)


# -- text ----------------------------------------------------------------------------------------
def text_claim(present: set[str], schema: DataSchema) -> int | None:
    if schema.text_field:
        return BY_OPTION + 1
    return BY_COLUMNS + 40 if present & set(TEXT_FIELDS) else None


def text_layout(columns: Columns) -> Layout:
    return Layout("text", text=columns.pick(columns.schema.text_field, "--text-field", TEXT_FIELDS))


def encode_text(tools: Tokenizing, records: list[Record]) -> Encoded:
    return [ids + tools.eos for ids in tools.ids(tools.texts(records, tools.layout.text))], None, [0] * len(records)


# -- chat: messages, sharegpt, alpaca --------------------------------------------------------------
def messages_claim(present: set[str], schema: DataSchema) -> int | None:
    if schema.messages_field:
        return BY_OPTION
    return BY_COLUMNS + 10 if present & set(CONVERSATION_FIELDS) else None


def no_claim(present: set[str], schema: DataSchema) -> int | None:  # sharegpt: found by messages' turn style
    return None


def conversation_layout(columns: Columns) -> Layout:
    column = columns.pick(columns.schema.messages_field, "--messages-field", CONVERSATION_FIELDS)
    # Detected, not named: the first record's turns tell OpenAI's from ShareGPT's.
    fmt = turn_style(columns.first, column) if columns.schema.format == "auto" else columns.format
    return Layout(fmt, messages=column, system=columns.system)


def system_opening(layout: Layout, record: Record) -> Turns:
    system = str(record.get(layout.system) or "") if layout.system else ""
    return [{"role": "system", "content": system}] if system else []


def conversation_turns(layout: Layout, record: Record, where: str) -> Turns:
    turns = record.get(layout.column(layout.messages))
    if not isinstance(turns, list) or not turns:
        raise BenchtrainError(f"{where}: a {layout.messages!r} value is not a non-empty list of turns")
    messages = [normalise_turn(turn, where) for turn in turns]
    return messages if messages[0]["role"] == "system" else [*system_opening(layout, record), *messages]


def alpaca_claim(present: set[str], schema: DataSchema) -> int | None:
    if (schema.prompt_field or schema.completion_field) and (schema.input_field or present & set(INSTRUCTION_FIELDS)):
        return BY_OPTION + 2
    return BY_COLUMNS + 20 if present & set(INSTRUCTION_FIELDS) and present & set(OUTPUT_FIELDS) else None


def alpaca_layout(columns: Columns) -> Layout:
    schema = columns.schema
    instruction = columns.pick(schema.prompt_field, "--prompt-field", INSTRUCTION_FIELDS)
    output = columns.pick(schema.completion_field, "--completion-field", OUTPUT_FIELDS)
    extra = columns.pick(schema.input_field, "--input-field", INPUT_FIELDS, required=False)
    return Layout("alpaca", prompt=instruction, completion=output, input=extra, system=columns.system)


def alpaca_turns(layout: Layout, record: Record, where: str) -> Turns:
    instruction = str(record.get(layout.column(layout.prompt)) or "")
    extra = str(record.get(layout.input) or "") if layout.input else ""
    question = f"{instruction}\n\n{extra}" if extra else instruction
    answer = str(record.get(layout.column(layout.completion)) or "")
    return [
        *system_opening(layout, record),
        {"role": "user", "content": question},
        {"role": "assistant", "content": answer},
    ]


def encode_chat(tools: Tokenizing, records: list[Record]) -> Encoded:
    conversations = [tools.layout.messages_of(record, tools.where) for record in records]
    return (*tools.chat(conversations), [0] * len(records))


# -- prompt + completion ---------------------------------------------------------------------------
def prompt_completion_claim(present: set[str], schema: DataSchema) -> int | None:
    if schema.prompt_field or schema.completion_field:
        return BY_OPTION + 3
    return BY_COLUMNS + 30 if {"prompt", "completion"} <= present else None


def prompt_completion_layout(columns: Columns) -> Layout:
    prompt = columns.pick(columns.schema.prompt_field, "--prompt-field", ("prompt",))
    return Layout(
        "prompt_completion",
        prompt=prompt,
        completion=columns.pick(columns.schema.completion_field, "--completion-field", ("completion",)),
    )


def encode_prompt_completion(tools: Tokenizing, records: list[Record]) -> Encoded:
    """The prompt's ids then the completion's and EOS; the loss starts after the prompt."""
    prompts = tools.ids(tools.texts(records, tools.layout.prompt))
    completions = tools.ids(tools.texts(records, tools.layout.completion))
    return [p + c + tools.eos for p, c in zip(prompts, completions, strict=True)], None, [len(p) for p in prompts]


# -- tokens ----------------------------------------------------------------------------------------
def tokens_claim(present: set[str], schema: DataSchema) -> int | None:
    # input_ids beside a column of text is an ordinary dataset that kept its ids: read the text.
    if TOKEN_FIELD in present and not present & {*TEXT_FIELDS, *CONVERSATION_FIELDS, *INSTRUCTION_FIELDS, "prompt"}:
        return BY_COLUMNS
    return None


def tokens_layout(columns: Columns) -> Layout:
    return Layout("tokens", text=columns.pick(None, "--data-format tokens", (TOKEN_FIELD,)))


def encode_tokens(tools: Tokenizing, records: list[Record]) -> Encoded:
    """Pre-tokenized: the ids as they are."""
    column = tools.layout.column(tools.layout.text)
    return [list(record[column] or []) for record in records], None, [0] * len(records)


# The formats, in the order --data-format lists them. Adding one: an entry here (its claim's number
# places it among the others': BY_OPTION + n for a column option, BY_COLUMNS + n for column names).
FORMATS: dict[str, DataFormat] = {
    entry.name: entry
    for entry in (
        DataFormat("text", "text", "text (text)", text_claim, text_layout, encode_text, "all tokens", packs=True),
        DataFormat(
            "messages",
            "messages (OpenAI)",
            "messages (role/content turns)",
            messages_claim,
            conversation_layout,
            encode_chat,
            "assistant turns",
            chat=True,
            turns=conversation_turns,
        ),
        DataFormat(
            "sharegpt",
            "sharegpt",
            "sharegpt (conversations of from/value)",
            no_claim,
            conversation_layout,
            encode_chat,
            "assistant turns",
            chat=True,
            turns=conversation_turns,
        ),
        DataFormat(
            "alpaca",
            "alpaca",
            "alpaca (instruction, input, output)",
            alpaca_claim,
            alpaca_layout,
            encode_chat,
            "outputs",
            chat=True,
            turns=alpaca_turns,
        ),
        DataFormat(
            "prompt_completion",
            "prompt_completion",
            "prompt + completion",
            prompt_completion_claim,
            prompt_completion_layout,
            encode_prompt_completion,
            "completions",
            prompts=True,
        ),
        DataFormat(
            "tokens",
            "tokens (an input_ids column)",
            None,
            tokens_claim,
            tokens_layout,
            encode_tokens,
            "all tokens",
            packs=True,
        ),
    )
}
