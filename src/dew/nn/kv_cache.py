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

``KVCache(quantized="int8")`` or ``KVCache(quantized="float8_e4m3fn")`` with no arrays is a layout,
set as a decoder's ``kv_cache`` field: its `init_cache` then stores each layer's keys and values as
`dew.nn.kv_quant.Quantized` blocks (eight-bit codes and a float32 scale per token and head, in
the layouts above), `write_kv` encodes what it writes and `cache_attention` reads the codes.

``KVCache(page_size=16, pages=N)`` with no arrays describes a paged layout (`dew.nn.kv_pages`): a
model's ``kv_cache`` field or a Server's ``kv_cache=`` builds its cache from it, with one pool of
pages for all rows and a page table per row in place of a row's own slots. The two
combine: ``KVCache(page_size=16, pages=N, quantized="int8")`` pages eight-bit blocks.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from dew.checks import count
from dew.nn import kv_pages
from dew.nn.kv_quant import Quantized, check_head_dim, check_quantized, rotates_keys, store

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
      quantized: None (keys and values in the compute dtype), "int8" or "float8_e4m3fn"
        (`dew.nn.kv_quant`; each layer's k and v are then `Quantized` blocks).
      page_table: paged only, ``[B, pages_per_row]`` int32, the pool page holding each run of
        ``page_size`` slots of a row; k and v are then pools (`dew.nn.kv_pages`).
      page_size: tokens per page, None for a dense cache.
      pages: pages in the pool (None: enough for every row's max_len).

    With no arrays (``KVCache()``, ``KVCache(quantized="int8")``, ``KVCache(page_size=16)``) it is a
    layout, which a decoder's ``init_cache`` allocates.
    """

    k: Any = None
    v: Any = None
    positions: jax.Array | None = None
    lengths: jax.Array | None = None
    index: jax.Array | None = None
    page_table: Any = None
    quantized: str | None = struct.field(pytree_node=False, default=None)
    page_size: int | None = struct.field(pytree_node=False, default=None)
    pages: int | None = struct.field(pytree_node=False, default=None)

    def __post_init__(self):
        check_quantized(self.quantized)

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

        k, v = jax.tree.map(put, self.k, other.k), jax.tree.map(put, self.v, other.v)  # codes and scales alike
        row_positions = jnp.full((1, self.max_len), EMPTY, jnp.int32).at[:, : other.max_len].set(other.positions)
        return self.replace(
            k=k, v=v,
            positions=jax.lax.dynamic_update_slice(self.positions, row_positions, (row, zero)),
            lengths=self.lengths.at[row].set(other.lengths[0]),
            index=jnp.broadcast_to(self.index, self.lengths.shape).at[row].set(other.lengths[0]),
        )

    def take_rows(self, rows: jax.Array) -> "KVCache":
        """The rows ``rows [R]`` of a paged cache, over the same pools: their page table,
        positions, lengths and (per-row) index. A paged row owns nothing else, so a program can
        run a few rows and hand the result to `put_rows`."""
        self._check_rows("take_rows")
        index = self.index if self.index.ndim == 0 else self.index[rows]
        return self.replace(page_table=self.page_table[rows], positions=self.positions[rows],
                            lengths=self.lengths[rows], index=index)

    def put_rows(self, rows: jax.Array, part: "KVCache") -> "KVCache":
        """This cache with `part` (``take_rows(rows)``, since written to) put back: its pools, and
        its rows' page table, positions, lengths and index."""
        self._check_rows("put_rows")
        index = part.index if part.index.ndim == 0 else self.index.at[rows].set(part.index)
        return part.replace(page_table=self.page_table.at[rows].set(part.page_table),
                            positions=self.positions.at[rows].set(part.positions),
                            lengths=self.lengths.at[rows].set(part.lengths), index=index)

    def _check_rows(self, name: str) -> None:
        if not self.paged:
            raise ValueError(f"{name} needs a paged cache: a dense cache's rows are its key and value arrays, "
                             "so a dense program runs every row")

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

        k, v = jax.tree.map(rep, self.k), jax.tree.map(rep, self.v)  # every layer, codes and scales alike
        return self.replace(
            k=k, v=v, positions=jnp.repeat(self.positions, n, axis=0),
            lengths=jnp.repeat(self.lengths, n, axis=0),
        )

    def _repeat_pages(self, n: int) -> "KVCache":
        rows, entries = self.page_table.shape
        order = jnp.repeat(self.page_table, n, axis=0).reshape(-1)  # the new rows' pages, in row order
        order = jnp.concatenate([order, jnp.asarray([kv_pages.scratch_page(self.k if self.stacked else self.k[0])])])

        def copy(pool):  # [..., pages + 1, KV, a, b], codes and scales alike
            return jax.tree.map(lambda x: jnp.take(x, order, axis=x.ndim - 4), pool)

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
    value_dim: int | None = None,
    dtype: Any = jnp.float32,
    stacked: bool = False,
    layout: KVCache | None = None,
    rows_own_pages: bool = True,
) -> KVCache:
    """An empty cache (zeros, every slot empty, every length 0) in `layout` (None: dense); values are
    ``value_dim`` wide (default: ``head_dim``; 0 for latent attention, whose values are read from its keys).

    ``dtype`` is the storage dtype of an unquantized cache; a quantized `layout` stores its format's
    codes and float32 scales (int8 raises here for a head_dim that is not a power of two).
    With a paged `layout` (``KVCache(page_size=..., pages=...)``) the rows share one pool. When
    `rows_own_pages`, row b gets pages ``b * n .. b * n + n - 1`` of the ``n`` its max_len needs,
    and a pool too small for that raises; otherwise (a Server, which hands pages out per request)
    every table entry starts at the scratch page.
    """
    quantized = None if layout is None else check_quantized(layout.quantized)
    check_head_dim(quantized, head_dim)
    if layout is not None and layout.paged:
        return _init_paged(layout, num_layers=num_layers, batch_size=batch_size, max_len=max_len,
                           kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, stacked=stacked,
                           rows_own_pages=rows_own_pages)
    value_dim = head_dim if value_dim is None else value_dim
    k_shape = (batch_size * kv_heads, head_dim, max_len)
    v_shape = (batch_size * kv_heads, max_len, value_dim)
    lead = (num_layers,) if stacked else ()

    def block(shape, head_dim_axis, rotated):
        if quantized is None:
            return jnp.zeros(lead + shape, dtype)
        return Quantized.zeros(lead + shape, head_dim_axis, quantized, rotated=rotated)

    if stacked:
        k, v = block(k_shape, -2, rotates_keys(quantized)), block(v_shape, -1, False)
    else:  # one buffer per layer (a donated cache must not hold one array twice)
        k = tuple(block(k_shape, -2, rotates_keys(quantized)) for _ in range(num_layers))
        v = tuple(block(v_shape, -1, False) for _ in range(num_layers))
    return KVCache(
        k=k, v=v, positions=jnp.full((batch_size, max_len), EMPTY, jnp.int32),
        lengths=jnp.zeros((batch_size,), jnp.int32), index=jnp.zeros((), jnp.int32), quantized=quantized,
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
                                   num_layers=num_layers, dtype=dtype, stacked=stacked, quantized=layout.quantized)
    return KVCache(
        k=k, v=v, positions=jnp.full((batch_size, entries * layout.page_size), EMPTY, jnp.int32),
        lengths=jnp.zeros((batch_size,), jnp.int32), index=jnp.zeros((), jnp.int32), page_table=table,
        quantized=layout.quantized, page_size=layout.page_size, pages=pages,
    )


def write_kv(
    k_cache: jax.Array, v_cache: jax.Array, k: jax.Array, v: jax.Array, index: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Write ``k, v [B, T, KV, D]`` into one layer's caches at slots ``index .. index + T - 1``.

    ``k_cache`` is ``[B * KV, D, S]`` and ``v_cache`` ``[B * KV, S, D]``. With a scalar ``index``
    every row writes the same T slots; with ``index [B]`` row b writes from ``index[b]``. The
    caller makes sure they fit (``index + T <= S``). A `Quantized` cache gets the tokens encoded
    (keys rotated first where it rotates them), codes and scales written alike.
    """
    batch, length, kv_heads, _ = k.shape
    zero, start = jnp.int32(0), jnp.asarray(index, jnp.int32)
    # [B, T, KV, D or 1] -> the caches' layouts (D is 1 for a Quantized block's scales; 0 for latent values)
    keys = jax.tree.map(lambda x: x.transpose(0, 2, 3, 1).reshape(batch * kv_heads, x.shape[-1], length),
                        store(k, k_cache))
    values = jax.tree.map(lambda x: jnp.swapaxes(x, 1, 2).reshape(batch * kv_heads, length, x.shape[-1]),
                          store(v, v_cache))
    if start.ndim == 1:  # a slot per row: one update per row, batched into a scatter
        def per_row(cache, new, layout):  # [B * KV, a, b] seen as [B, KV, a, b]
            rows = cache.reshape((batch, kv_heads) + cache.shape[1:])
            new = new.reshape((batch, kv_heads) + new.shape[1:]).astype(cache.dtype)
            put = jax.vmap(lambda c, n, i: jax.lax.dynamic_update_slice(c, n, layout(i)))
            return put(rows, new, start).reshape(cache.shape)

        k_cache = jax.tree.map(lambda c, n: per_row(c, n, lambda i: (zero, zero, i)), k_cache, keys)
        v_cache = jax.tree.map(lambda c, n: per_row(c, n, lambda i: (zero, i, zero)), v_cache, values)
        return k_cache, v_cache
    k_cache = jax.tree.map(
        lambda c, n: jax.lax.dynamic_update_slice(c, n.astype(c.dtype), (zero, zero, start)), k_cache, keys)
    v_cache = jax.tree.map(
        lambda c, n: jax.lax.dynamic_update_slice(c, n.astype(c.dtype), (zero, start, zero)), v_cache, values)
    return k_cache, v_cache


def write_positions(positions: jax.Array, new: jax.Array, index: jax.Array) -> jax.Array:
    """Record positions ``new [B, T]`` in ``positions [B, S]`` at slots ``index ..`` (``[]`` or ``[B]``)."""
    start = jnp.asarray(index, jnp.int32)
    if start.ndim == 1:
        put = jax.vmap(lambda p, n, i: jax.lax.dynamic_update_slice(p, n, (i,)))
        return put(positions, new.astype(jnp.int32), start)
    return jax.lax.dynamic_update_slice(positions, new.astype(jnp.int32), (jnp.int32(0), start))
