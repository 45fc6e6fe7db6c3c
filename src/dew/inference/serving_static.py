"""StaticServer: the serving engine contract, one request at a time through `TextGeneration`.

`dew serve` drives an engine through `generate` (an async iterator of `TokenEvent`s per request),
`stats`, `start` and `stop`. `dew.inference.serving.Server` implements them with continuous
batching over one resident KV cache; StaticServer implements them by running each request alone
through its task, so a request draws exactly the tokens `task([prompt], budget, seed=seed,
sampling=sampling)` draws. It is the engine `dew serve` falls back to where the batching Server is
not installed, and the reference a front end is tested against: simple, exact and slow (requests
wait their turn, and each new budget compiles its own program).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np

from dew.checks import count
from dew.sampling.text import Sampling

RATE_WINDOW_S = 10.0  # tokens/s in `stats` counts the tokens drawn over this many seconds


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """One drawn token of a request.

    Attributes:
      token: the token id.
      logprob: its log-probability under the distribution it was drawn from (after temperature and
        the filters; 0 for a greedy draw, a point mass).
      finish_reason: None while the request goes on; "stop" when this token is one of the
        Sampling's EOS ids, "length" when it spends the budget.
    """

    token: int
    logprob: float
    finish_reason: str | None


class StaticServer:
    """Serves a TextGeneration task one request at a time, each exactly as the task draws it alone."""

    slots = 1

    def __init__(self, task: Any, *, capacity: int | None = None):
        self.task = task
        limit = int(task.model.max_seq_len)
        self.capacity = limit if capacity is None else count(capacity, "capacity")
        if self.capacity > limit:
            raise ValueError(
                f"capacity={self.capacity} is more than the model's max_seq_len={limit}; a request can "
                f"hold at most {limit} tokens, prompt and continuation together. Pass capacity <= {limit}."
            )
        self._turn = asyncio.Lock()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._waiting = 0
        self._running = 0
        self._drawn: collections.deque[tuple[float, int]] = collections.deque()

    @classmethod
    def from_task(cls, task: Any, *, slots: int = 1, capacity: int | None = None, kv_cache: Any = None,
                  chunk: int | None = None, prefix_cache: bool = False, decode_steps: int = 1) -> StaticServer:
        """The engine over `task`. The batching options belong to `dew.inference.serving.Server`
        and raise here rather than being ignored; `slots` is accepted, and rows are served in turn."""
        count(slots, "slots")
        asked = {name: value for name, value in dict(kv_cache=kv_cache, chunk=chunk, prefix_cache=prefix_cache,
                                                      decode_steps=None if decode_steps == 1 else decode_steps).items()
                 if value not in (None, False)}
        if asked:
            raise ValueError(
                f"{sorted(asked)} need the continuous-batching dew.inference.serving.Server, which this "
                "installation does not have; StaticServer serves one request at a time with a dense cache. "
                "Leave those options out."
            )
        return cls(task, capacity=capacity)

    async def start(self) -> None:
        """Start the worker thread that runs the task (one draw at a time)."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dew-engine")

    async def stop(self) -> None:
        """Stop the worker thread once the draw in progress finishes."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def check(self, prompt: Sequence[int], max_new_tokens: int) -> np.ndarray:
        """The prompt as int32 ids, or a ValueError saying why this request can never be served."""
        budget = count(max_new_tokens, "max_new_tokens")
        ids = np.asarray(prompt)
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"a prompt must be a non-empty list of token ids; got {ids.size} values of {ids.dtype}.")
        vocab = int(self.task.model.vocab_size)
        outside = ids[(ids < 0) | (ids >= vocab)]
        if outside.size:
            raise ValueError(f"token id {int(outside[0])} is outside the vocabulary [0, {vocab}).")
        if ids.size + budget > self.capacity:
            raise ValueError(
                f"the prompt's {ids.size} tokens plus max_new_tokens={budget} is {ids.size + budget}, more than "
                f"the capacity of {self.capacity} tokens per request; shorten the prompt or ask for fewer tokens."
            )
        return ids.astype(np.int32)

    async def generate(self, prompt: Sequence[int], *, max_new_tokens: int, sampling: Sampling,
                       seed: int) -> AsyncIterator[TokenEvent]:
        """The tokens `prompt` draws with `sampling` and `seed`, one event per token."""
        ids = self.check(prompt, max_new_tokens)
        if not isinstance(sampling, Sampling):
            raise TypeError(f"sampling must be a dew.sampling.Sampling; got {type(sampling).__name__}.")
        if self._executor is None:
            raise RuntimeError("The engine is not running; await engine.start() first.")
        self._waiting += 1
        admitted = False
        try:
            async with self._turn:
                self._waiting -= 1
                admitted = True
                self._running = 1
                try:
                    future = self._executor.submit(self._draw, ids, max_new_tokens, sampling, seed)
                    tokens, logprobs, ended = await asyncio.wrap_future(future)
                finally:
                    self._running = 0
        finally:
            if not admitted:
                self._waiting -= 1
        self._drawn.append((time.monotonic(), len(tokens)))
        for i, (token, logprob) in enumerate(zip(tokens, logprobs)):
            last = i == len(tokens) - 1
            yield TokenEvent(int(token), float(logprob), ("stop" if ended else "length") if last else None)

    def _draw(self, ids: np.ndarray, budget: int, sampling: Sampling, seed: int):
        drawn = self.task([ids], budget, seed=int(seed), sampling=sampling).host()
        length = int(drawn.lengths[0])
        return drawn.tokens[0, :length], drawn.behavior_log_probs[0, :length], bool(drawn.terminated[0])

    def stats(self) -> dict[str, float]:
        """Requests waiting, rows drawing, tokens per second over the last few seconds, and pages
        used (0: the cache is dense)."""
        now = time.monotonic()
        while self._drawn and self._drawn[0][0] < now - RATE_WINDOW_S:
            self._drawn.popleft()
        drawn = sum(tokens for _, tokens in self._drawn)
        return {"queue_depth": float(self._waiting), "running": float(self._running),
                "tokens_per_second": drawn / RATE_WINDOW_S, "pages_used": 0.0}


__all__ = ["StaticServer", "TokenEvent"]
