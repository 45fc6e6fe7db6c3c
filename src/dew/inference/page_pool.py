"""The host's account of a paged cache's pool: which pages are free, which rows hold which, and
which full pages other requests may share: a request's prompt pages once it has prefilled them, and
the pages of its prompt and drawn tokens once it has finished.

A request is given every page its prompt and budget can fill when it is admitted, so a running
request never waits for a page; one that does not fit waits in the queue until pages come back.
With the prefix cache on, each full page of a prompt is keyed by a hash of its tokens and of every
token before it (the key of the page before it), so two prompts share a page exactly when they
agree on everything up to its end. A shared page counts its holders; at zero it stays cached
until a new request needs the room (least recently used first) or `forget` drops it. A page is
offered only once its request has prefilled it, so a request whose next page another request is
still computing waits for it rather than computing it a second time.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Grant:
    """The pages a request is given: `shared` cached pages in prompt order, then `fresh` new ones."""

    shared: tuple[int, ...]
    fresh: tuple[int, ...]

    @property
    def pages(self) -> tuple[int, ...]:
        return self.shared + self.fresh


class PagePool:
    """Free pages, holder counts and (with ``prefix_cache``) the hashed full prompt pages of a pool."""

    def __init__(self, pages: int, page_size: int, *, prefix_cache: bool):
        self.pages = pages
        self.page_size = page_size
        self.prefix_cache = prefix_cache
        self._free: collections.deque[int] = collections.deque(range(pages))
        self._holders = np.zeros((pages,), np.int64)
        self._cached: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # key -> page, LRU first
        self._key_of: dict[int, bytes] = {}
        self._computing: dict[bytes, int] = {}  # key -> the fresh page a prefilling request writes it to
        self.reused_tokens = 0  # prompt tokens read from shared pages instead of computed

    @property
    def used(self) -> int:
        """Pages held by at least one request."""
        return int(np.count_nonzero(self._holders))

    def page_keys(self, prompt: np.ndarray) -> list[bytes]:
        """The key of each full page of `prompt`: a hash of its tokens and the key of the page before."""
        keys, previous = [], b""
        for i in range(len(prompt) // self.page_size):
            tokens = np.asarray(prompt[i * self.page_size:(i + 1) * self.page_size], np.int64).tobytes()
            previous = hashlib.blake2b(previous + tokens, digest_size=16).digest()
            keys.append(previous)
        return keys

    def shareable(self, prompt: np.ndarray) -> tuple[list[bytes], list[int]]:
        """The keys of `prompt`'s pages that may be shared and the cached pages of its first ones.
        The last prompt token is always computed (its logits start the decode), so at most
        ``(len(prompt) - 1) // page_size`` pages are shared."""
        if not self.prefix_cache:
            return [], []
        keys, shared = self.page_keys(prompt)[: (len(prompt) - 1) // self.page_size], []
        for key in keys:
            page = self._cached.get(key)
            if page is None:
                break
            shared.append(page)
        return keys, shared

    def computing(self, prompt: np.ndarray) -> bool:
        """Whether another request is computing the next page of `prompt` that could be shared:
        a request admitted once it is written reads it instead of computing it again."""
        keys, shared = self.shareable(prompt)
        return len(shared) < len(keys) and keys[len(shared)] in self._computing

    def grant(self, prompt: np.ndarray, tokens: int) -> Grant | None:
        """Pages for a request of `prompt` that holds up to `tokens` tokens (its cached first pages,
        `shareable`, then fresh ones), or None while the pool cannot give them."""
        needed = math.ceil(tokens / self.page_size)
        keys, shared = self.shareable(prompt)
        fresh_needed = needed - len(shared)
        evictable = [page for page in self._cached.values() if self._holders[page] == 0 and page not in shared]
        if fresh_needed > len(self._free) + len(evictable):
            return None
        fresh = []
        while len(fresh) < fresh_needed and self._free:
            fresh.append(self._free.popleft())
        for page in evictable[: fresh_needed - len(fresh)]:  # least recently used first
            del self._cached[self._key_of.pop(page)]
            fresh.append(page)
        for page in shared:
            self._cached.move_to_end(self._key_of[page])
        self._holders[list(shared) + fresh] += 1
        self.reused_tokens += len(shared) * self.page_size
        for key, page in zip(keys[len(shared):], fresh):
            self._computing.setdefault(key, page)
        return Grant(tuple(shared), tuple(fresh))

    def share(self, tokens: np.ndarray, pages: tuple[int, ...]) -> None:
        """Offer the full pages of `tokens` (what a request's pages hold, in order: its
        prompt once prefilled, or its prompt and drawn tokens once finished) to later requests."""
        if not self.prefix_cache:
            return
        for key, page in zip(self.page_keys(tokens), pages):
            if self._computing.get(key) == page:
                del self._computing[key]
            if key not in self._cached and page not in self._key_of:
                self._cached[key] = page
                self._key_of[page] = key

    def release(self, pages: tuple[int, ...]) -> None:
        """A request is done with `pages`; a page nobody holds is free again unless it is cached."""
        held = set(pages)  # a request that leaves before its prefill is done computes nothing more
        self._computing = {key: page for key, page in self._computing.items() if page not in held}
        for page in pages:
            self._holders[page] -= 1
            if self._holders[page] == 0 and page not in self._key_of:
                self._free.append(page)

    def forget(self) -> None:
        """Stop sharing every cached page (new weights: what they hold is stale); unheld ones are free."""
        for page in self._key_of:
            if self._holders[page] == 0:
                self._free.append(page)
        self._cached.clear()
        self._key_of.clear()
        self._computing.clear()
