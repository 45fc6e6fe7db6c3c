"""The paged layout of a `KVCache`: one pool of fixed-size pages shared by every row.

A dense cache gives each row ``max_len`` slots of its own. A paged cache keeps, per layer, one pool
of ``pages`` pages of ``page_size`` slots (keys ``[pages + 1, kv_heads, head_dim, page_size]``,
values ``[pages + 1, kv_heads, page_size, head_dim]``: each page in the dense cache's key and value
layouts) and a page table ``[B, pages_per_row]`` naming the pool page that holds each row's slots
``j * page_size .. (j + 1) * page_size - 1``. A row still sees ``pages_per_row * page_size``
logical slots with a position each, so masking by position works as in the dense cache; only
where a slot's key and value live changes.

The extra last page of the pool is scratch: a table entry no request owns points at it, so a
free row, a row writing past the pages it was given, or the padding of a prefill writes there
and never into another row's page. Nothing reads scratch at a valid position of a live row.

Attention reads the pages one of two ways inside the compiled step, so the program depends only
on the table's shape, never on which pages a row holds (`attend_pages`):

- by row: each row's pages are gathered end to end into the dense layout (`gather_pages`) and
  attended as a dense cache is. The gather copies what it reads, so it takes only the first
  pages of each row, up to the fullest row's last written slot, in a few buckets. Prompts and
  rows that have written little of a large pool are read this way.
- by page (`dew.nn.attention.paged_cache_attention`): every pool page is scored where it lies
  against the queries of the row that holds it, with no copy; pages several rows hold (a prefix
  cache's shared prompt pages) against every row's. Its work follows the pool, so it reads
  one-token calls (decode steps) whose gather would move at least half the pool's pages.

A quantized layout pages `Quantized` blocks: codes and their scales (``head_dim`` 1) move together.
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

    The pools are keys ``[pages + 1, KV, D, P]`` and values ``[pages + 1, KV, P, D]`` (a `Quantized`
    pool: its codes, and its scales with ``D = 1``; the tokens are encoded first); the table says which page holds each slot. One
    scatter per array, whatever the rows' pages.
    """
    batch, length = k.shape[:2]
    page_size = jax.tree.leaves(v_pool)[0].shape[-2]
    page, offset = slot_pages(page_table, row_slots(index, batch, length), page_size, scratch_page(k_pool))

    # advanced indices around slices put the [B, T] axes first: [B, T, KV, D] either way
    def put_key(pool, new):  # [pages + 1, KV, D, P]
        return pool.at[page, :, :, offset].set(new.astype(pool.dtype))

    def put_value(pool, new):  # [pages + 1, KV, P, D]
        return pool.at[page, :, offset, :].set(new.astype(pool.dtype))

    return jax.tree.map(put_key, k_pool, store(k, k_pool)), jax.tree.map(put_value, v_pool, store(v, v_pool))


def gather_pages(k_pool: Any, v_pool: Any, page_table: jax.Array) -> tuple[Any, Any]:
    """Each row's pages laid end to end in the dense cache's layout: keys ``[B * KV, D, S]`` and
    values ``[B * KV, S, D]``, ``S = pages_per_row * page_size`` (every table entry names a pool
    page, so the gather need not check bounds); a `Quantized` pool gives codes and scales alike."""
    batch, entries = page_table.shape

    def keys(pool):  # [pages + 1, KV, D, P] -> [B, n, KV, D, P] -> [B * KV, D, n * P]
        _, kv_heads, width, page_size = pool.shape
        pages = jnp.take(pool, page_table.reshape(-1), axis=0, mode="clip")
        pages = pages.reshape(batch, entries, kv_heads, width, page_size).transpose(0, 2, 3, 1, 4)
        return pages.reshape(batch * kv_heads, width, entries * page_size)

    def values(pool):  # [pages + 1, KV, P, D] -> [B, n, KV, P, D] -> [B * KV, n * P, D]
        _, kv_heads, page_size, width = pool.shape
        pages = jnp.take(pool, page_table.reshape(-1), axis=0, mode="clip")
        pages = pages.reshape(batch, entries, kv_heads, page_size, width).transpose(0, 2, 1, 3, 4)
        return pages.reshape(batch * kv_heads, entries * page_size, width)

    return jax.tree.map(keys, k_pool), jax.tree.map(values, v_pool)


def page_buckets(entries: int) -> tuple[int, ...]:
    """How many of a row's `entries` pages attention may read: all of them, a half, a quarter or an
    eighth (rounded up), smallest first. Four buckets bound what the one program compiles (four
    copies of each layer's attention) while a batch of short rows reads few pages."""
    return tuple(sorted({-(-entries // parts) for parts in (8, 4, 2, 1)}))


def attend_pages(attend: Callable, q: jax.Array, k_pool: Any, v_pool: Any, page_table: jax.Array,
                 kv_positions: jax.Array, filled: jax.Array, by_page: Callable | None = None) -> jax.Array:
    """Attention of ``q [B, T, N, H]`` over every row's pages: ``attend(q, keys, values, kv_positions)``
    over pages gathered into the dense layout, or ``by_page(q, k_pool, v_pool, page_table,
    kv_positions, shared)`` over the pools where they lie (`dew.nn.attention.paged_cache_attention`).

    `filled` (a traced scalar) is how many slots the fullest row has written, this call's tokens
    included: every slot past it is empty in every row, so a gather takes only the smallest of
    `page_buckets` that covers it. `by_page` runs a one-token call when that gather would move at
    least half as many pages as the pool holds (reading the pool in place is then cheaper than
    copying those pages) and at most a row's worth of pages are named by several rows (a prefix
    cache's shared prompt pages): it scores those against every row (``shared``, 0 when there are
    none). Branches are picked on the device (`lax.switch`), so one program serves every mix of
    rows.
    """
    page_size = jax.tree.leaves(v_pool)[0].shape[-2]
    rows, entries = page_table.shape
    buckets = page_buckets(entries)
    needed = (jnp.asarray(filled, jnp.int32) + page_size - 1) // page_size
    branch = jnp.minimum(jnp.searchsorted(jnp.asarray(buckets, jnp.int32), needed), len(buckets) - 1)

    def over(entries, q, k_pool, v_pool, page_table, kv_positions):
        keys, values = gather_pages(k_pool, v_pool, page_table[:, :entries])
        return attend(q, keys, values, kv_positions[:, : entries * page_size])

    gathered = [functools.partial(over, bucket) for bucket in buckets]
    operands = (q, k_pool, v_pool, page_table, kv_positions)
    pages = scratch_page(k_pool)
    if by_page is None or q.shape[1] != 1 or 2 * rows * buckets[-1] < pages:
        return gathered[0](*operands) if len(buckets) == 1 else jax.lax.switch(branch, gathered, *operands)
    named = jnp.zeros((pages + 1,), jnp.int32).at[page_table.reshape(-1)].add(1)
    common = jnp.sum(named[:pages] > 1)
    gathers = 2 * rows * jnp.asarray(buckets, jnp.int32)[branch]
    use_pages = (gathers >= pages) & (common <= entries)
    paged = [functools.partial(_by_page, by_page, shared) for shared in (0, entries)]
    choice = jnp.where(use_pages, len(buckets) + (common > 0), branch)
    return jax.lax.switch(choice, gathered + paged, *operands)


def _by_page(by_page: Callable, shared: int, *operands) -> jax.Array:
    return by_page(*operands, shared)


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
    """Zeroed key and value pools of ``pages`` pages plus scratch, per layer or stacked: keys
    ``[pages + 1, kv_heads, head_dim, page_size]``, values ``[pages + 1, kv_heads, page_size,
    head_dim]``; `Quantized` blocks for a quantized layout (int8 keys rotated)."""
    lead = ((num_layers,) if stacked else ()) + (pages + 1, kv_heads)

    def keys():
        shape = lead + (head_dim, page_size)
        if quantized is None:
            return jnp.zeros(shape, dtype)
        return Quantized.zeros(shape, -2, quantized, rotated=rotates_keys(quantized))

    def values():
        shape = lead + (page_size, head_dim)
        if quantized is None:
            return jnp.zeros(shape, dtype)
        return Quantized.zeros(shape, -1, quantized, rotated=False)

    if stacked:
        return keys(), values()
    return tuple(keys() for _ in range(num_layers)), tuple(values() for _ in range(num_layers))
