"""GPipe: a stack of identical layers run as pipeline stages over microbatches.

GPipe (Huang et al. 2019, arXiv:1811.06965) cuts the layer stack into `stages` consecutive slices
and the batch into `microbatches`. At tick `t` stage `s` runs its layers on microbatch `t - s`, so
after `stages - 1` ticks of filling every stage works at once; the run takes
`microbatches + stages - 1` ticks. Between ticks each stage hands its output to the next (a shift
along the stage dimension, which becomes a collective-permute when that dimension is split over
devices). The weights keep their one layout (``[layers, ...]``) and stay replicated over the stage
axis; each device reads its own slice of them, so stages save activation memory, not parameter
memory.

Microbatch ``m`` takes every ``microbatches``-th row from row ``m``, so a batch split over the batch
axes cuts into microbatches on each device without moving rows; inside the loop every buffer keeps
its rows over the batch axes (`sequence_parallel.row_axes`), and the stage dimension stays on the
stage axis through the layers' own row pins (`vmap`'s `spmd_axis_name`).

A training step that runs stages enters `staging(StageSplit(...))` while it traces the model;
outside that context `current()` is None and a model runs its layers the usual way.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dew.nn.sequence_parallel import row_axes


@dataclasses.dataclass(frozen=True)
class StageSplit:
    """How a traced step runs a layer stack: `stages` slices over mesh axis `axis`, `microbatches` per batch."""

    mesh: Mesh | None
    stages: int
    microbatches: int
    axis: str = "stage"

    def check(self, layers: int, rows: int) -> None:
        """Raise unless `layers` layers cut into the stages and `rows` rows into the microbatches."""
        if self.stages > layers or layers % self.stages:
            raise ValueError(
                f"MeshSpec(stage={self.stages}) cuts the layer stack into {self.stages} stages of equal "
                f"length, but the model has {layers} layers; use a stage count that divides {layers}."
            )
        if rows % self.microbatches:
            raise ValueError(
                f"MeshSpec(microbatches={self.microbatches}) cuts each batch into {self.microbatches} "
                f"microbatches, but the batch has {rows} rows; use a batch that is a multiple of "
                f"{self.microbatches}."
            )

    @property
    def spmd_axis(self) -> str | None:
        """The mesh axis a stage dimension lies on (None without a mesh)."""
        return None if self.mesh is None else self.axis

    def constrain(self, tree: Any, *, stage: bool = True, rows: bool = False) -> Any:
        """Pin every leaf of `tree`: its leading dimension to the stage axis (`stage`) or to none,
        and with `rows` its second dimension, a microbatch's rows, to the axes the step splits
        token rows over; other dimensions are left to XLA."""
        if self.mesh is None:
            return tree

        def pin(leaf):
            second = [row_axes(leaf.shape[1])] if rows else []
            free = [PartitionSpec.UNCONSTRAINED] * (leaf.ndim - 1 - len(second))
            spec = PartitionSpec(self.axis if stage else None, *second, *free)
            return jax.lax.with_sharding_constraint(leaf, NamedSharding(self.mesh, spec))

        return jax.tree_util.tree_map(pin, tree)


@dataclasses.dataclass
class Staged:
    """What `staging` yields: how many layer stacks ran as stages inside it (0 means the stage
    devices only repeated each other's work)."""

    stacks: int = 0


_CURRENT: contextvars.ContextVar[tuple[StageSplit, Staged] | None] = contextvars.ContextVar(
    "dew_stage_split", default=None
)


@contextlib.contextmanager
def staging(split: StageSplit | None) -> Iterator[Staged]:
    """Run layer stacks traced inside this block as `split` says (None: the usual way)."""
    staged = Staged()
    token = _CURRENT.set(None if split is None else (split, staged))
    try:
        yield staged
    finally:
        _CURRENT.reset(token)


def current() -> StageSplit | None:
    """The StageSplit of the step being traced, or None."""
    entry = _CURRENT.get()
    return None if entry is None else entry[0]


def run_stages(
    split: StageSplit,
    layer: Callable[[Any, jax.Array, Any], jax.Array],
    weights: Any,
    x: jax.Array,
    rows: Any = None,
) -> jax.Array:
    """Run every layer over `x` ``[batch, ...]`` as GPipe stages; the same result as a plain scan.

    `weights` is a tree whose leaves have the layer count as leading dimension; `layer(weights_i,
    x, rows)` runs one layer. `rows` is a tree of per-row arrays (positions, segment ids) that
    travel with their microbatch from stage to stage.
    """
    layers = jax.tree_util.tree_leaves(weights)[0].shape[0]
    split.check(layers, x.shape[0])
    entry = _CURRENT.get()
    if entry is not None:
        entry[1].stacks += 1
    stages, micro = split.stages, split.microbatches
    per_stage = layers // stages

    def run_stage(stage_weights, h, stage_rows):
        return jax.lax.scan(lambda h, w: (layer(w, h, stage_rows), None), h, stage_weights)[0]

    # [layers, ...] -> [stages, layers per stage, ...]: a view of the replicated weights, each
    # stage's slice read where that stage runs.
    staged = split.constrain(
        jax.tree_util.tree_map(lambda w: w.reshape((stages, per_stage) + w.shape[1:]), weights)
    )
    # Microbatch m is rows m, m + micro, ...: each device's rows cut into microbatches in place.
    by_micro = lambda a: jnp.swapaxes(a.reshape((a.shape[0] // micro, micro) + a.shape[1:]), 0, 1)  # noqa: E731
    inputs = (by_micro(x), jax.tree_util.tree_map(lambda a: by_micro(jnp.asarray(a)), rows))
    inputs = split.constrain(inputs, stage=False, rows=True)
    # What each stage works on: activations and rows of one microbatch (zeros before the pipe fills).
    slots = jax.tree_util.tree_map(lambda a: jnp.zeros((stages,) + a.shape[1:], a.dtype), inputs)
    run_all = jax.vmap(run_stage, spmd_axis_name=split.spmd_axis)  # the layers' row pins keep the stage axis

    def tick(carry, t):
        slots, outputs = carry
        # Shift: stage s takes stage s-1's last output; stage 0 takes microbatch t (the last one
        # again once all have entered: its results are never read).
        entering = jax.tree_util.tree_map(lambda a: a[jnp.minimum(t, micro - 1)], inputs)
        slots = jax.tree_util.tree_map(lambda s, e: jnp.roll(s, 1, axis=0).at[0].set(e), slots, entering)
        slots = split.constrain(slots, rows=True)
        h, slot_rows = slots
        h = split.constrain(run_all(staged, h, slot_rows), rows=True)
        # The last stage finished microbatch t - (stages - 1); earlier ticks write slot 0, which
        # that microbatch overwrites later.
        done = jnp.maximum(t - (stages - 1), 0)
        outputs = jax.lax.dynamic_update_index_in_dim(outputs, h[stages - 1], done, axis=0)
        return ((h, slot_rows), split.constrain(outputs, stage=False, rows=True)), None

    outputs = jnp.zeros_like(inputs[0])
    (_, outputs), _ = jax.lax.scan(tick, (slots, outputs), jnp.arange(micro + stages - 1))
    return jnp.swapaxes(outputs, 0, 1).reshape(x.shape)
