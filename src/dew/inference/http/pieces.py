"""From an engine's token events to the text a client reads: detokenized pieces, stop strings, merging.

The engine draws token ids and ends a request on an EOS id or its budget; what clients see is text.
`text_pieces` decodes the tokens drawn so far (incrementally, `Detokenizer`) and sends only text
that can no longer change: it holds back a trailing partial UTF-8 character (decoded as U+FFFD)
and any tail that could still grow into a stop string. When a stop string appears, the text ends before it and the request is
closed, which frees its row in the engine. An EOS token ends the request without adding text.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import Any

REPLACEMENT = "\ufffd"  # what a tokenizer decodes from an incomplete UTF-8 sequence


@dataclasses.dataclass
class Piece:
    """New text of one continuation, the tokens drawn since the previous piece, and, on the last
    piece, why it ended ("stop": an EOS token or a stop string; "length": the budget)."""

    text: str
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str | None = None


@dataclasses.dataclass
class Continuation:
    """A whole continuation: its text, every token drawn (an EOS token included) and why it ended."""

    text: str = ""
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None

    def add(self, piece: Piece) -> None:
        self.text += piece.text
        self.tokens += piece.tokens
        self.logprobs += piece.logprobs
        self.finish_reason = piece.finish_reason or self.finish_reason


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of `text` may still change: a partial character, or a tail
    that is the beginning of a stop string."""
    if text.endswith(REPLACEMENT):
        return len(text) - len(text.rstrip(REPLACEMENT))
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


class Detokenizer:
    """The text of a growing list of tokens, decoding only the tokens since the last clean break.

    Decoding the whole list at every token costs time quadratic in its length. As in vLLM's
    incremental detokenization, the tokens since the last commit are decoded with and without the
    newest ones, and the difference is added once it ends in a whole character; the context kept
    before the new tokens lets a tokenizer that drops a leading space (SentencePiece) decode them
    as it would in place.
    """

    def __init__(self, decode: Any):
        self.decode, self.tokens, self.text = decode, [], ""
        self.start = self.read = 0  # decode from `start`; tokens before `read` are in `text`

    def add(self, token: int) -> str:
        self.tokens.append(token)
        return self._advance(final=False)

    def finish(self) -> str:
        """The whole text, a trailing partial character included (as U+FFFD, like a full decode)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.read == len(self.tokens):
            return self.text
        new = self.decode(self.tokens[self.start:])
        old = self.decode(self.tokens[self.start:self.read])
        if len(new) > len(old) and (final or not new.endswith(REPLACEMENT)):
            self.text += new[len(old):]
            self.start, self.read = self.read, len(self.tokens)
        return self.text


def first_stop(text: str, stops: Sequence[str], start: int) -> int | None:
    """Where the earliest stop string begins in `text` at or after `start`, or None."""
    found = [index for index in (text.find(stop, start) for stop in stops) if index >= 0]
    return min(found) if found else None


async def text_pieces(events: AsyncIterator[Any], decode: Any, stops: Sequence[str] = ()) -> AsyncIterator[Piece]:
    """Text pieces of one request from its engine events (`token`, `logprob`, `finish_reason`).

    `decode(ids) -> str` is the tokenizer's. The iterator of events is closed when this one ends,
    however it ends (a stop string, the client leaving), so the engine frees the row.
    """
    stops = [stop for stop in stops if stop]
    longest_stop = max((len(stop) for stop in stops), default=0)
    text_of = Detokenizer(decode)
    new_tokens: list[int] = []
    new_logprobs: list[float] = []
    sent = 0
    finish = None
    text = ""
    try:
        async for event in events:
            if event.finish_reason == "stop":  # an EOS token: counted, never shown
                new_tokens.append(event.token)
                new_logprobs.append(event.logprob)
                text, finish = text_of.finish(), "stop"
                break
            new_tokens.append(event.token)
            new_logprobs.append(event.logprob)
            text = text_of.add(event.token)
            if event.finish_reason is not None:
                text, finish = text_of.finish(), event.finish_reason
            cut = first_stop(text, stops, max(0, sent - longest_stop)) if stops else None
            if cut is not None:
                text, finish = text[:cut], "stop"
                break
            if finish is not None:
                break
            ready = len(text) - held_back(text, stops)
            if ready > sent:
                yield Piece(text[sent:ready], new_tokens, new_logprobs)
                sent, new_tokens, new_logprobs = ready, [], []
    finally:
        await events.aclose()
    if finish is None:  # the events ended without a reason: the budget, as far as the text knows
        text = text_of.finish()
    yield Piece(text[sent:], new_tokens, new_logprobs, finish or "length")


_END = object()


async def merged(streams: Sequence[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Items of several async iterators as they come, each tagged with its iterator's index.

    An error in one stops all of them and is raised; leaving early closes every one.
    """
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[Any]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
        except Exception as error:  # handed to the reader, which raises it
            await queue.put((index, error))
        finally:
            await queue.put((index, _END))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is _END:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

