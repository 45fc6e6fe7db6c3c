"""ServedModel: what both HTTP APIs share about the one model a server serves.

It turns request settings into the engine's terms: text and chat messages into prompt ids (through
the checkpoint's tokenizer and chat template), sampling settings over the checkpoint's defaults into
a `Sampling`, `max_tokens` into a budget that fits the capacity, and a request into text pieces.
Anything a request asks that cannot be served raises `APIError` with the field it names, before
the engine sees it.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from dew.inference.http.pieces import Piece, text_pieces
from dew.sampling.text import Sampling


GRAMMARS_KEPT = 16  # compiled JSON-schema grammars a server keeps


class APIError(Exception):
    """A request the server refuses: the HTTP status, a message, and the request field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def validation_error(errors: list[dict]) -> APIError:
    """The first problem FastAPI found in a request body, said with the field it names."""
    error = errors[0] if errors else {"msg": "invalid request", "loc": (), "type": ""}
    where = [str(part) for part in error.get("loc", ()) if part != "body"]
    field = ".".join(where) or None
    kind = error.get("type", "")
    if kind == "json_invalid":
        return APIError(400, f"The request body is not valid JSON: {error.get('ctx', {}).get('error', error['msg'])}.")
    if kind == "extra_forbidden":
        return APIError(400, f"Unknown field {field!r}: this endpoint does not read it; remove it.", field)
    if kind == "missing":
        return APIError(400, f"The field {field!r} is required.", field)
    given = error.get("input")
    shown = json.dumps(given) if isinstance(given, (int, float, str, bool, type(None))) else type(given).__name__
    return APIError(400, f"{field or 'The request body'}: {error['msg']}; got {shown}.", field)


def random_seed() -> int:
    """A seed for a request that names none: such a request is not meant to be reproducible."""
    return secrets.randbits(31)


@dataclasses.dataclass
class ServedModel:
    """The served model: its name, engine, tokenizer, default sampling and request capacity.

    `engine` follows the serving contract (`generate`, `stats`, `start`, `stop`, `capacity`);
    `tokenizer` has encode/decode (and `chat_template` for chat), or is None for a model that
    reads token ids only.
    """

    name: str
    engine: Any
    tokenizer: Any
    sampling: Sampling
    vocab_size: int
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    _grammars: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False)

    @classmethod
    def from_engine(cls, engine: Any, name: str) -> ServedModel:
        task = engine.task
        tokenizer = None if task.processor is None else task.processor.tokenizer
        return cls(name=name, engine=engine, tokenizer=tokenizer, sampling=task.sampling,
                   vocab_size=int(task.model.vocab_size))

    @property
    def capacity(self) -> int:
        return int(self.engine.capacity)

    def check_name(self, name: str) -> None:
        if name != self.name:
            raise APIError(404, f"The model {name!r} does not exist; this server serves {self.name!r}.", "model",
                           kind="not_found_error")

    # --- prompts --------------------------------------------------------------------------------

    def _needs_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise APIError(400, f"{self.name!r} has no tokenizer, so it cannot read {what}; send the prompt as "
                                "a list of token ids.", "prompt")
        return self.tokenizer

    def encode(self, text: str, param: str = "prompt") -> list[int]:
        ids = [int(i) for i in self._needs_tokenizer("text").encode(text)]
        if not ids:
            raise APIError(400, f"{param} is empty: it encodes to no tokens.", param)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._needs_tokenizer("text").decode(list(ids))

    def token_ids(self, ids: Sequence[int], param: str = "prompt") -> list[int]:
        """Token ids checked against the vocabulary."""
        if not ids:
            raise APIError(400, f"{param} is empty.", param)
        outside = [i for i in ids if not 0 <= i < self.vocab_size]
        if outside:
            raise APIError(400, f"{param} holds token id {outside[0]}, outside the vocabulary [0, {self.vocab_size}).",
                           param)
        return list(ids)

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]], tools: Any = None,
                    controls: Mapping[str, Any] | None = None) -> list[int]:
        """Prompt ids of a conversation rendered by the checkpoint's chat template, ending with the
        header of the assistant's reply; `controls` are the template's own settings."""
        from dew.data.chat_messages import ChatTemplate, TemplateError

        tokenizer = self._needs_tokenizer("chat messages")
        source = getattr(tokenizer, "chat_template", None)
        if not source:
            raise APIError(400, f"{self.name!r} has no chat template (its tokenizer carries none); send a plain "
                                "prompt to the completion endpoint instead.", "messages")
        if not messages:
            raise APIError(400, "messages is empty; send at least one message.", "messages")
        template = ChatTemplate(source, tokenizer)
        try:
            template.check_controls(controls)
        except ValueError as error:
            raise APIError(400, str(error), "chat_template_kwargs") from None
        try:
            text = template.render(messages, tools, add_generation_prompt=True, controls=controls)
        except TemplateError as error:
            raise APIError(400, f"The chat template refused these messages: {error}", "messages") from None
        return self.encode(text, "messages")

    # --- settings -------------------------------------------------------------------------------

    def sampling_for(self, *, temperature: float | None = None, top_p: float | None = None,
                     top_k: int | None = None, min_p: float | None = None,
                     stop_token_ids: Sequence[int] | None = None, ignore_eos: bool = False) -> Sampling:
        """The checkpoint's sampling defaults with the request's settings over them. `top_k` of 0
        or less and `min_p` of 0 turn those filters off; `stop_token_ids` end a continuation
        besides the checkpoint's EOS ids, which `ignore_eos` drops."""
        changes: dict[str, Any] = {}
        if temperature is not None:
            changes["temperature"] = float(temperature)
        if top_p is not None:
            changes["top_p"] = None if top_p >= 1 else float(top_p)
        if top_k is not None:
            changes["top_k"] = int(top_k) if top_k > 0 else None
        if min_p is not None:
            changes["min_p"] = float(min_p) if min_p > 0 else None
        eos = () if ignore_eos else tuple(self.sampling.eos_token_ids)
        if stop_token_ids:
            eos += tuple(self.token_ids(stop_token_ids, "stop_token_ids"))
        changes["eos_token_ids"] = tuple(dict.fromkeys(eos))
        try:
            return dataclasses.replace(self.sampling, **changes)
        except ValueError as error:
            raise APIError(400, str(error)) from None

    def budget(self, prompt: Sequence[int], max_tokens: int | None, param: str = "max_tokens") -> int:
        """Tokens a continuation may draw: `max_tokens`, or all the room the capacity leaves."""
        room = self.capacity - len(prompt)
        if room <= 0:
            raise APIError(400, f"The prompt has {len(prompt)} tokens, but a request holds at most {self.capacity} "
                                "tokens, prompt and continuation together; shorten the prompt.", "prompt")
        if max_tokens is None:
            return room
        if max_tokens > room:
            raise APIError(400, f"The prompt's {len(prompt)} tokens plus {param}={max_tokens} come to "
                                f"{len(prompt) + max_tokens}, more than the {self.capacity} tokens a request holds; "
                                f"ask for at most {room}.", param)
        return max_tokens

    def grammar(self, schema: Any, param: str) -> Any:
        """The token grammar of JSON documents valid under `schema` (compiled once per schema)."""
        from dew.sampling.guided import json_schema

        if not isinstance(schema, Mapping):
            raise APIError(400, f"{param} must be a JSON schema object; got {type(schema).__name__}.", param)
        key = json.dumps(schema, sort_keys=True)
        if key not in self._grammars:
            if not self.sampling.eos_token_ids:
                raise APIError(400, f"{self.name!r} has no EOS token to end a document with, so it cannot follow a "
                                    "schema.", param)
            tokenizer = self._needs_tokenizer("a JSON schema")
            try:
                grammar = json_schema(tokenizer, schema, self.sampling.eos_token_ids[0], self.vocab_size)
            except ImportError as error:
                raise APIError(400, f"This server cannot follow a schema: {error}", param) from None
            except ValueError as error:
                raise APIError(400, f"{param}: {error}", param) from None
            if len(self._grammars) >= GRAMMARS_KEPT:
                self._grammars.pop(next(iter(self._grammars)))
            self._grammars[key] = grammar
        return self._grammars[key]

    def pieces(self, prompt: Sequence[int], budget: int, sampling: Sampling, seed: int,
               stops: Sequence[str] = (), grammar: Any = None) -> AsyncIterator[Piece]:
        """The text pieces of one continuation from the engine, kept inside `grammar` when one is
        given (the engine decodes a guided request in the same batch as the others)."""
        if grammar is None:
            events = self.engine.generate(prompt, max_new_tokens=budget, sampling=sampling, seed=seed)
        else:
            events = self.engine.generate(prompt, max_new_tokens=budget, sampling=sampling, seed=seed,
                                          grammar=grammar)
        decode = self.decode if self.tokenizer is not None else (lambda ids: "")
        return text_pieces(events, decode, stops)

    def token_text(self, token: int) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode([token])
