"""Conversations as training rows: render a chat template and keep each token's role.

`ChatMessages` reads records `{"messages": [{"role", "content", "tool_calls"?}, ...], "tools"?}`
from a JSONL file, a parquet file, a local Hub-layout dataset directory (`data/*.jsonl|parquet`)
or a list of dicts, renders each with the tokenizer's Jinja chat template the way transformers
does, and writes rows "text" (`seq_len + 1` ids) and "text_roles" (a `Role` per id).

Roles come from rendering incrementally: the characters the template adds for message k (the
text of `messages[:k+1]` past that of `messages[:k]`) take message k's role, and the tokenizer's
character offsets carry the roles over to tokens. The header a template writes before an assistant
reply (its generation prompt, `<|im_start|>assistant\\n` in ChatML) is template glue (`Role.NONE`),
so `LMObjective(loss_role=Role.ASSISTANT)` learns the replies and their end token, not the header.
Tool schemas before the first message count as the system prompt.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dew.checks import count
from dew.data.chat import Role
from dew.data.dataset import Dataset, Loading
from dew.data.tokenizers import load_tokenizer

_ROLES = {"system": Role.SYSTEM, "user": Role.USER, "assistant": Role.ASSISTANT, "tool": Role.TOOL,
          "ipython": Role.TOOL}


# ----------------------------------------------------------------------------------------------
# Reading records


def read_records(source: Any, what: str = "records") -> list[dict]:
    """Records from a JSONL or parquet file, a Hub-layout directory, or a sequence of dicts."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source).expanduser()
        if path.is_dir():
            files = sorted(
                p for p in (path / "data").rglob("*") if p.suffix in (".jsonl", ".json", ".parquet")
            ) if (path / "data").is_dir() else []
            if not files:
                files = sorted(p for p in path.glob("*") if p.suffix in (".jsonl", ".parquet"))
            if not files:
                raise FileNotFoundError(
                    f"{path} holds no data/*.jsonl or data/*.parquet files (the layout of a Hub "
                    "dataset downloaded with `hf download --repo-type dataset NAME --local-dir DIR`)."
                )
            train = [p for p in files if "train" in p.name] or files
            return [record for file in train for record in read_records(file, what)]
        if not path.is_file():
            raise FileNotFoundError(
                f"No file or directory {str(source)!r}. Dew reads local JSONL or parquet files, or a "
                "Hub dataset downloaded to a directory first (`hf download --repo-type dataset NAME "
                "--local-dir DIR`)."
            )
        if path.suffix == ".parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise ImportError(
                    f"Reading {path.name} needs the 'pyarrow' package: pip install pyarrow "
                    "(or convert the file to JSONL)."
                ) from None
            return pq.read_table(path).to_pylist()
        records = []
        with path.open(encoding="utf-8") as file:
            for number, line in enumerate(file, 1):
                if line.strip():
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError as error:
                        raise ValueError(f"{path}:{number} is not valid JSON: {error}") from None
        return records
    if isinstance(source, Mapping):
        raise TypeError(f"{what} must be a path or a sequence of records, not one record.")
    records = []
    for index, record in enumerate(source):
        if isinstance(record, (str, bytes)):
            try:
                record = json.loads(record)
            except json.JSONDecodeError as error:
                raise ValueError(f"{what}[{index}] is a string but not JSON: {error}") from None
        if not isinstance(record, Mapping):
            raise TypeError(f"{what}[{index}] must be a dict or a JSON string; got {type(record).__name__}.")
        records.append(dict(record))
    return records


# ----------------------------------------------------------------------------------------------
# Rendering a chat template


class TemplateError(ValueError):
    """A chat template refused a conversation (its raise_exception, or a Jinja error)."""


def _environment():
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` (transformers' assistant marker) renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' tojson: no HTML escaping, and unicode kept as is
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(format):
        import datetime

        return datetime.datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


# Names every template gets from the renderer; a template's other free names are its controls.
_RENDERER_NAMES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token",
                             "pad_token", "unk_token", "raise_exception", "strftime_now"})
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # marks the end of the message to continue, as transformers does


class ChatTemplate:
    """A compiled chat template with the special tokens transformers passes to it.

    `controls` are the free names the template reads besides the conversation (Qwen3's
    `enable_thinking`, GPT-OSS's `reasoning_effort`, ...); `render` passes them through, as
    transformers' `apply_chat_template(**kwargs)` does, and refuses a name the template never reads.
    """

    def __init__(self, source: str, tokenizer: Any = None):
        from jinja2 import meta

        self.source = source
        environment = _environment()
        self.template = environment.from_string(source)
        self.controls = frozenset(meta.find_undeclared_variables(environment.parse(source)) - _RENDERER_NAMES)
        self.specials = {}
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            value = getattr(tokenizer, name, None)
            if value is None and tokenizer is not None:
                value = (getattr(tokenizer, "config", None) or {}).get(name)
                value = value.get("content") if isinstance(value, dict) else value
            self.specials[name] = value if isinstance(value, str) else ""

    def check_controls(self, controls: Mapping[str, Any] | None) -> dict[str, Any]:
        """`controls` as a dict, after checking that the template reads each of them."""
        controls = dict(controls or {})
        unknown = sorted(set(controls) - self.controls)
        if unknown:
            offered = ", ".join(sorted(self.controls)) or "none"
            raise ValueError(
                f"The chat template reads no {', '.join(unknown)}; the controls it reads are: {offered}. "
                "Drop the others (each template defines its own)."
            )
        return controls

    def render(self, messages: Sequence[Mapping], tools=None, add_generation_prompt=False, *,
               continue_final_message: bool = False, controls: Mapping[str, Any] | None = None) -> str:
        """The conversation as text. `continue_final_message` leaves the last message open (its
        end-of-turn text cut), so a model continues it; `controls` are the template's own settings."""
        controls = self.check_controls(controls)
        if continue_final_message:
            if add_generation_prompt:
                raise ValueError("add_generation_prompt and continue_final_message exclude each other: the first "
                                 "opens a new assistant turn, the second continues the last message.")
            if not messages or not isinstance(messages[-1].get("content"), str):
                raise ValueError("continue_final_message needs a last message with text content to continue.")
            messages = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + _CONTINUE_TAG}]
        try:
            text = self.template.render(
                messages=list(messages), tools=tools or None,
                add_generation_prompt=add_generation_prompt, **self.specials, **controls,
            )
        except TemplateError:
            raise
        except Exception as error:  # a Jinja error: say which conversation it was
            raise TemplateError(f"the chat template failed: {type(error).__name__}: {error}") from None
        if continue_final_message:
            tag = _CONTINUE_TAG.strip()
            if tag not in text:
                raise TemplateError("the chat template dropped the final message, so it cannot be continued.")
            at = text.rindex(tag)
            text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
        return text


def _common_prefix(a: str, b: str) -> int:
    limit = min(len(a), len(b))
    if a[:limit] == b[:limit]:
        return limit
    low, high = 0, limit  # binary search for the first difference
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def role_spans(template: ChatTemplate, messages: Sequence[Mapping], tools=None,
               controls: Mapping[str, Any] | None = None) -> tuple[str, np.ndarray]:
    """The rendered conversation and the `Role` of each of its characters."""
    text = template.render(messages, tools, controls=controls)
    roles = np.zeros(len(text), np.int8)
    start = _common_prefix(template.render([], tools, controls=controls), text) if messages else len(text)
    roles[:start] = Role.SYSTEM if tools else Role.NONE
    for k, message in enumerate(messages):
        role = _ROLES[message["role"]]
        if k + 1 < len(messages):
            end = _common_prefix(template.render(messages[: k + 1], tools, controls=controls), text)
        else:
            end = len(text)
        end = max(end, start)
        body = start
        if role == Role.ASSISTANT:
            header = template.render(messages[:k], tools, add_generation_prompt=True, controls=controls)
            body = min(max(_common_prefix(header, text), start), end)
        roles[start:body] = Role.NONE
        roles[body:end] = role
        start = end
    return text, roles


def tokens_with_roles(tokenizer: Any, text: str, char_roles: np.ndarray) -> tuple[list[int], np.ndarray]:
    """Token ids of `text` and the role of each token (that of its first character).

    A Hugging Face tokenizer reports character offsets; any other tokenizer encodes each run of
    one role separately (exact for bytes).
    """
    rust = getattr(tokenizer, "_tokenizer", None)
    if rust is not None and hasattr(rust, "encode"):
        encoding = rust.encode(text, add_special_tokens=False)
        roles = np.zeros(len(encoding.ids), np.int8)
        previous = Role.NONE
        for i, (begin, end) in enumerate(encoding.offsets):
            if end > begin and begin < len(char_roles):
                previous = char_roles[begin]
            roles[i] = previous
        return list(encoding.ids), roles
    ids: list[int] = []
    roles_list: list[int] = []
    cuts = np.flatnonzero(np.diff(char_roles)) + 1
    for begin, end in zip(np.r_[0, cuts], np.r_[cuts, len(text)]):
        if end > begin:
            piece = tokenizer.encode(text[begin:end])
            ids.extend(piece)
            roles_list.extend([int(char_roles[begin])] * len(piece))
    return ids, np.asarray(roles_list, np.int8)


def _check_messages(record: Mapping, index: int) -> tuple[list[dict], Any]:
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            f"record {index} needs a non-empty 'messages' list of {{'role', 'content'}} dicts; "
            f"it has keys {sorted(record)}."
        )
    clean = []
    for number, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message:
            raise ValueError(f"record {index}, message {number} must be a dict with a 'role'; got {message!r}.")
        if message["role"] not in _ROLES:
            raise ValueError(
                f"record {index}, message {number} has role {message['role']!r}, which Dew does not "
                f"know; roles are {sorted(_ROLES)}."
            )
        message = dict(message)
        if isinstance(message.get("tool_calls"), str):  # parquet exports keep nested JSON as text
            message["tool_calls"] = json.loads(message["tool_calls"])
        if message.get("tool_calls") is None:
            message.pop("tool_calls", None)
        clean.append(message)
    tools = record.get("tools")
    if isinstance(tools, str):
        tools = json.loads(tools) if tools.strip() else None
    return clean, tools


# ----------------------------------------------------------------------------------------------
# The dataset


class ChatMessages:
    """Conversations rendered with a chat template into "text" and "text_roles" rows.

    Each row holds `seq_len + 1` ids (the LMObjective layout): shorter conversations are padded
    with the tokenizer's pad id (role NONE, and 0 in the "mask" column), longer ones truncated.
    `tokenizer` is a tokenizer object, a tokenizer directory or a Hub repository id (read through
    the Hugging Face cache). `chat_template` overrides the tokenizer's own template, and
    `chat_template_kwargs` sets the controls the template defines (e.g. `{"enable_thinking": False}`
    for Qwen3's), as transformers' `apply_chat_template(**kwargs)` passes them.
    """

    def __init__(
        self,
        source: Any,
        tokenizer: Any,
        seq_len: int,
        *,
        loading: Loading = Loading(),
        seed: int = 0,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ):
        seq_len = count(seq_len, "ChatMessages seq_len")
        tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, (str, os.PathLike)) else tokenizer
        template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
        if not template:
            raise ValueError(
                f"{type(tokenizer).__name__} has no chat template; use a tokenizer whose "
                "tokenizer_config.json (or chat_template.jinja) carries one, or pass chat_template=."
            )
        self.source = source
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.loading = loading
        self.seed = seed
        self.template = ChatTemplate(template, tokenizer)
        self.controls = self.template.check_controls(chat_template_kwargs)
        pad = getattr(tokenizer, "pad_id", None)
        pad = getattr(tokenizer, "eos_id", None) if pad is None else pad
        self.pad_id = 0 if pad is None else int(pad)
        self._columns: dict[str, np.ndarray] | None = None

    def render(self, record: Mapping, index: int = 0) -> tuple[list[int], np.ndarray]:
        """One conversation's token ids and their roles, before padding."""
        messages, tools = _check_messages(record, index)
        try:
            text, char_roles = role_spans(self.template, messages, tools, self.controls)
        except TemplateError as error:
            raise ValueError(f"record {index}: {error}") from None
        return tokens_with_roles(self.tokenizer, text, char_roles)

    def columns(self) -> dict[str, np.ndarray]:
        """Every record as padded or truncated "text", "text_roles" and "mask" columns."""
        if self._columns is None:
            records = read_records(self.source, "source")
            if not records:
                raise ValueError(f"{self.source!r} holds no conversations.")
            width = self.seq_len + 1
            text = np.full((len(records), width), self.pad_id, np.int32)
            roles = np.zeros((len(records), width), np.int8)
            mask = np.zeros((len(records), width), np.int32)
            for index, record in enumerate(records):
                ids, token_roles = self.render(record, index)
                n = min(len(ids), width)
                text[index, :n] = ids[:n]
                roles[index, :n] = token_roles[:n]
                mask[index, :n] = 1
            self._columns = {"text": text, "text_roles": roles, "mask": mask}
        return self._columns

    def load(self, batch: int) -> Dataset:
        """Shuffled batches that repeat forever (a Grain iterator with get_state/set_state)."""
        return Dataset.from_records(self.columns(), batch=batch, seed=self.seed, loading=self.loading)

    def __len__(self) -> int:
        return len(self.columns()["text"])

