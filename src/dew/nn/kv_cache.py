"""An explicit key/value cache for autoregressive decoding.

The cache is an ordinary pytree that a decoder takes as an argument and returns updated, so a
generation loop can carry it through `jax.lax.while_loop` or `jax.lax.scan` (it is not a Flax
mutable collection).

Slots are shared by all rows: a call that feeds T tokens per row writes them to the same T slots
of every row, starting at ``index``, whatever their positions. A server whose rows start at
different times keeps an ``index`` per row instead (``[B]``): row b writes from its own slot
``index[b]``, a per-row scatter, and `KVCache.seat` puts a freshly prefilled row into it. Each slot records the position of
the token it holds (``positions[b, s]``, -1 for an empty slot), so rows of different lengths share
one write and attention masks by position: a query sees the slots whose position is known and
(causal) not after its own. Writing one slot for every row is a single in-place update, where a
slot per row would be a scatter that XLA:CPU expands into copies of the whole cache.

Layout, per layer: keys ``k`` are ``[batch * kv_heads, head_dim, max_len]`` and values ``v``
``[batch * kv_heads, max_len, head_dim]`` (rows ordered batch-major, then key/value head): the
operand layouts of the two attention products, q k^T and p v, so reading the cache needs no
transpose and writing it needs no copy. An unscanned decoder keeps a tuple of them, one per
layer; a decoder built with ``scan_layers`` keeps stacked arrays with a leading ``num_layers``
axis so the scan slices them.

``KVCache(page_size=16, pages=N)`` with no arrays describes a paged layout (`dew.nn.kv_pages`): a
model's ``kv_cache`` field or a Server's ``kv_cache=`` builds its cache from it, with one pool of
pages for all rows and a page table per row in place of a row's own slots.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from dew.checks import count
from dew.nn import kv_pages

EMPTY = -1  # the position recorded for a slot that holds no token


@struct.dataclass
class KVCache:
    """Per-layer keys and values, the position each slot holds, and where the next write goes.

    Attributes:
      k: keys, a tuple of ``[B * KV, D, S]`` arrays (one per layer) or one ``[L, B * KV, D, S]``.
      v: values, a tuple of ``[B * KV, S, D]`` arrays or one ``[L, B * KV, S, D]``.
      positions: ``[B, S]`` int32, the position of the token in each slot (-1 where empty).
      lengths: ``[B]`` int32, each row's next position (one past the last token it holds).
      index: ``[]`` int32, the first free slot (the same for every row), or ``[B]``, one per row.
      page_table: paged only, ``[B, pages_per_row]`` int32, the pool page holding each run of
        ``page_size`` slots of a row; k and v are then pools (`dew.nn.kv_pages`).
      page_size: tokens per page, None for a dense cache.
      pages: pages in the pool (None: enough for every row's max_len).
    """

    k: Any = None
    v: Any = None
    positions: jax.Array = None
    lengths: jax.Array = None
    index: jax.Array = None
    page_table: Any = None
    page_size: int | None = struct.field(pytree_node=False, default=None)
    pages: int | None = struct.field(pytree_node=False, default=None)

    @property
    def paged(self) -> bool:
        return self.page_size is not None

    @property
    def stacked(self) -> bool:
        return not isinstance(self.k, (tuple, list))

    @property
    def batch_size(self) -> int:
        return int(self.positions.shape[0])

    @property
    def max_len(self) -> int:
        return int(self.positions.shape[1])

    @property
    def num_layers(self) -> int:
        return int(self.k.shape[0]) if self.stacked else len(self.k)

    @property
    def kv_heads(self) -> int:
        heads = int((self.k if self.stacked else self.k[0]).shape[-3])
        return heads if self.paged else heads // self.batch_size

    def layer(self, i: int) -> tuple[jax.Array, jax.Array]:
        """Keys and values of layer i."""
        return self.k[i], self.v[i]

    def truncate(self, lengths: jax.Array) -> "KVCache":
        """Forget every token at or past each row's new length (``lengths [B]``).

        A padded prefill writes pad tokens after a short row's prompt; truncating to the prompt
        lengths empties their slots, and the row's next token goes to position ``lengths[b]``.
        """
        lengths = jnp.asarray(lengths, jnp.int32)
        kept = (self.positions >= 0) & (self.positions < lengths[:, None])
        return self.replace(positions=jnp.where(kept, self.positions, EMPTY), lengths=lengths)

    def seat(self, row: jax.Array, other: "KVCache") -> "KVCache":
        """This cache with row `row` replaced by the one row of `other` (a prefilled prompt).

        `other` holds ``W <= max_len`` slots; they go to slots ``0 .. W - 1`` of the row and every
        later slot of the row is emptied, so nothing the row held before stays visible. The row's
        length and write index become `other`'s. Needs a per-row ``index`` and a dense cache.
        """
        if self.paged or other.paged:
            raise ValueError("seat copies a dense row; a paged cache writes a prompt into its row's pages directly")
        if other.batch_size != 1 or other.max_len > self.max_len or other.stacked != self.stacked:
            raise ValueError(
                f"seat takes a one-row cache of at most {self.max_len} slots in the same layout; got "
                f"{other.batch_size} rows of {other.max_len} slots (stacked={other.stacked})"
            )
        row = jnp.asarray(row, jnp.int32)
        zero = jnp.int32(0)
        start = (row * self.kv_heads, zero, zero)

        def put(big, small):  # [..., B * KV, a, b] <- [..., KV, a', b']
            lead = (zero,) * (big.ndim - 3)
            return jax.lax.dynamic_update_slice(big, small.astype(big.dtype), lead + start)

        k = put(self.k, other.k) if self.stacked else tuple(put(a, b) for a, b in zip(self.k, other.k))
        v = put(self.v, other.v) if self.stacked else tuple(put(a, b) for a, b in zip(self.v, other.v))
        row_positions = jnp.full((1, self.max_len), EMPTY, jnp.int32).at[:, : other.max_len].set(other.positions)
        return self.replace(
            k=k, v=v,
            positions=jax.lax.dynamic_update_slice(self.positions, row_positions, (row, zero)),
            lengths=self.lengths.at[row].set(other.lengths[0]),
            index=jnp.broadcast_to(self.index, self.lengths.shape).at[row].set(other.lengths[0]),
        )

    def repeat(self, n: int) -> "KVCache":
        """Each row repeated n times in place (row b becomes rows b*n .. b*n+n-1).

        A paged cache copies each row's pages into a pool of its own for the new rows."""
        if self.paged:
            return self._repeat_pages(n)
        batch, kv_heads = self.batch_size, self.kv_heads

        def rep(x):  # [..., B * KV, a, b] -> [..., B * n * KV, a, b]
            lead = x.shape[:-3]
            rows = x.reshape(lead + (batch, kv_heads) + x.shape[-2:])
            rows = jnp.repeat(rows, n, axis=len(lead))
            return rows.reshape(lead + (batch * n * kv_heads,) + x.shape[-2:])

        k = rep(self.k) if self.stacked else tuple(rep(x) for x in self.k)
        v = rep(self.v) if self.stacked else tuple(rep(x) for x in self.v)
        return self.replace(
            k=k, v=v, positions=jnp.repeat(self.positions, n, axis=0),
            lengths=jnp.repeat(self.lengths, n, axis=0),
        )

    def _repeat_pages(self, n: int) -> "KVCache":
        rows, entries = self.page_table.shape
        order = jnp.repeat(self.page_table, n, axis=0).reshape(-1)  # the new rows' pages, in row order
        order = jnp.concatenate([order, jnp.asarray([kv_pages.scratch_page(self.k if self.stacked else self.k[0])])])

        def copy(pool):  # [..., pages + 1, KV, a, b]
            return jnp.take(pool, order, axis=pool.ndim - 4)

        k = copy(self.k) if self.stacked else tuple(copy(x) for x in self.k)
        v = copy(self.v) if self.stacked else tuple(copy(x) for x in self.v)
        return self.replace(
            k=k, v=v, positions=jnp.repeat(self.positions, n, axis=0),
            lengths=jnp.repeat(self.lengths, n, axis=0),
            page_table=jnp.arange(rows * n * entries, dtype=jnp.int32).reshape(rows * n, entries),
            pages=rows * n * entries,
        )


def init_kv_cache(
    *,
    num_layers: int,
    batch_size: int,
    max_len: int,
    kv_heads: int,
    head_dim: int,
    dtype: Any = jnp.float32,
    stacked: bool = False,
    layout: KVCache | None = None,
    rows_own_pages: bool = True,
) -> KVCache:
    """An empty cache (zeros, every slot empty, every length 0).

    With a paged `layout` (``KVCache(page_size=..., pages=...)``) the rows share one pool. When
    `rows_own_pages`, row b gets pages ``b * n .. b * n + n - 1`` of the ``n`` its max_len needs,
    and a pool too small for that raises; otherwise (a Server, which hands pages out per request)
    every table entry starts at the scratch page.
    """
    if layout is not None and layout.paged:
        return _init_paged(layout, num_layers=num_layers, batch_size=batch_size, max_len=max_len,
                           kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, stacked=stacked,
                           rows_own_pages=rows_own_pages)
    k_shape = (batch_size * kv_heads, head_dim, max_len)
    v_shape = (batch_size * kv_heads, max_len, head_dim)
    if stacked:
        k = jnp.zeros((num_layers,) + k_shape, dtype)
        v = jnp.zeros((num_layers,) + v_shape, dtype)
    else:
        k = tuple(jnp.zeros(k_shape, dtype) for _ in range(num_layers))
        v = tuple(jnp.zeros(v_shape, dtype) for _ in range(num_layers))
    return KVCache(
        k=k, v=v, positions=jnp.full((batch_size, max_len), EMPTY, jnp.int32),
        lengths=jnp.zeros((batch_size,), jnp.int32), index=jnp.zeros((), jnp.int32),
    )


def check_layout(layout: KVCache) -> KVCache:
    """`layout` if it describes a cache Dew can build (a positive page_size; pages only with it)."""
    if not isinstance(layout, KVCache):
        raise TypeError(f"kv_cache must be a dew.nn.kv_cache.KVCache layout; got {type(layout).__name__}.")
    if layout.k is not None:
        raise ValueError("kv_cache takes a layout such as KVCache(page_size=16, pages=512), not a built cache")
    if layout.page_size is not None:
        count(layout.page_size, "page_size (tokens per page)")
    if layout.pages is not None:
        if layout.page_size is None:
            raise ValueError(f"pages={layout.pages} needs a page_size: pass KVCache(page_size=16, pages={layout.pages})")
        count(layout.pages, "pages (pages in the pool)")
    return layout


def _init_paged(layout, *, num_layers, batch_size, max_len, kv_heads, head_dim, dtype, stacked, rows_own_pages):
    check_layout(layout)
    entries = kv_pages.pages_per_row(max_len, layout.page_size)
    pages = batch_size * entries if layout.pages is None else layout.pages
    if rows_own_pages:
        if pages < batch_size * entries:
            raise ValueError(
                f"a pool of {pages} pages of {layout.page_size} tokens cannot give each of {batch_size} rows the "
                f"{entries} pages its {max_len} tokens need ({batch_size * entries} pages); leave pages unset "
                "outside a Server, or pass pages >= rows * ceil(max_len / page_size)"
            )
        table = jnp.arange(batch_size * entries, dtype=jnp.int32).reshape(batch_size, entries)
    else:
        table = jnp.full((batch_size, entries), pages, jnp.int32)  # every entry at scratch
    k, v = kv_pages.init_page_pool(pages=pages, kv_heads=kv_heads, head_dim=head_dim, page_size=layout.page_size,
                                   num_layers=num_layers, dtype=dtype, stacked=stacked)
    return KVCache(
        k=k, v=v, positions=jnp.full((batch_size, entries * layout.page_size), EMPTY, jnp.int32),
        lengths=jnp.zeros((batch_size,), jnp.int32), index=jnp.zeros((), jnp.int32), page_table=table,
        page_size=layout.page_size, pages=pages,
    )


def write_kv(
    k_cache: jax.Array, v_cache: jax.Array, k: jax.Array, v: jax.Array, index: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Write ``k, v [B, T, KV, D]`` into one layer's caches at slots ``index .. index + T - 1``.

    ``k_cache`` is ``[B * KV, D, S]`` and ``v_cache`` ``[B * KV, S, D]``. With a scalar ``index``
    every row writes the same T slots; with ``index [B]`` row b writes from ``index[b]``. The
    caller makes sure they fit (``index + T <= S``).
    """
    batch, length, kv_heads, head_dim = k.shape
    zero, start = jnp.int32(0), jnp.asarray(index, jnp.int32)
    keys = k.transpose(0, 2, 3, 1).reshape(batch * kv_heads, head_dim, length)
    values = jnp.swapaxes(v, 1, 2).reshape(batch * kv_heads, length, head_dim)
    if start.ndim == 1:  # a slot per row: one update per row, batched into a scatter
        def per_row(cache, new, layout):  # [B * KV, a, b] seen as [B, KV, a, b]
            rows = cache.reshape((batch, kv_heads) + cache.shape[1:])
            new = new.reshape((batch, kv_heads) + new.shape[1:]).astype(cache.dtype)
            put = jax.vmap(lambda c, n, i: jax.lax.dynamic_update_slice(c, n, layout(i)))
            return put(rows, new, start).reshape(cache.shape)

        k_cache = per_row(k_cache, keys, lambda i: (zero, zero, i))
        v_cache = per_row(v_cache, values, lambda i: (zero, i, zero))
        return k_cache, v_cache
    k_cache = jax.lax.dynamic_update_slice(k_cache, keys.astype(k_cache.dtype), (zero, zero, start))
    v_cache = jax.lax.dynamic_update_slice(v_cache, values.astype(v_cache.dtype), (zero, start, zero))
    return k_cache, v_cache


def write_positions(positions: jax.Array, new: jax.Array, index: jax.Array) -> jax.Array:
    """Record positions ``new [B, T]`` in ``positions [B, S]`` at slots ``index ..`` (``[]`` or ``[B]``)."""
    start = jnp.asarray(index, jnp.int32)
    if start.ndim == 1:
        put = jax.vmap(lambda p, n, i: jax.lax.dynamic_update_slice(p, n, (i,)))
        return put(positions, new.astype(jnp.int32), start)
    return jax.lax.dynamic_update_slice(positions, new.astype(jnp.int32), (jnp.int32(0), start))
