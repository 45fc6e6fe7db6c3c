"""Prompts for online reinforcement learning, with the metadata a reward function reads.

A record holds "prompt" (token ids; text, with a tokenizer; or chat messages, rendered with the
tokenizer's chat template and its generation prompt, with `chat_template_kwargs` as the template's
controls) and the strings a reward reads:
"data_source", "ground_truth" (or verl's `reward_model.ground_truth`) and "extra_info" (a dict is
stored as JSON). A batch holds:

    prompt         [prompt_len] int32   ids, padded with pad_id
    prompt_length  []           int32   the prompt's real length
    data_source    [width]      int32   UTF-8 bytes, padded with -1 (every string column the same way)
    ground_truth   [width]      int32
    extra_info     [width]      int32

`decode_text` turns a byte column row back into its string.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from dew.checks import count
from dew.data.chat_messages import ChatTemplate, read_records
from dew.data.dataset import Dataset, Loading

TEXT_FIELDS = ("data_source", "ground_truth", "extra_info")
TEXT_PAD = -1  # not a byte, so a string's own NUL bytes survive


def encode_text(text: str) -> np.ndarray:
    """A string as its UTF-8 bytes in an int32 vector."""
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)


def decode_text(row: Any) -> str:
    """A byte row back to its string, padding (negative values) dropped."""
    values = np.asarray(row).reshape(-1)
    values = values[values >= 0]
    if values.size and values.max() > 255:
        raise ValueError(f"a UTF-8 text column holds bytes in [0, 255]; got {int(values.max())}.")
    return values.astype(np.uint8).tobytes().decode("utf-8", "replace")


def _as_string(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


class Prompts:
    """Prompt rows and reward metadata for `SampledRollout` (see the module docstring)."""

    def __init__(
        self,
        records: Any = None,
        prompt_len: int | None = None,
        *,
        path: str | os.PathLike | None = None,
        tokenizer: Any = None,
        loading: Loading = Loading(),
        seed: int = 0,
        pad_id: int | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ):
        if isinstance(records, (str, os.PathLike)) and path is None:
            records, path = None, records
        if (records is None) == (path is None):
            raise ValueError("Prompts takes exactly one of records= (dicts or JSON strings) or path=.")
        prompt_len = count(prompt_len, "Prompts prompt_len")
        self.records = records
        self.path = path
        self.prompt_len = prompt_len
        self.tokenizer = tokenizer
        self.loading = loading
        self.seed = seed
        if pad_id is None:
            pad_id = getattr(tokenizer, "pad_id", None)
        self.pad_id = 0 if pad_id is None else int(pad_id)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self._columns: dict[str, np.ndarray] | None = None

    def _prompt_ids(self, prompt: Any, index: int) -> list[int]:
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], dict)):
            if self.tokenizer is None:
                raise ValueError(f"prompt record {index} holds text; pass Prompts(..., tokenizer=).")
            if isinstance(prompt, str):
                return list(self.tokenizer.encode(prompt))
            template = getattr(self.tokenizer, "chat_template", None)
            if not template:
                raise ValueError(f"prompt record {index} holds chat messages, but the tokenizer has no chat template.")
            text = ChatTemplate(template, self.tokenizer).render(prompt, add_generation_prompt=True,
                                                                 controls=self.chat_template_kwargs)
            return list(self.tokenizer.encode(text))
        ids = np.asarray(prompt)
        if ids.ndim != 1 or not ids.size or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"prompt record {index}: 'prompt' must be non-empty token ids, text or messages; got {prompt!r}.")
        return ids.astype(np.int64).tolist()

    def columns(self) -> dict[str, np.ndarray]:
        if self._columns is not None:
            return self._columns
        records = read_records(self.path if self.path is not None else self.records, "records")
        if not records:
            raise ValueError("Prompts has no records.")
        prompts = np.full((len(records), self.prompt_len), self.pad_id, np.int32)
        lengths = np.zeros(len(records), np.int32)
        texts: dict[str, list[np.ndarray]] = {name: [] for name in TEXT_FIELDS}
        for index, record in enumerate(records):
            if "prompt" not in record:
                raise ValueError(f"prompt record {index} has no 'prompt' (it has {sorted(record)}).")
            ids = self._prompt_ids(record["prompt"], index)
            if len(ids) > self.prompt_len:
                raise ValueError(
                    f"prompt record {index} has {len(ids)} tokens, more than prompt_len="
                    f"{self.prompt_len}. Raise prompt_len or shorten the prompt."
                )
            prompts[index, : len(ids)] = ids
            lengths[index] = len(ids)
            truth = record.get("ground_truth")
            if truth is None and isinstance(record.get("reward_model"), dict):
                truth = record["reward_model"].get("ground_truth")
            values = {"data_source": record.get("data_source"), "ground_truth": truth,
                      "extra_info": record.get("extra_info")}
            for name in TEXT_FIELDS:
                texts[name].append(encode_text(_as_string(values[name])))
        columns = {"prompt": prompts, "prompt_length": lengths}
        for name, rows in texts.items():
            width = max(row.size for row in rows)
            column = np.full((len(rows), width), TEXT_PAD, np.int32)
            for index, row in enumerate(rows):
                column[index, : row.size] = row
            columns[name] = column
        self._columns = columns
        return columns

    def load(self, batch: int) -> Dataset:
        """Shuffled batches that repeat forever (a Grain iterator with get_state/set_state)."""
        return Dataset.from_records(self.columns(), batch=batch, seed=self.seed, loading=self.loading)

    def __len__(self) -> int:
        return len(self.columns()["prompt"])
