"""The paged layout of a `KVCache`: one pool of fixed-size pages shared by every row.

A dense cache gives each row ``max_len`` slots of its own. A paged cache keeps, per layer, one pool
of ``pages`` pages of ``page_size`` slots (keys and values both ``[pages + 1, kv_heads, page_size,
head_dim]``) and a page table ``[B, pages_per_row]``
naming the pool page that holds each row's slots ``j * page_size .. (j + 1) * page_size - 1``. A
row still sees ``pages_per_row * page_size`` logical slots with a position each, so masking by
position works as in the dense cache; only where a slot's key and value live changes.

The extra last page of the pool is scratch: a table entry no request owns points at it, so a
free row, a row writing past the pages it was given, or the padding of a prefill writes there
and never into another row's page. Nothing reads scratch at a valid position of a live row.

Attention gathers a row's pages into one ``[B * kv_heads, slots, head_dim]`` array each for keys
and values (`gather_pages`) inside the compiled step, so the program depends only on the table's
shape, never on which pages a row holds. Keys are stored slot-major like values, unlike the dense
cache's ``[.., head_dim, slots]``: laying a row's pages end to end then moves whole ``page_size x
head_dim`` blocks, where the dense key layout would interleave every page's columns (on XLA:CPU,
one layer of 8 rows of 512 slots: 0.3 ms against 6.7 ms, one measurement on a busy machine).
A quantized layout pages `Quantized` blocks: codes and their scales (``head_dim`` 1) move together.

The gather is most of what a paged step costs beyond a dense one, so attention gathers only the
first pages of each row up to the fullest row's last written slot (`attend_pages`), in a few
buckets of a row's pages chosen inside the program.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from dew.nn.kv_quant import Quantized, rotates_keys, store


def pages_per_row(max_len: int, page_size: int) -> int:
    """Table entries a row needs to hold `max_len` tokens."""
    return math.ceil(max_len / page_size)


def scratch_page(k_pool: Any) -> int:
    """The pool's scratch page: its last one."""
    return int(jax.tree.leaves(k_pool)[0].shape[-4]) - 1


def slot_pages(page_table: jax.Array, slots: jax.Array, page_size: int, scratch: int) -> tuple[jax.Array, jax.Array]:
    """The pool page and the offset in it of each logical slot ``slots [B, T]`` of its row.

    A slot outside the row's table (the padding of a prefill near the end of a row) maps to scratch.
    """
    entries = page_table.shape[1]
    entry = slots // page_size
    inside = (entry >= 0) & (entry < entries)
    page = jnp.take_along_axis(page_table, jnp.clip(entry, 0, entries - 1), axis=1)
    return jnp.where(inside, page, scratch), slots % page_size


def row_slots(index: jax.Array, batch: int, length: int) -> jax.Array:
    """The logical slots ``[B, T]`` a call of `length` tokens writes from ``index`` (``[]`` or ``[B]``)."""
    start = jnp.broadcast_to(jnp.asarray(index, jnp.int32), (batch,))
    return start[:, None] + jnp.arange(length, dtype=jnp.int32)


def write_pages(
    k_pool: Any, v_pool: Any, k: jax.Array, v: jax.Array, page_table: jax.Array, index: jax.Array
) -> tuple[Any, Any]:
    """Write ``k, v [B, T, KV, D]`` into one layer's pools at each row's slots ``index .. index + T - 1``.

    Both pools are ``[pages + 1, KV, P, D]`` (a `Quantized` pool: its codes, and its scales with
    ``D = 1``; the tokens are encoded first); the table says which page holds each slot. One
    scatter per array, whatever the rows' pages.
    """
    batch, length = k.shape[:2]
    page_size = jax.tree.leaves(k_pool)[0].shape[-2]
    page, offset = slot_pages(page_table, row_slots(index, batch, length), page_size, scratch_page(k_pool))

    def put(pool, new):  # advanced indices around a slice put the [B, T] axes first: [B, T, KV, D]
        return pool.at[page, :, offset, :].set(new.astype(pool.dtype))

    return jax.tree.map(put, k_pool, store(k, k_pool)), jax.tree.map(put, v_pool, store(v, v_pool))


def gather_pages(k_pool: Any, v_pool: Any, page_table: jax.Array) -> tuple[Any, Any]:
    """Each row's pages laid end to end: keys and values ``[B * KV, S, D]``, ``S = pages_per_row *
    page_size`` (every table entry names a pool page, so the gather need not check bounds); a
    `Quantized` pool gives codes and scales alike."""
    batch, entries = page_table.shape

    def rows(pool):  # [pages + 1, KV, P, D] -> [B, n, KV, P, D] -> [B * KV, n * P, D]
        _, kv_heads, page_size, width = pool.shape
        pages = jnp.take(pool, page_table.reshape(-1), axis=0, mode="clip")
        pages = pages.reshape(batch, entries, kv_heads, page_size, width).transpose(0, 2, 1, 3, 4)
        return pages.reshape(batch * kv_heads, entries * page_size, width)

    return jax.tree.map(rows, k_pool), jax.tree.map(rows, v_pool)


def page_buckets(entries: int) -> tuple[int, ...]:
    """How many of a row's `entries` pages attention may read: all of them, a half, a quarter or an
    eighth (rounded up), smallest first. Four buckets bound what the one program compiles (four
    copies of each layer's attention) while a batch of short rows reads few pages."""
    return tuple(sorted({-(-entries // parts) for parts in (8, 4, 2, 1)}))


def attend_pages(attend: Callable, q: jax.Array, k_pool: Any, v_pool: Any, page_table: jax.Array,
                 kv_positions: jax.Array, filled: jax.Array) -> jax.Array:
    """``attend(q, keys, values, kv_positions)`` over the first pages of every row, gathered end to end.

    `filled` (a traced scalar) is how many slots the fullest row has written, this call's tokens
    included: every slot past it is empty in every row, so attention reads the smallest of
    `page_buckets` that covers it and skips the rest. The bucket is picked on the device
    (`lax.switch`), so one program serves every mix of row lengths, and the gather (most of what a
    paged step costs beyond a dense one on XLA:CPU) moves only pages some row has reached.
    """
    page_size = jax.tree.leaves(k_pool)[0].shape[-2]
    buckets = page_buckets(page_table.shape[1])

    def over(entries, q, k_pool, v_pool, page_table, kv_positions):
        keys, values = gather_pages(k_pool, v_pool, page_table[:, :entries])
        return attend(q, keys, values, kv_positions[:, : entries * page_size])

    operands = (q, k_pool, v_pool, page_table, kv_positions)
    if len(buckets) == 1:
        return over(buckets[0], *operands)
    needed = (jnp.asarray(filled, jnp.int32) + page_size - 1) // page_size
    branch = jnp.minimum(jnp.searchsorted(jnp.asarray(buckets, jnp.int32), needed), len(buckets) - 1)
    return jax.lax.switch(branch, [functools.partial(over, entries) for entries in buckets], *operands)


def write_page_positions(positions: jax.Array, new: jax.Array, index: jax.Array) -> jax.Array:
    """Record positions ``new [B, T]`` in ``positions [B, S]`` at slots ``index ..``; slots past
    ``S`` (a prefill's padding) are dropped rather than moved back as a dynamic slice would."""
    batch, length = new.shape
    rows = jnp.arange(batch, dtype=jnp.int32)[:, None]
    slots = row_slots(index, batch, length)
    return positions.at[rows, slots].set(new.astype(jnp.int32), mode="drop")


def init_page_pool(
    *, pages: int, kv_heads: int, head_dim: int, page_size: int, num_layers: int, dtype, stacked: bool,
    quantized: str | None = None,
) -> tuple:
    """Zeroed key and value pools of ``pages`` pages plus scratch, per layer or stacked; `Quantized`
    blocks for a quantized layout (int8 keys rotated)."""
    shape = ((num_layers,) if stacked else ()) + (pages + 1, kv_heads, page_size, head_dim)

    def pool(rotated):
        if quantized is None:
            return jnp.zeros(shape, dtype)
        return Quantized.zeros(shape, -1, quantized, rotated=rotated)

    if stacked:
        return pool(rotates_keys(quantized)), pool(False)
    return (tuple(pool(rotates_keys(quantized)) for _ in range(num_layers)),
            tuple(pool(False) for _ in range(num_layers)))
