"""Sequence parallelism: token activations split along their length over a mesh axis.

A training step on several devices enters `splitting(SequenceSplit(...))` while it traces the
model; outside that context every function here is the identity (or plain attention), so a model
runs unchanged on one device. With a sequence axis of one, `split_length` only pins the token rows
to the batch axes (the decoder calls it on its embeddings and at every layer's input). Inside a
split over ``k > 1`` devices:

* `split_length` pins ``[batch, length, ...]`` activations to rows split over the batch axes and the
  length split over the sequence axis, and `token_rows` keeps them 3-D for the projections (flattening
  ``[B, L, D]`` to ``[B * L, D]`` cannot keep both splits, so XLA would gather every block's input);
* `attention` runs self-attention inside `jax.shard_map`, where each device holds ``L / k`` queries,
  keys and values, and exchanges them one of two ways:

  - "ulysses" (DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv:2309.14509): an all-to-all trades the
    local rows of every head for all rows of ``1 / k`` of the heads, each device attends over the
    whole length for its heads, and a second all-to-all trades back. No device holds a whole key or
    value. It needs the query heads to split over ``k``; key/value heads that do not are repeated
    up to ``lcm(kv_heads, k)`` first (with one kv head, every device then holds all of it: forced
    Ulysses only; the byte count never picks it there);
  - "gather": an all-gather of keys and values, each device attending with its own queries.

  "auto" takes Ulysses when it can split the heads and moves fewer bytes (see `exchange_bytes`).

Masks stay exact because every device knows the global position of its rows: causal, sliding-window
and segment (packed document) rules are evaluated on global positions, and RoPE, applied before
attention to the global ``positions``, needs nothing more.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dew.checks import one_of
from dew.nn.attention import dot_product_attention

EXCHANGES = ("auto", "ulysses", "gather")


def check_exchange(exchange: str) -> str:
    """Return `exchange` if it names a sequence-parallel exchange, else raise listing them."""
    return one_of(exchange, EXCHANGES, "sequence_exchange", what="a sequence-parallel exchange")


@dataclasses.dataclass(frozen=True)
class SequenceSplit:
    """How a traced step splits token activations over `mesh`.

    Rows go over `batch_axes` (those larger than one that divide the batch), positions over `axis`,
    and attention heads over `heads_axis` when both head counts divide it (as the tensor rules split
    the projections). `exchange` is "auto", "ulysses" or "gather".
    """

    mesh: Mesh
    batch_axes: tuple[str, ...]
    axis: str = "sequence"
    heads_axis: str | None = "tensor"
    exchange: str = "auto"

    def __post_init__(self):
        check_exchange(self.exchange)

    @property
    def size(self) -> int:
        return self.mesh.shape[self.axis]

    def batch_spec(self, batch: int) -> Any:
        """The mesh axes `batch` rows split over: the batch axes, dropping inner ones until they divide."""
        axes = tuple(a for a in self.batch_axes if self.mesh.shape[a] > 1)
        while axes and batch % math.prod(self.mesh.shape[a] for a in axes):
            axes = axes[:-1]
        return None if not axes else axes[0] if len(axes) == 1 else axes

    def heads_spec(self, heads: int, kv_heads: int) -> str | None:
        """The mesh axis attention heads split over (None: every device holds all of them)."""
        if self.heads_axis is None or self.mesh.shape[self.heads_axis] == 1:
            return None
        size = self.mesh.shape[self.heads_axis]
        return self.heads_axis if heads % size == 0 and kv_heads % size == 0 else None

    def ways(self, spec_entry: Any) -> int:
        """How many pieces a PartitionSpec entry (None, an axis or a tuple of axes) cuts a dimension into."""
        axes = () if spec_entry is None else (spec_entry,) if isinstance(spec_entry, str) else spec_entry
        return math.prod(self.mesh.shape[a] for a in axes)

    def check_length(self, length: int) -> None:
        """Raise when `length` positions do not split evenly over the sequence axis."""
        if length % self.size:
            short = self.size - length % self.size
            raise ValueError(
                f"a sequence of {length} tokens does not split over MeshSpec(sequence={self.size}): "
                f"{length} % {self.size} = {length % self.size}. Use a length that is a multiple of "
                f"{self.size} ({short} more tokens, {length + short}) or a sequence axis that divides {length}."
            )


# the split in force and the lengths it has split so far (so a caller can tell whether any model used it)
_ACTIVE: contextvars.ContextVar[tuple[SequenceSplit | None, list[int]]] = contextvars.ContextVar(
    "dew_sequence_split", default=(None, []))


@contextlib.contextmanager
def splitting(split: SequenceSplit | None) -> Iterator[list[int]]:
    """Split sequences as `split` says while a model is traced inside this block (None: do not).

    Yields the list of lengths `split_length` splits inside the block: empty afterwards means no
    model traced there splits anything, and the sequence axis's devices repeat each other's work.
    """
    split_lengths: list[int] = []
    token = _ACTIVE.set((split, split_lengths))
    try:
        yield split_lengths
    finally:
        _ACTIVE.reset(token)


def active() -> SequenceSplit | None:
    """The split a model being traced now runs under, or None."""
    split = _ACTIVE.get()[0]
    return split if split is not None and split.size > 1 else None


def row_axes(rows: int) -> Any:
    """The mesh axes the step being traced splits `rows` token rows over (None: none, or no split)."""
    split = _ACTIVE.get()[0]
    return None if split is None else split.batch_spec(rows)


def split_length(x: jax.Array) -> jax.Array:
    """``x [batch, length, ...]`` constrained to rows over the batch axes and positions over the sequence axis.

    A split of size one (a step on several devices with ``sequence=1``) still pins the rows to the
    batch axes: otherwise XLA's propagation follows the weights, whose width `fsdp` splits, and every
    device would hold every row of the batch's activations.
    """
    split = _ACTIVE.get()[0]
    if split is None:
        return x
    length = None
    if split.size > 1:
        split.check_length(x.shape[1])
        _ACTIVE.get()[1].append(x.shape[1])
        length = split.axis
    spec = PartitionSpec(split.batch_spec(x.shape[0]), length, *([None] * (x.ndim - 2)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(split.mesh, spec))


def token_rows(x: jax.Array) -> jax.Array:
    """The tokens of ``x [batch, length, width]`` as the projections take them.

    ``[batch * length, width]`` rows on one device (2-D products need no transposes in XLA:CPU's
    backward pass); the unflattened, length-split ``x`` under a sequence split, since flattening
    would merge the batch and length splits into one XLA cannot express without a gather.
    """
    if active() is None:
        return x.reshape(-1, x.shape[-1])
    return split_length(x)


def exchange_bytes(exchange: str, *, rows: int, heads: int, kv_heads: int, head_dim: int, size: int,
                   itemsize: int) -> int:
    """Bytes one device sends in one attention call's forward exchange (the backward mirrors it).

    `rows` is the device's ``batch * length / size`` token rows and `heads`/`kv_heads` its heads.
    Ulysses sends ``(size - 1) / size`` of its queries, keys, values and outputs (keys and values
    repeated to ``lcm(kv_heads, size)`` heads); the gather receives ``size - 1`` blocks of keys and
    values. With as many kv heads as query heads, Ulysses moves fewer bytes from ``size = 3`` on.
    """
    block = rows * head_dim * itemsize
    if exchange == "ulysses":
        kv = math.lcm(kv_heads, size)
        return (size - 1) * block * (2 * heads + 2 * kv) // size
    return (size - 1) * block * 2 * kv_heads


def ulysses_misfit(heads: int, size: int) -> str | None:
    """Why the heads on a device cannot be traded over `size` devices, or None when they can.

    The query heads must split over `size`; the kv heads then always fit, since the query heads are
    then a common multiple of the kv heads and `size`, hence of the ``lcm`` the kv heads repeat to.
    """
    if heads % size:
        return (
            f"the {heads} query heads on each device do not split over sequence={size}: "
            f"{heads} % {size} = {heads % size}"
        )
    return None


def choose_exchange(split: SequenceSplit, *, rows: int, heads: int, kv_heads: int, head_dim: int,
                    itemsize: int) -> str:
    """The exchange a call runs: the forced one (after checking it fits), or the cheaper that fits."""
    misfit = ulysses_misfit(heads, split.size)
    if split.exchange == "ulysses" and misfit is not None:
        raise ValueError(
            f"sequence_exchange='ulysses' cannot split this attention: {misfit}. Use "
            f"sequence_exchange='gather' (or 'auto'), or heads that divide."
        )
    if split.exchange != "auto":
        return split.exchange
    if misfit is not None:
        return "gather"
    sizes = dict(rows=rows, heads=heads, kv_heads=kv_heads, head_dim=head_dim, size=split.size, itemsize=itemsize)
    cheaper = exchange_bytes("ulysses", **sizes) < exchange_bytes("gather", **sizes)
    return "ulysses" if cheaper else "gather"


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
              window: int | jax.Array | None = None, segment_ids: jax.Array | None = None,
              impl: str = "auto", sinks: jax.Array | None = None) -> jax.Array:
    """Self-attention of ``q [B, L, N, H]`` over ``k, v [B, L, K, H]``, split along L when a split is active.

    The result equals `dot_product_attention` with the same rules; without an active split it is
    that call.
    """
    split = active()
    if split is None:
        return dot_product_attention(q, k, v, causal=causal, window=window, segment_ids=segment_ids, impl=impl,
                                     sinks=sinks)
    batch, length, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    split.check_length(length)
    rows_axes, heads_axis = split.batch_spec(batch), split.heads_spec(heads, kv_heads)
    heads_ways = split.ways(heads_axis)
    exchange = choose_exchange(
        split, rows=batch // split.ways(rows_axes) * length // split.size, heads=heads // heads_ways,
        kv_heads=kv_heads // heads_ways, head_dim=head_dim, itemsize=q.dtype.itemsize,
    )
    tokens = PartitionSpec(rows_axes, split.axis, heads_axis, None)
    segments = None if segment_ids is None else jnp.broadcast_to(segment_ids, (batch, length))
    layer_window = None if window is None or isinstance(window, int) else window  # traced: an operand
    body = _ulysses if exchange == "ulysses" else _gather

    def local_attention(q, k, v, segments, layer_window, sinks):
        return body(q, k, v, segments, axis=split.axis, size=split.size, causal=causal, impl=impl,
                    window=window if layer_window is None else layer_window, sinks=sinks)

    return jax.shard_map(
        local_attention,
        mesh=split.mesh,
        in_specs=(tokens, tokens, tokens, PartitionSpec(rows_axes, split.axis), PartitionSpec(),
                  PartitionSpec(heads_axis)),
        out_specs=tokens,
    )(q, k, v, segments, layer_window, sinks)


def _ulysses(q, k, v, segments, *, axis, size, causal, window, impl, sinks):
    """All rows of 1/size of the heads per device: trade rows for heads, attend, trade back."""
    kv_heads = k.shape[2]
    repeat = math.lcm(kv_heads, size) // kv_heads
    if repeat > 1:  # query head h reads kv head h // groups before and after the repeat
        k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)
    to_heads = lambda x: jax.lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)  # noqa: E731
    q, k, v = to_heads(q), to_heads(k), to_heads(v)
    if segments is not None:
        segments = jax.lax.all_gather(segments, axis, axis=1, tiled=True)
    if sinks is not None:  # this device's query heads: its slice of the exchange
        sinks = jax.lax.dynamic_slice_in_dim(sinks, jax.lax.axis_index(axis) * q.shape[2], q.shape[2])
    out = dot_product_attention(q, k, v, causal=causal, window=window, segment_ids=segments, impl=impl, sinks=sinks)
    return jax.lax.all_to_all(out, axis, split_axis=1, concat_axis=2, tiled=True)


def _gather(q, k, v, segments, *, axis, size, causal, window, impl, sinks):
    """Every key and value per device, attended by this device's queries at their global positions."""
    local_length = q.shape[1]
    k = jax.lax.all_gather(k, axis, axis=1, tiled=True)
    v = jax.lax.all_gather(v, axis, axis=1, tiled=True)
    kv_segments = None if segments is None else jax.lax.all_gather(segments, axis, axis=1, tiled=True)
    first = jax.lax.axis_index(axis) * local_length
    return dot_product_attention(
        q, k, v, causal=causal, window=window, q_segment_ids=segments, kv_segment_ids=kv_segments,
        q_positions=first + jnp.arange(local_length, dtype=jnp.int32),
        kv_positions=jnp.arange(k.shape[1], dtype=jnp.int32), impl=impl, sinks=sinks,
    )
