"""A continuous-batching Server: many requests decoding together over one resident KV cache.

The cache has ``slots`` rows of ``capacity`` token slots, and each row writes at its own index
(`dew.nn.kv_cache`), so rows start and end independently. A request waits in a queue until a row
is free; admitting it prefills its prompt alone (padded to one of four widths per doubling,
`PREFILL_STEPS`, so prompt lengths share a few programs), seats that one-row cache in the free
row and keeps the last logits. Every step then runs one compiled program over all rows: each row
draws its next token from its logits with its own settings (`dew.sampling.rows`) and key, and
feeds it to the model. A row that drew an EOS id of its Sampling or its budget is freed for the
next request at once.

A request draws exactly what `TextGeneration` draws for it alone with the same seed: its key is
the key of row 0 of a one-prompt call (`fold_in(fold_in(key(seed), 0), 0)`), step t draws with
``fold_in(row_key, t)``, and its row attends only to its own tokens, by position.

With a paged cache (``kv_cache=KVCache(page_size=..., pages=...)``) the rows share one pool of
pages (`dew.nn.kv_pages`): a request is admitted once a row is free and the pool can hold its prompt
and budget (`dew.inference.page_pool`), its prompt is written straight into its pages, and its pages
go back when it ends. A paged decode call runs only the live rows, padded to one of a few sizes
(`row_buckets`): their state is all a paged row owns. ``chunk`` prefills a long prompt ``chunk``
tokens per step while the other rows keep decoding; ``prefix_cache`` lets a request read the full
pages of earlier requests that began with the same tokens (their prompts, and once they finish their
drawn tokens too) instead of computing them again.

A request may carry a `dew.sampling.guided.Grammar` (a JSON schema or a regular expression): it
decodes in the same batch as the others, each step's logits of its row masked to the tokens its
grammar state allows (every other row's mask allows every token), and draws exactly what
`guided_generate` draws for it alone. The host advances a guided row's state after each token, so
while any guided row runs a decode call is one iteration.

`submit` and `step` drive the server by hand (tests, benchmarks); `start` runs the same steps as
an asyncio task, and `generate` streams one request's `TokenEvent`s to whoever awaits them.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import numbers
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew.checks import count
from dew.inference.page_pool import PagePool
from dew.inference.text import TextGeneration
from dew.nn.backbones.causal_transformer import check_tokens
from dew.nn.kv_cache import EMPTY, KVCache, check_layout
from dew.nn.kv_pages import pages_per_row
from dew.sampling.rows import RowSampling, choose_row_tokens
from dew.sampling.text import Sampling, _row_keys
from dew.widths import padded_width

PREFILL_STEPS = 4  # prompt widths per doubling (`padded_width`): less than a fifth of a prefill is padding
THROUGHPUT_WINDOW_S = 10.0  # stats()["tokens_per_second"] counts the tokens of the last this many seconds


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """One drawn token of a request.

    Attributes:
      token: the token id.
      logprob: its log-probability under the distribution it was drawn from (after temperature
        and the filters; 0 for a greedy draw).
      finish_reason: None while the request goes on; "stop" when the token is an EOS id of the
        request's Sampling, "length" when it used the request's budget.
    """

    token: int
    logprob: float
    finish_reason: str | None


class Request:
    """A submitted request: its prompt, budget, Sampling, seed and grammar (or None), and the events
    drawn so far."""

    def __init__(self, prompt: np.ndarray, max_new_tokens: int, sampling: Sampling, seed: int,
                 grammar: Any = None):
        self.prompt = prompt
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling
        self.seed = seed
        self.grammar = grammar
        self.grammar_state = None if grammar is None else grammar.initial
        self.events: list[TokenEvent] = []
        self.row: int | None = None
        self.pages: tuple[int, ...] = ()  # a paged server's pool pages for this request, in prompt order
        self.prefilled = 0  # prompt tokens in the cache so far (paged: chunked or read from shared pages)
        self.weights = 0  # which weights (Server reloads) wrote its first prompt pages
        self.cancelled = False
        self.error: Exception | None = None  # why a guided request stopped early
        self.listener: Any = None  # called with each TokenEvent (the asyncio bridge of `generate`)

    @property
    def finished(self) -> bool:
        return bool(self.events) and self.events[-1].finish_reason is not None

    @property
    def tokens(self) -> list[int]:
        return [event.token for event in self.events]


def _prefill(model, variables, cache, state, row, tokens, length, seed_key, settings):
    """Prefill one prompt ``tokens [1, W]`` (its first `length` real) and seat it in row `row`;
    ``seed_key`` is ``jax.random.key(seed)`` of the request (see `_row_key`)."""
    width = tokens.shape[1]
    local = model.init_cache(1, width)  # the layout and dtype of the server's own cache
    positions = jnp.arange(width, dtype=jnp.int32)[None]
    logits, local = model.apply(variables, tokens, positions=positions, cache=local,
                                logits_at=(length - 1)[None, None])  # the prompt's last token only
    local = local.truncate(length[None])  # forget the padding after the prompt
    cache = cache.seat(row, local)
    state = dict(
        state,
        logits=state["logits"].at[row].set(logits[0, 0]),
        keys=state["keys"].at[row].set(_row_key(seed_key)),
        drawn=state["drawn"].at[row].set(0),
        live=state["live"].at[row].set(True),
        settings=state["settings"].set_row(row, settings),
    )
    return cache, state


def _prefill_pages(model, variables, cache, state, row, tokens, start, stop, final, seed_key, settings):
    """Prefill prompt tokens ``start .. stop - 1`` (``tokens [1, W]``, the first ``stop - start``
    real) straight into row `row`'s pages, after the ``start`` its pages already hold. The row
    decodes from the next step once the `final` piece is in."""
    width = tokens.shape[1]
    slots = jnp.arange(cache.max_len, dtype=jnp.int32)  # a paged row's slot s holds position s
    one = cache.replace(
        positions=jnp.where(slots < start, slots, EMPTY)[None], lengths=start[None], index=start[None],
        page_table=jax.lax.dynamic_slice_in_dim(cache.page_table, row, 1),
    )
    positions = start + jnp.arange(width, dtype=jnp.int32)[None]
    logits, one = model.apply(variables, tokens, positions=positions, cache=one,
                              logits_at=(stop - start - 1)[None, None])  # the piece's last token only
    one = one.truncate(stop[None])  # forget the padding after the piece
    cache = cache.replace(
        k=one.k, v=one.v, positions=cache.positions.at[row].set(one.positions[0]),
        lengths=cache.lengths.at[row].set(stop), index=cache.index.at[row].set(stop),
    )
    state = dict(
        state,
        logits=state["logits"].at[row].set(logits[0, 0]),
        keys=state["keys"].at[row].set(_row_key(seed_key)),
        drawn=state["drawn"].at[row].set(0),
        live=state["live"].at[row].set(final),
        settings=state["settings"].set_row(row, settings),
    )
    return cache, state


def _decode(model, variables, cache, state, rows, *, steps):
    """`steps` decode iterations over the rows ``rows [R]`` (distinct, every live row among them) of
    a paged cache, or over every row when `rows` is None; draws ``[steps, slots]``, zero in a row
    not decoded.

    A paged row's tokens live in the shared pools, so decoding a few rows needs only their own
    state: their part of the cache (`KVCache.take_rows`) and their logits, keys and settings are
    gathered, run through `_decode_rows` and put back, and the program's work follows the live
    rows, not the slots (one program per size of `rows`, see `row_buckets`). A dense cache's rows
    are its key/value arrays, so it decodes every row."""
    if rows is None:
        return _decode_rows(model, variables, cache, state, steps=steps)
    part, part_state, tokens, log_probs = _decode_rows(
        model, variables, cache.take_rows(rows), jax.tree.map(lambda x: x[rows], state), steps=steps)
    cache = cache.put_rows(rows, part)
    state = jax.tree.map(lambda whole, part: whole.at[rows].set(part), state, part_state)
    slots = cache.batch_size
    tokens = jnp.zeros((steps, slots), tokens.dtype).at[:, rows].set(tokens)
    log_probs = jnp.zeros((steps, slots), log_probs.dtype).at[:, rows].set(log_probs)
    return cache, state, tokens, log_probs


def row_buckets(slots: int) -> tuple[int, ...]:
    """The numbers of rows a paged Server's decode call runs: a quarter, a half, three quarters or
    all of its `slots` (rounded up), smallest first. A call runs the smallest that holds every live
    row, so a pool that fits fewer requests than there are slots, or a load winding down, decodes
    fewer rows; four sizes bound the programs compiled."""
    return tuple(sorted({-(-slots * parts // 4) for parts in (1, 2, 3, 4)}))


def _decode_rows(model, variables, cache, state, *, steps):
    """`steps` decode iterations over every row of `cache`: draw from the logits, feed the token, keep the next logits."""

    def one(carry, _):
        cache, state = carry
        keys = jax.vmap(jax.random.fold_in)(state["keys"], state["drawn"])
        logits = jnp.where(state["allowed"], state["logits"], -jnp.inf)  # a guided row's grammar mask
        tokens, log_probs = choose_row_tokens(logits, keys, state["settings"])
        live = state["live"]
        # a free row feeds a harmless token at slot 0, never past the end of its row; a paged row
        # not decoding (free, mid-prefill, or filled earlier in this call) writes to the scratch page
        # only, never to its own pages, which a prefix cache may share with other rows
        cache = cache.replace(lengths=jnp.where(live, cache.lengths, 0), index=jnp.where(live, cache.index, 0))
        if cache.paged:
            cache = cache.replace(page_table=jnp.where(live[:, None], table, cache.pages))
        fed = jnp.where(live, tokens, 0)
        logits, cache = model.apply(variables, fed[:, None], cache=cache)
        drawn = state["drawn"] + live.astype(jnp.int32)
        live = live & (cache.lengths < cache.max_len)  # a row that filled its slots stops until reseated
        return (cache, dict(state, logits=logits[:, 0], drawn=drawn, live=live)), (tokens, log_probs)

    table = cache.page_table
    if steps == 1:  # one iteration needs no loop
        (cache, state), (tokens, log_probs) = one((cache, state), None)
        tokens, log_probs = tokens[None], log_probs[None]
    else:
        (cache, state), (tokens, log_probs) = jax.lax.scan(one, (cache, state), None, length=steps)
    return cache.replace(page_table=table), state, tokens, log_probs


def _row_key(seed_key: jax.Array) -> jax.Array:
    """The key `TextGeneration` gives a prompt run alone with ``jax.random.key(seed)``. Derived inside
    the prefill programs: run eagerly on the host, its few vmapped folds cost milliseconds a request."""
    return _row_keys(seed_key, 1, 1)[0]


_prefill_jit = jax.jit(_prefill, static_argnames=("model",), donate_argnames=("cache", "state"))
_prefill_pages_jit = jax.jit(_prefill_pages, static_argnames=("model",), donate_argnames=("cache", "state"))
_decode_jit = jax.jit(_decode, static_argnames=("model", "steps"), donate_argnames=("cache", "state"))
# rows leaving: one compiled program whatever their number (an eager scatter traces on every call)
_keep_live_jit = jax.jit(jnp.logical_and, donate_argnums=0)


@dataclasses.dataclass(frozen=True)
class _Call:
    """A launched decode call: the rows it decodes with their requests at launch, and its draws
    ``[steps, slots]`` (device arrays until read)."""

    running: list[tuple[int, Request]]
    tokens: Any
    log_probs: Any
    steps: int
    guided: bool


class Server:
    """Continuous batching of a `TextGeneration` task's decoder over ``slots`` rows of ``capacity`` tokens.

    Build it with `from_task`. A request fits when its prompt plus its budget is at most
    ``capacity`` tokens; `submit` (and `generate`) refuse one that does not before anything runs.
    """

    def __init__(self, task: TextGeneration, *, slots: int, capacity: int, decode_steps: int = 1,
                 kv_cache: KVCache | None = None, chunk: int | None = None, prefix_cache: bool = False):
        if not isinstance(task, TextGeneration):
            raise TypeError(f"Server serves a dew.inference.TextGeneration; got {type(task).__name__}.")
        self.task = task
        self.slots = count(slots, "slots")
        self.capacity = count(capacity, "capacity", minimum=2)
        self.decode_steps = count(decode_steps, "decode_steps")
        max_seq_len = task.model.max_seq_len
        if self.capacity > max_seq_len:
            raise ValueError(
                f"capacity={self.capacity} is more than the model's max_seq_len={max_seq_len}: a row "
                f"cannot hold more tokens than the model has positions; pass capacity <= {max_seq_len}"
            )
        layout = getattr(task.model, "kv_cache", None) if kv_cache is None else check_layout(kv_cache)
        if kv_cache is not None:
            if not hasattr(task.model, "kv_cache"):
                raise ValueError(
                    f"kv_cache= sets the layout of a CausalTransformer's cache; this task's model is a "
                    f"{type(task.model).__name__}, which has none. Pass kv_cache=None"
                )
            # the model stores what the server's cache stores (its one-row prefills included); building
            # it checks the layout (an int8 cache needs a power-of-two head_dim) before anything compiles
            storage = KVCache(quantized=kv_cache.quantized) if kv_cache.quantized else None
            task = dataclasses.replace(task, model=task.model.clone(kv_cache=storage))
            self.task = task
        self.paged = layout is not None and layout.paged
        if not self.paged and (chunk is not None or prefix_cache):
            raise ValueError(
                f"chunk={chunk!r} and prefix_cache={prefix_cache!r} work on pages: pass a paged cache, e.g. "
                "kv_cache=KVCache(page_size=16, pages=...), or leave chunk=None and prefix_cache=False"
            )
        self.chunk = None if chunk is None else count(chunk, "chunk (prompt tokens prefilled per step)")
        self._pool: PagePool | None = None
        self.page_size = self.pages = None  # a paged server's page size and pool size
        if self.paged:
            entries = pages_per_row(self.capacity, layout.page_size)
            pages = self.slots * entries if layout.pages is None else layout.pages
            if pages < entries:
                raise ValueError(
                    f"a pool of {pages} pages of {layout.page_size} tokens holds {pages * layout.page_size} "
                    f"tokens, fewer than one request of capacity={self.capacity} needs ({entries} pages); pass "
                    f"pages >= {entries} or a smaller capacity"
                )
            layout = layout.replace(pages=pages)
            self.page_size, self.pages = layout.page_size, pages
            self._pool = PagePool(pages, layout.page_size, prefix_cache=bool(prefix_cache))
            self._table = np.full((self.slots, entries), pages, np.int32)  # host copy; pages = scratch
        self.model, self.variables = task.weights.get(self.slots)
        cache = self.model.init_cache(self.slots, self.capacity, layout=layout, rows_own_pages=False)
        self._cache = cache.replace(index=jnp.zeros((self.slots,), jnp.int32))
        self._state = dict(
            logits=jnp.zeros((self.slots, self.model.vocab_size), jnp.float32),
            keys=jnp.stack([jax.random.key(0)] * self.slots),
            drawn=jnp.zeros((self.slots,), jnp.int32),
            live=jnp.zeros((self.slots,), bool),
            settings=RowSampling.empty(self.slots),
            allowed=jnp.ones((self.slots, self.model.vocab_size), bool),
        )
        self._allowed = np.ones((self.slots, self.model.vocab_size), bool)  # host copy of state["allowed"]
        self._allowed_changed = False
        self._rows: list[Request | None] = [None] * self.slots
        self._pending: _Call | None = None  # the decode call launched last, not read yet
        self._queue: collections.deque[Request] = collections.deque()
        self._lock = threading.Lock()  # submit/cancel (any thread) against step (the stepping thread)
        self._reload: Any = None
        self._reset_prefixes = False
        self._weights = 0  # counts reloads: prefix pages are shared only among requests of one weights
        self._emitted: collections.deque[tuple[float, int]] = collections.deque()
        self._prompt_tokens = 0  # of every admitted request, shared or computed
        self._loop_task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._stopping = False

    @classmethod
    def from_task(
        cls, task: TextGeneration, *, slots: int, capacity: int, kv_cache: KVCache | None = None,
        chunk: int | None = None, prefix_cache: bool = False, decode_steps: int = 1,
    ) -> "Server":
        """A server for `task` with ``slots`` rows of ``capacity`` tokens, running ``decode_steps``
        decode iterations per device call.

        ``kv_cache`` is the cache layout (default: the model's ``kv_cache`` field, else dense);
        ``KVCache(quantized="int8")`` stores it in eight bits, ``KVCache(page_size=16, pages=N)`` shares one pool of N pages among the rows (default N:
        ``slots * ceil(capacity / page_size)``, the dense cache's room). ``chunk`` prefills prompts
        ``chunk`` tokens per step, ``prefix_cache`` shares full prompt pages; both need pages."""
        return cls(task, slots=slots, capacity=capacity, decode_steps=decode_steps, kv_cache=kv_cache,
                   chunk=chunk, prefix_cache=prefix_cache)

    # --- requests --------------------------------------------------------------------------------

    def submit(self, prompt: Sequence[int], *, max_new_tokens: int, sampling: Sampling, seed: int,
               grammar: Any = None) -> Request:
        """Queue a request (kept inside `grammar` when one is given); it is admitted at a step with a
        free row. Raises when it can never run."""
        request = self.check(prompt, max_new_tokens, sampling, seed, grammar)
        with self._lock:
            self._queue.append(request)
        return request

    def check(self, prompt: Sequence[int], max_new_tokens: int, sampling: Sampling, seed: int,
              grammar: Any = None) -> Request:
        """The request these arguments make, or a ValueError (TypeError for a wrong Sampling or
        grammar) when it can never run: an empty prompt, ids outside the vocabulary, a budget below
        1, a non-int seed, more tokens than a row holds, or a grammar over another vocabulary or
        whose first state allows no token. `submit` and `generate` check the same way; a caller
        that must answer before streaming (an HTTP front end) calls it first."""
        max_new_tokens = count(max_new_tokens, "max_new_tokens")
        if not isinstance(sampling, Sampling):
            raise TypeError(f"sampling must be a dew.sampling.Sampling; got {type(sampling).__name__}.")
        if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
            raise ValueError(f"seed must be an int; got {seed!r} ({type(seed).__name__}).")
        tokens = np.asarray(prompt)
        if tokens.ndim != 1 or tokens.size == 0:
            raise ValueError(f"prompt must be a non-empty list of token ids; got shape {tokens.shape}.")
        check_tokens(tokens, self.model.vocab_size)
        if tokens.size + max_new_tokens > self.capacity:
            raise ValueError(
                f"a prompt of {tokens.size} tokens plus max_new_tokens={max_new_tokens} is "
                f"{tokens.size + max_new_tokens} tokens, more than the server's capacity={self.capacity} per "
                "row; shorten the prompt, ask for fewer tokens or build the server with a larger capacity"
            )
        if grammar is not None:
            if not all(hasattr(grammar, name) for name in ("initial", "mask", "advance", "eos_id")):
                raise TypeError(f"grammar must be a dew.sampling.guided.Grammar; got {type(grammar).__name__}.")
            if grammar.vocab_size != self.model.vocab_size:
                raise ValueError(
                    f"the grammar covers {grammar.vocab_size} token ids and the model's vocabulary has "
                    f"{self.model.vocab_size}; build it with vocab_size={self.model.vocab_size}"
                )
            if not grammar.mask(grammar.initial).any():
                raise ValueError("the grammar's first state allows no token; it cannot start any text")
        return Request(tokens.astype(np.int32), max_new_tokens, sampling, int(seed), grammar)

    def cancel(self, request: Request) -> None:
        """Drop a request: out of the queue now, or out of its row (and its pages) at the next step."""
        with self._lock:
            request.cancelled = True
            if request in self._queue:
                self._queue.remove(request)

    def reload(self, variables: Any) -> None:
        """Decode with `variables` from the next step on (rows keep the cache the old weights wrote,
        but no later request shares a prefix page they wrote)."""
        self._reload = variables

    def reset_prefix_cache(self) -> None:
        """Share no prompt page cached so far, from the next step on: later requests compute their
        prompts afresh (pages that running requests hold stay theirs). Nothing to do without a
        prefix cache."""
        self._reset_prefixes = True

    # --- stepping --------------------------------------------------------------------------------

    def step(self) -> list[tuple[Request, TokenEvent]]:
        """Admit queued requests into free rows, launch one decode call, and return what the last
        finished call drew.

        Calls overlap with the host: a call is launched before the tokens of the one before it are
        read, so the device never waits while the host hands out tokens, frees rows and admits
        requests. A step therefore returns the draws of the call launched one step earlier (a row
        that finished there may have decoded once more, unseen). A call with a guided row is read at
        once, since its grammar's next mask needs the token just drawn. Events are in draw order; a
        request whose event finishes it has left its row.
        """
        if self._reload is not None:
            variables, self._reload = self._reload, None
            self.task = self.task.bind(variables)
            self.model, self.variables = self.task.weights.get(self.slots)
            self._weights += 1
            self._reset_prefixes = True
        if self._reset_prefixes:
            self._reset_prefixes = False
            if self._pool is not None:
                self._pool.forget()
        self._free_cancelled()
        self._admit()
        if self.paged:
            self._prefill_pieces()
        running = [(row, r) for row, r in enumerate(self._rows)
                   if r is not None and not r.finished and self._decoding(r)]
        launched = self._launch(running) if running else None
        events = self._collect(self._pending) if self._pending is not None else []
        self._pending = launched
        if launched is not None and launched.guided:
            events += self._collect(launched)
            self._pending = None
        return events

    def _launch(self, running: list[tuple[int, Request]]) -> _Call:
        """Start one decode call over every live row; its draws stay on the device until read."""
        guided = any(request.grammar is not None for _, request in running)
        steps = 1 if guided else self.decode_steps  # a grammar's next mask needs the token just drawn
        if self._allowed_changed:
            self._state = dict(self._state, allowed=jnp.asarray(self._allowed))
            self._allowed_changed = False
        self._cache, self._state, tokens, log_probs = _decode_jit(
            self.model, self.variables, self._cache, self._state, self._decoded_rows(running), steps=steps
        )
        return _Call(running, tokens, log_probs, steps, guided)

    def _decoded_rows(self, running: list[tuple[int, Request]]) -> np.ndarray | None:
        """The rows a paged decode call runs: the running ones, then free or prefilling rows up to
        the smallest of `row_buckets` that holds them (None, every row, for a dense cache)."""
        if not self.paged:
            return None
        rows = [row for row, _ in running]
        size = next(size for size in row_buckets(self.slots) if size >= len(rows))
        taken = set(rows)
        rows += [row for row in range(self.slots) if row not in taken][: size - len(rows)]
        return np.asarray(rows, np.int32)

    def _collect(self, call: _Call) -> list[tuple[Request, TokenEvent]]:
        """Read a launched call's draws (waiting for it), hand them to their requests, and free the
        rows of the requests they finish. Rows whose request finished earlier are skipped."""
        tokens, log_probs = np.asarray(call.tokens), np.asarray(call.log_probs)
        events, freed, done, failed = [], [], [], []
        for t in range(call.steps):
            for row, request in call.running:
                if request.finished or request.cancelled or request.error is not None:
                    continue
                token = int(tokens[t, row])
                if request.grammar is not None and not self._advance_grammar(row, request, token):
                    failed.append((row, request))
                    continue
                if token in request.sampling.eos_token_ids or (
                        request.grammar is not None and token == request.grammar.eos_id):
                    reason = "stop"
                elif len(request.events) + 1 == request.max_new_tokens:
                    reason = "length"
                else:
                    reason = None
                event = TokenEvent(token, float(log_probs[t, row]), reason)
                request.events.append(event)
                events.append((request, event))
                if reason is not None:
                    freed.append(row)
                    done.append(request)
        with self._lock:
            for row in freed + [row for row, _ in failed]:
                self._rows[row] = None
        for request in done if self.paged and self._pool.prefix_cache else ():  # a chat's next turn repeats them
            self._offer(request, np.concatenate([request.prompt, np.asarray(request.tokens, request.prompt.dtype)]))
        done += [request for _, request in failed]
        self._stop_rows(freed + [row for row, _ in failed], done)
        self._count_emitted(len(events))
        for _, request in failed:
            if request.listener is not None:
                request.listener(request.error)
        return events

    def _offer(self, request: Request, tokens: np.ndarray) -> None:
        """Offer the full pages of `tokens`, what `request`'s pages hold (its prompt once prefilled;
        its prompt and drawn tokens once finished: each drawn token was fed back, and draws past its
        end, unseen, lie beyond its last full page) to later requests, unless other weights wrote them."""
        if request.weights == self._weights:
            self._pool.share(tokens, request.pages)

    def _advance_grammar(self, row: int, request: Request, token: int) -> bool:
        """Move a guided request's grammar past `token` and mask its row for the next draw; False
        (with `request.error` set) when the grammar cannot go on."""
        if token == request.grammar.eos_id:
            return True
        try:
            request.grammar_state = request.grammar.advance(request.grammar_state, token)
            allowed = request.grammar.mask(request.grammar_state)
            if not allowed.any():
                raise ValueError(f"grammar state {request.grammar_state} allows no token; the grammar "
                                 "cannot continue this text")
        except ValueError as error:
            request.error = error
            return False
        self._allowed[row] = allowed
        self._allowed_changed = True
        return True

    def _mask_row(self, row: int, request: Request | None) -> None:
        """Set row `row`'s grammar mask for a request seated there (all tokens when unguided or freed)."""
        allowed = True if request is None or request.grammar is None else request.grammar.mask(request.grammar_state)
        if request is not None and request.grammar is not None or not self._allowed[row].all():
            self._allowed[row] = allowed
            self._allowed_changed = True

    def _decoding(self, request: Request) -> bool:
        return not self.paged or request.prefilled == request.prompt.size

    def _stop_rows(self, rows: list[int], requests: list[Request]) -> None:
        """Mark rows free on the device so they stop decoding until a request is seated there, and
        give the requests' pages back."""
        if rows:
            keep = np.ones(self.slots, bool)
            keep[rows] = False
            self._state = dict(self._state, live=_keep_live_jit(self._state["live"], keep))
            for row in rows:
                self._mask_row(row, None)
        if self.paged and requests:
            for request in requests:
                self._pool.release(request.pages)
                request.pages = ()
                self._table[request.row] = self._pool.pages  # every entry at the scratch page
            self._push_table()

    def _push_table(self) -> None:
        self._cache = self._cache.replace(page_table=jnp.asarray(self._table))

    def _free_cancelled(self) -> None:
        with self._lock:
            freed = [(row, r) for row, r in enumerate(self._rows) if r is not None and r.cancelled]
            for row, _ in freed:
                self._rows[row] = None
        self._stop_rows([row for row, _ in freed], [r for _, r in freed])

    def _admit(self) -> None:
        """Seat queued requests in free rows, first come first served. A request whose next
        shareable prompt page another request is still computing stays queued (it reads that page
        once it is written) while the requests behind it go ahead; one the pool cannot hold stops
        admission until pages come back, so a large request is never passed over for long."""
        waiting = 0  # requests at the queue's head left for a page being computed
        while True:
            with self._lock:
                free = [row for row, r in enumerate(self._rows) if r is None]
                if not free or len(self._queue) <= waiting:
                    return
                request = self._queue[waiting]
                if self.paged:
                    if self._pool.computing(request.prompt):
                        waiting += 1
                        continue
                    grant = self._pool.grant(request.prompt, request.prompt.size + request.max_new_tokens)
                    if grant is None:
                        return  # the pool is full: the queue waits for pages to come back
                del self._queue[waiting]
                row = free[0]
                self._rows[row] = request
            request.row = row
            self._prompt_tokens += int(request.prompt.size)
            self._mask_row(row, request)
            if self.paged:
                request.pages, request.weights = grant.pages, self._weights
                request.prefilled = len(grant.shared) * self._pool.page_size
                self._table[row] = self._pool.pages
                self._table[row, : len(grant.pages)] = grant.pages
                self._push_table()
                continue  # its prompt goes in by `_prefill_pieces`
            length = int(request.prompt.size)
            width = padded_width(length, self.capacity, steps=PREFILL_STEPS)
            tokens = np.zeros((1, width), np.int32)
            tokens[0, :length] = request.prompt
            self._cache, self._state = _prefill_jit(
                self.model, self.variables, self._cache, self._state, np.int32(row), tokens,
                np.int32(length), jax.random.key(request.seed), RowSampling.of(request.sampling),
            )

    def _prefill_pieces(self) -> None:
        """Write the next piece of every admitted prompt into its pages: all that is left, or
        ``chunk`` tokens. A request whose prompt is complete decodes from this step on."""
        for row, request in enumerate(list(self._rows)):
            if request is None or request.prefilled == request.prompt.size:
                continue
            start, length = request.prefilled, int(request.prompt.size)
            stop = length if self.chunk is None else min(length, start + self.chunk)
            limit = self.capacity if self.chunk is None else min(self.chunk, self.capacity)
            width = padded_width(stop - start, limit, steps=PREFILL_STEPS)
            tokens = np.zeros((1, width), np.int32)
            tokens[0, : stop - start] = request.prompt[start:stop]
            self._cache, self._state = _prefill_pages_jit(
                self.model, self.variables, self._cache, self._state, np.int32(row), tokens,
                np.int32(start), np.int32(stop), np.bool_(stop == length), jax.random.key(request.seed),
                RowSampling.of(request.sampling),
            )
            request.prefilled = stop
            if stop == length:
                self._offer(request, request.prompt)

    def _count_emitted(self, tokens: int) -> None:
        now = time.monotonic()
        self._emitted.append((now, tokens))
        while self._emitted and self._emitted[0][0] < now - THROUGHPUT_WINDOW_S:
            self._emitted.popleft()

    def stats(self) -> dict[str, float]:
        """Queue depth, running rows, tokens per second over the last few seconds, cache pages used
        (0: dense), and the prompt tokens of every admitted request and of those read from the
        prefix cache's shared pages (both counted since the Server started)."""
        now = time.monotonic()
        recent = [(at, n) for at, n in list(self._emitted) if at >= now - THROUGHPUT_WINDOW_S]
        span = now - recent[0][0] if recent else 0.0
        with self._lock:
            queued = len(self._queue)
            running = sum(r is not None for r in self._rows)
        return {
            "queue_depth": float(queued),
            "running": float(running),
            "tokens_per_second": float(sum(n for _, n in recent) / span) if span > 0 else 0.0,
            "pages_used": float(self._pool.used) if self._pool is not None else 0.0,
            "prompt_tokens_total": float(self._prompt_tokens),
            "prompt_tokens_cached_total": float(self._pool.reused_tokens) if self._pool is not None else 0.0,
        }

    # --- asyncio ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Run the step loop as a task of the running event loop (steps run in a worker thread)."""
        if self._loop_task is None or self._loop_task.done():
            self._wake = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stop the step loop; requests still waiting or running end with a RuntimeError."""
        task, self._loop_task = self._loop_task, None
        if task is not None:
            self._stopping = True
            self._wake.set()
            try:
                await task  # ends after the step in flight, if any
            finally:
                self._stopping = False
        self._fail_all(RuntimeError("the server stopped before this request finished"))

    async def _run(self) -> None:
        while not self._stopping:
            with self._lock:
                idle = not self._queue and all(r is None for r in self._rows)
            if idle:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                drawn = await asyncio.to_thread(self.step)
            except Exception as error:  # noqa: BLE001 - the requests in flight hear of it; the loop goes on
                self._fail_all(error)
                continue
            for request, event in drawn:
                if request.listener is not None:
                    request.listener(event)

    def _fail_all(self, error: BaseException) -> None:
        """End every waiting and running request with `error` and empty the rows."""
        with self._lock:
            failed = list(self._queue) + [r for r in self._rows if r is not None]
            held = [r for r in self._rows if r is not None]
            self._queue.clear()
            self._rows = [None] * self.slots
        self._pending = None  # its draws belong to the requests failed here
        self._state = dict(self._state, live=jnp.zeros((self.slots,), bool))  # not read: a failed step may have eaten it
        self._stop_rows([], held)
        for request in failed:
            if request.listener is not None:
                request.listener(error)

    async def generate(
        self, prompt: Sequence[int], *, max_new_tokens: int, sampling: Sampling, seed: int,
        grammar: Any = None,
    ) -> AsyncIterator[TokenEvent]:
        """Stream one request's tokens (inside `grammar` when one is given); closing the iterator
        early frees its row at the next step.

        A request that can never run raises `check`'s error at the first iteration; one whose
        grammar cannot go on raises that error where its stream stands, and the others go on."""
        request = self.check(prompt, max_new_tokens, sampling, seed, grammar)
        await self.start()
        events: asyncio.Queue = asyncio.Queue()
        request.listener = events.put_nowait
        with self._lock:
            self._queue.append(request)
        self._wake.set()
        try:
            while True:
                event = await events.get()
                if isinstance(event, Exception):
                    raise event
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            if not request.finished:
                self.cancel(request)


__all__ = ["Request", "Server", "TokenEvent"]
