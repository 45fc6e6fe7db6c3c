"""Expert parallelism: a mixture's experts split over the ``expert`` mesh axis, its tokens exchanged.

A training step on several devices enters `exchanging(ExpertSplit(...))` while it traces the model;
outside that context (one device, generation) `active()` is None and a `Mixture` with
``dispatch="exchange"`` computes exactly what ``dispatch="global"`` does. Inside a split over
``s > 1`` devices, `exchange` runs the experts inside `jax.shard_map`, where each device holds
``E / s`` experts' parameters and its own token rows (the rows split over the batch axes, which
include the expert axis), and for each layer:

1. routes its rows (the router ran before, on every row) and writes each (row, expert) assignment
   into a fixed-size send buffer ``[s, capacity, width]``: slot ``(d, c)`` holds the ``c``-th
   assignment bound for device ``d``, the one holding its expert;
2. trades the buffers with `jax.lax.all_to_all` over the expert axis, so each device receives the
   rows every device sends its experts, and the local expert id of each;
3. sorts what it received by expert and runs its experts as the grouped products of the global
   dispatch, then undoes the sort;
4. trades the results back with the reverse all-to-all, so each slot returns to its sender;
5. weights each assignment's result by its router weight and sums a row's k results.

The buffers give every (device, expert shard) pair ``capacity`` slots, so every shape is static.
Assignments past a pair's capacity are dropped (they add nothing to their row) and counted. By
default the capacity is what a device can possibly send one shard, ``rows * min(k, E / s)``
(each row's k experts are distinct, and a shard holds ``E / s``), so nothing is dropped; a
``capacity_factor`` ``f`` sets it to ``ceil(f * rows * k / s)``, f times an even share, which
bounds the buffers and the experts' work at the risk of dropping assignments a skewed router sends.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec


@dataclasses.dataclass(frozen=True)
class ExpertSplit:
    """How a traced step splits mixtures over `mesh`: experts over `axis`, token rows over
    `token_axes` (those larger than one, outermost first; they must include `axis`)."""

    mesh: Mesh
    token_axes: tuple[str, ...]
    axis: str = "expert"

    @property
    def size(self) -> int:
        return self.mesh.shape[self.axis]

    def rows_spec(self, rows: int) -> Any:
        """The mesh axes `rows` token rows split over: the token axes larger than one, dropping inner
        ones until they divide `rows`; None when the expert axis is then not among them."""
        axes = tuple(a for a in self.token_axes if self.mesh.shape[a] > 1)
        while axes and rows % math.prod(self.mesh.shape[a] for a in axes):
            axes = axes[:-1]
        return axes if self.axis in axes else None


# the split in force and the mixture layers traced under it (so a caller can tell whether any model had one)
_ACTIVE: contextvars.ContextVar[tuple[ExpertSplit | None, list[int]]] = contextvars.ContextVar(
    "dew_expert_split", default=(None, []))


@contextlib.contextmanager
def exchanging(split: ExpertSplit | None) -> Iterator[list[int]]:
    """Split mixtures as `split` says while a model is traced inside this block (None: do not).

    Yields a list that holds one entry per mixture layer traced inside the block: empty afterwards
    means the model has no mixtures, and the expert axis's devices would only split the batch.
    """
    mixtures: list[int] = []
    token = _ACTIVE.set((split, mixtures))
    try:
        yield mixtures
    finally:
        _ACTIVE.reset(token)


def active() -> ExpertSplit | None:
    """The split a model being traced now runs under (None outside one, or with one expert device)."""
    split = _ACTIVE.get()[0]
    return split if split is not None and split.size > 1 else None


def note_mixture(num_experts: int) -> None:
    """Record that a mixture layer of `num_experts` experts is being traced inside `exchanging`."""
    split, mixtures = _ACTIVE.get()
    if split is not None:
        mixtures.append(num_experts)


def check_experts(num_experts: int, split: ExpertSplit) -> None:
    """Raise unless `num_experts` experts split evenly over the expert axis."""
    if num_experts % split.size:
        raise ValueError(
            f"a mixture of {num_experts} experts does not split over MeshSpec(expert={split.size}): "
            f"{num_experts} % {split.size} = {num_experts % split.size}. Use an expert axis that divides "
            f"{num_experts}."
        )


def capacity(rows: int, top_k: int, num_experts: int, shards: int, capacity_factor: float | None) -> int:
    """Send-buffer slots per (device, expert shard) for a device of `rows` rows (see the module docstring)."""
    most = rows * min(top_k, num_experts // shards)  # all a device can send one shard
    if capacity_factor is None:
        return most
    return max(1, min(most, math.ceil(capacity_factor * rows * top_k / shards)))


def exchange(rows: jax.Array, weights: jax.Array, experts: jax.Array, kernels: Any, *, split: ExpertSplit,
             num_experts: int, capacity_factor: float | None,
             product: Callable[..., jax.Array]) -> tuple[jax.Array, jax.Array] | None:
    """The routed experts' weighted sum for ``rows [N, width]``, and the assignments dropped.

    `weights` and `experts` ``[N, k]`` are each row's router weights and expert ids; `kernels` is a
    pytree of stacked expert parameters, each ``[E, ...]``; `product(rows, row_experts, group_sizes,
    kernels)` runs rows sorted by expert through their experts (rows whose id is the expert count
    belong to none). Returns None when the rows do not split over the expert axis, and the caller
    computes the layer without exchanging.
    """
    check_experts(num_experts, split)
    rows_axes = split.rows_spec(rows.shape[0])
    if rows_axes is None:
        return None
    leaves, treedef = jax.tree_util.tree_flatten(kernels)
    tokens = PartitionSpec(rows_axes)
    shard = PartitionSpec(split.axis)

    def local_experts(rows, weights, experts, *leaves):
        out, dropped = _exchange_local(
            rows, weights, experts, jax.tree_util.tree_unflatten(treedef, leaves), axis=split.axis,
            shards=split.size, num_experts=num_experts, capacity_factor=capacity_factor, product=product)
        return out, dropped[None]

    out, dropped = jax.shard_map(
        local_experts,
        mesh=split.mesh,
        in_specs=(tokens, tokens, tokens, *([shard] * len(leaves))),
        out_specs=(tokens, PartitionSpec(rows_axes)),
    )(rows, weights, experts, *leaves)
    return out, jnp.sum(dropped)


def _exchange_local(rows, weights, experts, kernels, *, axis, shards, num_experts, capacity_factor, product):
    """One device's part of `exchange`: its rows, its experts' kernels ``[E / shards, ...]``."""
    n, width = rows.shape
    k = experts.shape[-1]
    local = num_experts // shards
    slots = capacity(n, k, num_experts, shards, capacity_factor)
    flat = experts.reshape(-1)  # assignment a is row a // k's choice a % k
    source = jnp.arange(n * k) // k
    owner = flat // local  # the device holding the assignment's expert
    bound = owner[:, None] == jnp.arange(shards)  # [n * k, shards]: the shard each assignment is bound for
    rank = jnp.sum(jnp.cumsum(bound, axis=0) * bound, axis=1) - 1  # its place among those bound there
    kept = rank < slots
    slot = jnp.where(kept, owner * slots + rank, shards * slots)  # past the end: dropped
    send = jnp.zeros((shards * slots, width), rows.dtype).at[slot].set(rows[source], mode="drop")
    send_ids = jnp.full((shards * slots,), local, jnp.int32).at[slot].set(flat % local, mode="drop")  # empty: local

    received = _trade(send.reshape(shards, slots, width), axis).reshape(shards * slots, width)
    received_ids = _trade(send_ids.reshape(shards, slots), axis).reshape(-1)
    order = jnp.argsort(received_ids, stable=True)  # this device's experts in order, empty slots last
    group_sizes = jnp.bincount(received_ids, length=local).astype(jnp.int32)  # empty slots not counted
    computed = _unsort(product(received[order], received_ids[order], group_sizes, kernels), order)

    returned = _trade(computed.reshape(shards, slots, width), axis).reshape(shards * slots, width)
    results = returned.at[slot].get(mode="fill", fill_value=0)  # dropped assignments read zero
    results = results * weights.reshape(-1)[:, None].astype(results.dtype)
    out = jnp.zeros_like(rows).at[source].add(results)
    return out, jnp.sum(~kept).astype(jnp.float32)


def _trade(buffer: jax.Array, axis: str) -> jax.Array:
    """Block ``d`` of ``buffer [shards, ...]`` sent to device ``d``; block ``j`` of the result came
    from device ``j``."""
    return jax.lax.all_to_all(buffer, axis, split_axis=0, concat_axis=0, tiled=True)


def _unsort(sorted_rows: jax.Array, order: jax.Array) -> jax.Array:
    """Rows computed in `order` put back where they were received."""
    return jnp.zeros_like(sorted_rows).at[order].set(sorted_rows)
