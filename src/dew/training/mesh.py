"""Device meshes and how parameters are laid out on them.

`MeshSpec` names how many devices each parallelism axis takes; data parallelism takes what is left.
`Layout` maps the logical axis names that model parameters carry (`embed`, `mlp`, `heads`, ...) to
mesh axes. Model code never mentions devices: it only names its axes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dew.checks import count, count_fields
from dew.nn.expert_parallel import ExpertSplit
from dew.nn.gpipe import StageSplit
from dew.nn.sequence_parallel import SequenceSplit, check_exchange

# Mesh axes, outermost first. `replicas` spans hosts in hybrid sharding; `stage` holds GPipe's
# stages (weights replicated over it); `data` is what is left.
AXES = ("replicas", "stage", "data", "fsdp", "expert", "sequence", "tensor")
# The axes a global batch is split over.
BATCH_AXES = ("replicas", "data", "fsdp", "expert")

# Logical parameter / activation axis -> mesh axes (tried in order; the first that divides wins).
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", BATCH_AXES),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("expert", "expert"),
    ("length", "sequence"),
    ("norm", None),
)


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """How many devices each parallelism axis spans; data parallelism takes the remainder.

    `stage` runs a decoder's scanned layer stack as that many GPipe stages (`dew.nn.gpipe`), each
    batch cut into `microbatches` (default: one per stage); weights and optimizer state stay
    replicated over the stages, which save activation memory. `expert` splits mixture layers'
    experts (and their optimizer state) over that many devices, which also split the batch
    (`dew.nn.expert_parallel`); a model without mixture layers refuses it.
    """

    fsdp: int = 1
    tensor: int = 1
    expert: int = 1
    sequence: int = 1
    replicas: int = 1
    stage: int = 1
    microbatches: int | None = None

    def __post_init__(self):
        count_fields(self, fsdp=1, tensor=1, expert=1, sequence=1, replicas=1, stage=1)
        object.__setattr__(self, "microbatches", count(self.microbatches, "MeshSpec.microbatches", optional=True))
        if self.microbatches is not None and self.stage == 1:
            raise ValueError(
                f"MeshSpec(microbatches={self.microbatches}) cuts batches for pipeline stages, but stage=1. "
                f"Set stage= as well, or use Trainer(accumulation=...) to split a batch on one stage."
            )

    def shape(self, device_count: int) -> dict[str, int]:
        """Axis sizes for `device_count` devices, with `data` filling the rest."""
        fixed = self.fsdp * self.tensor * self.expert * self.sequence * self.replicas * self.stage
        if device_count % fixed:
            raise ValueError(
                f"MeshSpec(fsdp={self.fsdp}, tensor={self.tensor}, expert={self.expert}, "
                f"sequence={self.sequence}, replicas={self.replicas}, stage={self.stage}) needs a multiple "
                f"of {fixed} devices, but {device_count} are available. Choose factors whose product "
                f"divides {device_count}."
            )
        sizes = dict(
            replicas=self.replicas,
            stage=self.stage,
            data=device_count // fixed,
            fsdp=self.fsdp,
            expert=self.expert,
            sequence=self.sequence,
            tensor=self.tensor,
        )
        return {axis: sizes[axis] for axis in AXES}

    def build(self, devices: Sequence[jax.Device] | None = None) -> Mesh:
        """The jax Mesh over `devices` (all devices by default)."""
        devices = list(jax.devices() if devices is None else devices)
        sizes = self.shape(len(devices))
        grid = np.asarray(devices, dtype=object).reshape(tuple(sizes.values()))
        return Mesh(grid, AXES)

    def stage_split(self, mesh: Mesh) -> StageSplit | None:
        """How a step on `mesh` runs layer stacks as stages (None: one stage)."""
        if self.stage == 1:
            return None
        return StageSplit(mesh, self.stage, self.microbatches or self.stage)


HOST_PARTS = ("opt_state", "ema")  # the TrainState fields Layout(host=...) may keep in host memory
HOST_MEMORY = "pinned_host"


def in_memory(tree: Any, kind: str) -> Any:
    """Every sharding of `tree` moved to the memory `kind` ("device" or "pinned_host")."""
    return jax.tree_util.tree_map(lambda sharding: sharding.with_memory_kind(kind), tree)


def check_host_memory(devices: Sequence[jax.Device]) -> None:
    """Raise unless every device can address pinned host memory (what Layout(host=...) needs)."""
    for device in devices:
        kinds = {memory.kind for memory in device.addressable_memories()}
        if HOST_MEMORY not in kinds:
            raise ValueError(
                f"Layout(host=...) keeps state in {HOST_MEMORY!r} memory, but {device.platform} device "
                f"{device.id} addresses only {sorted(kinds)}. Leave host=() on this backend."
            )


@dataclasses.dataclass(frozen=True)
class Layout:
    """Rules from logical axis names to mesh axes, and the smallest leaf worth sharding.

    `rules` is a sequence of `(logical name, mesh axis | tuple of mesh axes | None)`. A parameter
    with fewer than `min_shard` elements stays replicated. Parameters without logical names are
    sharded over `fsdp` on their largest dimension that divides evenly. `host` names parts of the
    training state ("opt_state", "ema") kept in pinned host memory between steps: the step moves
    them to the device, uses them and writes them back, trading transfers for device memory.
    `sequence_exchange` is how attention trades a split sequence (`MeshSpec(sequence=k)`): "auto"
    (Ulysses all-to-alls when the heads split and they move fewer bytes, else a key/value gather),
    or "ulysses" / "gather" to force one (see `dew.nn.sequence_parallel`).
    """

    rules: Sequence[tuple[str, Any]] = DEFAULT_RULES
    min_shard: int = 2**10
    host: Sequence[str] = ()
    sequence_exchange: str = "auto"

    def __post_init__(self):
        object.__setattr__(self, "rules", tuple((str(k), v) for k, v in self.rules))
        host = (self.host,) if isinstance(self.host, str) else tuple(self.host)
        unknown = [part for part in host if part not in HOST_PARTS]
        if unknown:
            raise ValueError(f"Layout(host=...) names {unknown}; the parts that can live in host memory are {HOST_PARTS}.")
        object.__setattr__(self, "host", host)
        check_exchange(self.sequence_exchange)
        for logical, target in self.rules:
            for axis in _as_tuple(target):
                if axis not in AXES:
                    raise ValueError(
                        f"Layout rule {logical!r} -> {target!r} names mesh axis {axis!r}; "
                        f"mesh axes are {AXES}."
                    )

    def mesh_axes(self, logical: str | None) -> tuple[str, ...]:
        for name, target in self.rules:
            if name == logical:
                return _as_tuple(target)
        return ()

    def spec(self, shape: Sequence[int], logical: Sequence[str | None] | None, mesh: Mesh) -> PartitionSpec:
        """The PartitionSpec of one leaf of `shape` with logical axis names `logical`."""
        shape = tuple(shape)
        if math.prod(shape) < max(self.min_shard, 1) or not shape:
            return PartitionSpec()
        used: set[str] = set()
        if logical is None:
            return self._fsdp_fallback(shape, mesh)
        parts: list[Any] = []
        for size, name in zip(shape, logical):
            axes = tuple(
                a for a in self.mesh_axes(name) if a not in used and mesh.shape[a] > 1
            )
            while axes and size % math.prod(mesh.shape[a] for a in axes):
                axes = axes[:-1]  # drop inner axes until the dimension divides
            used.update(axes)
            parts.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return PartitionSpec(*parts)

    def _fsdp_fallback(self, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
        fsdp = mesh.shape["fsdp"]
        if fsdp == 1:
            return PartitionSpec()
        order = sorted(range(len(shape)), key=lambda i: -shape[i])
        for i in order:
            if shape[i] % fsdp == 0:
                parts = [None] * len(shape)
                parts[i] = "fsdp"
                return PartitionSpec(*parts)
        return PartitionSpec()


def _as_tuple(target: Any) -> tuple[str, ...]:
    if target is None:
        return ()
    if isinstance(target, str):
        return (target,)
    return tuple(target)


def logical_names(boxed_tree: Any) -> Any:
    """Per-leaf logical axis names (a tuple, or None) of a tree that may hold Flax boxes."""
    from flax.core import meta

    def names(leaf):
        if isinstance(leaf, meta.Partitioned):
            return tuple(leaf.names)
        return None

    return jax.tree_util.tree_map(
        names, boxed_tree, is_leaf=lambda x: isinstance(x, meta.Partitioned)
    )


def unbox(tree: Any) -> Any:
    """Strip Flax partitioning boxes, leaving plain arrays."""
    from flax.core import meta

    return meta.unbox(tree)


def tree_shardings(abstract: Any, names: Any, layout: Layout, mesh: Mesh) -> Any:
    """NamedShardings for every leaf of `abstract` (ShapeDtypeStructs) given its logical names."""

    def one(leaf, leaf_names):
        shape = getattr(leaf, "shape", ())
        return NamedSharding(mesh, layout.spec(shape, leaf_names, mesh))

    return jax.tree_util.tree_map(
        one, abstract, names, is_leaf=lambda x: x is None
    )


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Split axis 0 of a batch over the batch axes of the mesh; replicate the rest."""
    axes = tuple(a for a in BATCH_AXES if mesh.shape[a] > 1)
    first = None if not axes else axes[0] if len(axes) == 1 else axes
    return NamedSharding(mesh, PartitionSpec(first, *([None] * (ndim - 1))))


def sequence_split(mesh: Mesh, layout: Layout) -> SequenceSplit | None:
    """How a step on `mesh` lays out token activations: rows over the batch axes, and the length over
    the sequence axis when it is larger than one (None: one device)."""
    if mesh.size == 1:
        return None
    return SequenceSplit(mesh, BATCH_AXES, axis="sequence", heads_axis="tensor", exchange=layout.sequence_exchange)


def expert_split(mesh: Mesh) -> ExpertSplit | None:
    """How a step on `mesh` splits mixture layers: experts over the expert axis, token rows over the
    batch axes and the sequence axis (None: an expert axis of one)."""
    if mesh.shape["expert"] == 1:
        return None
    return ExpertSplit(mesh, BATCH_AXES + ("sequence",), axis="expert")


def batch_divisor(mesh: Mesh) -> int:
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())

