"""RunProcessor: text into the token rows a model reads, and generated rows back into text.

A task with a processor accepts strings; without one it takes token rows. `chat` renders
conversations with the tokenizer's own chat template (and the controls that template defines) into
rows the task takes as they are. Prompts are tokenized
without padding: `generate` pads the numeric rows itself, so a tokenizer without a pad token
works unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class RunProcessor:
    """Wraps a tokenizer (``encode(text) -> ids``, ``decode(ids) -> text``) for a task."""

    tokenizer: Any

    def __post_init__(self):
        if not (callable(getattr(self.tokenizer, "encode", None)) and callable(getattr(self.tokenizer, "decode", None))):
            raise TypeError(
                f"RunProcessor needs a tokenizer with encode(text) and decode(ids); got "
                f"{type(self.tokenizer).__name__}. Pass a ByteTokenizer, an HFTokenizer or a tokenizer directory "
                "loaded with dew.data.load_tokenizer."
            )

    def encode(self, prompts: str | Sequence[str]) -> list[np.ndarray]:
        """One int32 row of token ids per prompt (a single string is one prompt)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        return [np.asarray(self.tokenizer.encode(text), np.int32) for text in prompts]

    def chat(self, conversations: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]], *,
             tools: Any = None, **controls: Any) -> list[np.ndarray]:
        """One prompt row per conversation (a single conversation is one), rendered with the
        tokenizer's chat template and its generation prompt; `controls` are the template's own
        settings (e.g. `enable_thinking=False` for Qwen3), refused when the template reads no such name."""
        from dew.data.chat_messages import ChatTemplate

        source = getattr(self.tokenizer, "chat_template", None)
        if not source:
            raise ValueError(
                f"{type(self.tokenizer).__name__} carries no chat template; pass plain prompts, or load the "
                "tokenizer from a directory whose tokenizer_config.json (or chat_template.jinja) has one."
            )
        if conversations and isinstance(conversations[0], Mapping):
            conversations = [conversations]
        if not conversations or not all(conversation for conversation in conversations):
            raise ValueError("chat takes one conversation (a list of messages) or a list of them, none empty.")
        template = ChatTemplate(source, self.tokenizer)
        return [np.asarray(self.tokenizer.encode(template.render(conversation, tools, add_generation_prompt=True,
                                                                 controls=controls)), np.int32)
                for conversation in conversations]

    def decode(self, tokens: np.ndarray, lengths: np.ndarray, terminated: np.ndarray) -> list[str]:
        """Each row's text: its tokens up to its length, a final EOS token left out."""
        texts = []
        for row, length, ended in zip(np.asarray(tokens), np.asarray(lengths), np.asarray(terminated)):
            ids = row[: int(length) - (1 if ended else 0)]
            texts.append(self.tokenizer.decode([int(i) for i in ids]))
        return texts


def as_processor(value: Any) -> RunProcessor | None:
    """A RunProcessor from a processor, a bare tokenizer, or None."""
    if value is None or isinstance(value, RunProcessor):
        return value
    return RunProcessor(value)


def encode_prompts(prompts: Any, processor: RunProcessor | None) -> Any:
    """Prompts as token rows: strings go through the processor, token ids pass through."""
    if isinstance(prompts, str) or (
        isinstance(prompts, (list, tuple)) and prompts and all(isinstance(p, str) for p in prompts)
    ):
        if processor is None:
            raise ValueError(
                "Text prompts need a processor, and this task has none (its run knew only token ids). "
                "Pass token ids, or bind one: objective.pipeline(state, processor=RunProcessor(tokenizer)) "
                "or dataclasses.replace(task, processor=RunProcessor(tokenizer))."
            )
        return processor.encode(prompts)
    return prompts
