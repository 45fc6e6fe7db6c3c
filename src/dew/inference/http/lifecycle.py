"""How a request moves through the server: admitted under a bound on the continuations in flight,
watched for a client that leaves (which cancels its work and frees its rows), and, for a stream,
started only once the engine has accepted it, so a refusal is still a 4xx.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from dew.inference.http.model import APIError


class Admission:
    """Counts the continuations in flight and refuses a request that would pass `limit`."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_flight = 0
        self.refused = 0

    @contextlib.asynccontextmanager
    async def hold(self, continuations: int) -> AsyncIterator[Ticket]:
        """A ticket for `continuations`, given back on leaving the block unless `kept` (a stream
        keeps its ticket and releases it when it ends)."""
        if continuations > self.limit:
            raise APIError(400, f"This request asks for {continuations} continuations, more than the {self.limit} the "
                                "server admits at once; ask for fewer (n, or fewer prompts).", "n")
        if self.in_flight + continuations > self.limit:
            self.refused += 1
            raise APIError(429, f"The server is full: {self.in_flight} continuations are in flight and it admits "
                                f"{self.limit}; retry shortly.", kind="rate_limit_error")
        self.in_flight += continuations
        ticket = Ticket(self, continuations)
        try:
            yield ticket
        finally:
            if not ticket.kept:
                ticket.release()


class Ticket:
    """Admission for some continuations, released exactly once."""

    def __init__(self, admission: Admission, continuations: int):
        self.admission, self.continuations = admission, continuations
        self.kept = False
        self.released = False

    def keep(self) -> None:
        self.kept = True

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.admission.in_flight -= self.continuations


class ClientGone(Exception):
    """The client closed its connection before its answer was ready."""


async def unless_disconnected(request: Any, work: Awaitable[Any], poll_s: float = 0.25) -> Any:
    """`work`'s result, or ClientGone (with `work` cancelled, freeing its rows) once the client leaves."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


async def opened(stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """`stream` with its first item already drawn, so a request the engine refuses fails before
    the response starts (as a 4xx, not a broken stream)."""
    try:
        first = await stream.__anext__()
    except StopAsyncIteration:
        first = None
    except BaseException:
        await stream.aclose()
        raise

    async def rest() -> AsyncIterator[Any]:
        try:
            if first is not None:
                yield first
                async for item in stream:
                    yield item
        finally:
            await stream.aclose()

    return rest()
