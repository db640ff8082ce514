"""Records to token ids a batch at a time, and chat data's loss mask on the assistant's turns from
one rendering per conversation. How the spans are found: docs/design.md#loss-masks-for-chat-data"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from benchtrain.common.errors import BenchtrainError
from benchtrain.common.json_types import JsonDict, JsonValue
from benchtrain.train.workload.formats import Encoded, Layout, Tokenizing

PROBE_QUESTION = "benchtrain probe question"
PROBE_ANSWER = "benchtrain probe answer"
# Conversations whose single-rendering spans are checked against the reference before trusting it.
CROSS_CHECKED = 16


def assistant_character_spans(tokenizer: Any, messages: list[JsonDict]) -> tuple[str, list[tuple[int, int]]]:
    """The reference: the conversation rendered with the tokenizer's own chat template, and the
    character spans that each assistant turn adds to it (the turn's text and its end marker)."""
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for index, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = (
            tokenizer.apply_chat_template(messages[:index], tokenize=False, add_generation_prompt=True) if index else ""
        )
        through = tokenizer.apply_chat_template(messages[: index + 1], tokenize=False)
        if not (rendered.startswith(through) and through.startswith(before)):
            raise BenchtrainError("the chat template does not render conversations turn by turn; pass --train-on all")
        spans.append((len(before), len(through)))
    return rendered, spans


@dataclass(frozen=True)
class TemplateShape:
    """What the chat template writes around an assistant message: its header (the generation
    prompt), text between header and content, and after the content (the end-of-turn marker)."""

    header: str
    before_content: str
    after_content: str

    @classmethod
    def learn(cls, tokenizer: Any) -> TemplateShape | None:
        question = [{"role": "user", "content": PROBE_QUESTION}]
        try:
            plain = tokenizer.apply_chat_template(question, tokenize=False)
            prompted = tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
            through = tokenizer.apply_chat_template(
                [*question, {"role": "assistant", "content": PROBE_ANSWER}], tokenize=False
            )
        except Exception:
            return None
        if not through.startswith(prompted):
            return None
        middle = through[len(prompted) :]
        at = middle.find(PROBE_ANSWER)
        if at < 0:
            return None
        header = prompted[len(plain) :] if prompted.startswith(plain) else ""
        return cls(header, middle[:at], middle[at + len(PROBE_ANSWER) :])

    def spans(self, rendered: str, messages: list[JsonDict]) -> list[tuple[int, int]] | None:
        """The assistant spans in `rendered`, or None where a message cannot be placed exactly."""
        cursor, spans = 0, []
        for message in messages:
            content = message.get("content")
            if not isinstance(content, str):
                return None
            text, at = content, rendered.find(content, cursor)
            if at < 0 and content.strip() != content:  # templates that trim the content
                text = content.strip()
                at = rendered.find(text, cursor)
            if at < 0:
                return None
            end = at + len(text)
            if message.get("role") == "assistant":
                start = at - len(self.before_content)
                close = end + len(self.after_content)
                around = (rendered[max(0, start - len(self.header)) : start], rendered[start:at], rendered[end:close])
                if around != (self.header, self.before_content, self.after_content):
                    return None
                spans.append((start, close))
                end = close
            cursor = end
        return spans


class Encoder:
    """Tokenizes records of `layout` a batch at a time through its format's `encode`, handing it the tokenizer's
    ways from text to ids: plain texts, and chat rendered with the template (masked: a per-token loss mask)."""

    def __init__(self, layout: Layout, tokenizer: Any, path: str, masked: bool) -> None:
        self.layout, self.tokenizer, self.masked = layout, tokenizer, masked
        self.eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self.shape = TemplateShape.learn(tokenizer) if masked else None
        self.checked = 0  # conversations cross-checked against the reference so far
        self.tools = Tokenizing(layout, self._ids, self._chat, self.eos, path)

    def __call__(self, batch: dict[str, list[JsonValue]]) -> Encoded:
        records = [dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)]
        return self.layout.data_format.encode(self.tools, records)

    def _ids(self, texts: list[str]) -> list[list[int]]:
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []

    def _chat(self, conversations: list[list[JsonDict]]) -> tuple[list[list[int]], list[np.ndarray] | None]:
        render = self.tokenizer.apply_chat_template
        if not self.masked:
            return self._ids([render(messages, tokenize=False) for messages in conversations]), None
        found = [self._spans(messages) for messages in conversations]  # (rendered, assistant spans) each
        encoded = self.tokenizer(
            [rendered for rendered, _ in found], add_special_tokens=False, return_offsets_mapping=True
        )
        masks = []
        for offsets, (_, turn_spans) in zip(encoded["offset_mapping"], found, strict=True):
            # A token is trained when it starts inside an assistant turn's span.
            starts = np.fromiter((first for first, _ in offsets), dtype=np.int64, count=len(offsets))
            mask = np.zeros(len(offsets), dtype=np.uint8)
            for start, end in turn_spans:
                mask[np.searchsorted(starts, start, "left") : np.searchsorted(starts, end, "left")] = 1
            masks.append(mask)
        return encoded["input_ids"], masks

    def _spans(self, messages: list[JsonDict]) -> tuple[str, list[tuple[int, int]]]:
        if self.shape is not None:
            rendered = self.tokenizer.apply_chat_template(messages, tokenize=False)
            spans = self.shape.spans(rendered, messages)
            if spans is not None and self.checked >= CROSS_CHECKED:
                return rendered, spans
            if spans is not None:
                self.checked += 1
                reference = assistant_character_spans(self.tokenizer, messages)
                if reference != (rendered, spans):
                    self.shape = None  # this template's spans are not what the reference finds
                return reference
        return assistant_character_spans(self.tokenizer, messages)
