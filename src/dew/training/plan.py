"""A memory and collective plan for training a decoder on a mesh, made without allocating weights.

`plan` builds the Trainer's real step for a decoder, an AdamW optimizer and a `MeshSpec`, lowers
it on abstract state (`jax.eval_shape` shapes carrying their shardings) and compiles it. XLA's
memory analysis of the compiled step gives the per-device bytes of its arguments, outputs and
temporaries; the shardings give the parameter and optimizer shares of the arguments; a second
compile of the forward pass alone measures the activations it keeps for the backward pass; the
optimized HLO gives the collectives one step runs. Only the compiler runs, so a plan for 64
devices needs 64 devices JAX can compile for, not their memory: on a CPU host these are virtual
devices (`XLA_FLAGS=--xla_force_host_platform_device_count=N`, which `use_virtual_devices` sets).
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dew.checks import count
from dew.nn.backbones.causal_transformer import CausalTransformer
from dew.objectives.base import Step
from dew.objectives.lm import LMObjective
from dew.telemetry.collectives import Collectives, count_collectives
from dew.training.mesh import Layout, MeshSpec, batch_divisor
from dew.training.trainer import Trainer

# Decoder shapes by name (CausalTransformer arguments, as the models' config.json files give them).
PRESETS: dict[str, dict[str, Any]] = {
    "llama-3-8b": dict(
        vocab_size=128256, emb_features=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        mlp_features=14336, max_seq_len=8192, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=False,
        qk_norm=False,
    ),
    "llama-3.2-1b": dict(
        vocab_size=128256, emb_features=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
        mlp_features=8192, max_seq_len=8192, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=True,
        qk_norm=False,
    ),
    "qwen3-30b-a3b": dict(  # every layer a mixture of 128 experts, top-8
        vocab_size=151936, emb_features=2048, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
        mlp_features=6144, max_seq_len=40960, rope_theta=1000000.0, norm_eps=1e-6, tie_embeddings=False,
        qk_norm=True, mixture=dict(num_experts=128, top_k=8, expert_features=768, normalize_top_k=True),
    ),
}

# What one device of each size holds, in bytes as the sizes are sold (a little under what the
# runtime reports, which leaves room for its own allocations).
DEVICE_SIZES = {"80 GB": 80 * 10**9, "141 GB": 141 * 10**9}
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def decoder(settings: Mapping[str, Any], *, seq_len: int, dtype: Any = jnp.bfloat16,
            remat: str | None = "full") -> CausalTransformer:
    """The decoder a plan compiles: `settings` with scanned layers (one compiled layer, however
    many the model has), compute in `dtype`, float32 weights, and a context of at least `seq_len`."""
    settings = dict(settings)
    settings["max_seq_len"] = max(int(settings.get("max_seq_len", seq_len)), seq_len)
    return CausalTransformer(**settings, scan_layers=True, remat=remat, dtype=dtype, param_dtype=jnp.float32)


def use_virtual_devices(devices: int) -> None:
    """Ask XLA for `devices` virtual CPU devices (and the CPU backend, unless JAX_PLATFORMS names one).

    Effective only before JAX starts its backends; afterwards the flag is ignored, and `plan`
    raises when JAX started with fewer devices than it needs, naming how many it has.
    """
    devices = count(devices, "devices")
    flags = re.sub(rf"{DEVICE_COUNT_FLAG}=\d+", "", os.environ.get("XLA_FLAGS", "")).strip()
    os.environ["XLA_FLAGS"] = f"{flags} {DEVICE_COUNT_FLAG}={devices}".strip()
    if not os.environ.get("JAX_PLATFORMS"):
        jax.config.update("jax_platforms", "cpu")


def _available_devices(devices: int) -> list[jax.Device]:
    present = jax.devices()
    if len(present) < devices:
        raise ValueError(
            f"A plan for {devices} devices needs JAX to see {devices} devices, but it started with "
            f"{len(present)} {present[0].platform} device(s). Set XLA_FLAGS={DEVICE_COUNT_FLAG}={devices} "
            f"(and JAX_PLATFORMS=cpu) before JAX starts: `dew plan` does this when it runs as its own "
            f"command; in Python call dew.training.plan.use_virtual_devices({devices}) before any "
            f"JAX computation."
        )
    return present[:devices]


@dataclasses.dataclass(frozen=True)
class Plan:
    """Per-device bytes of one training step, and the collectives it runs.

    `parameters`, `optimizer_state`, `other_state` (step counters, key, EMA, other collections)
    and `batch` are the shares of XLA's `arguments`; `outputs` is the new state and metrics,
    `aliased` the part of them written over the donated arguments. `temporaries` is XLA's scratch
    for the step, which holds the `activations` (what the forward pass keeps for the backward
    pass, measured by compiling the forward pass alone) among its buffers.
    """

    devices: int
    mesh: dict[str, int]
    batch_rows: int
    seq_len: int
    parameter_count: int
    parameters: int
    optimizer_state: int
    other_state: int
    batch: int
    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    activations: int
    collectives: Collectives
    compile_seconds: float
    platform: str

    @property
    def total(self) -> int:
        """Bytes live on one device during the step: arguments, new outputs and temporaries."""
        return self.arguments + self.outputs - self.aliased + self.temporaries

    def fits(self, device_bytes: int) -> bool:
        return self.total <= device_bytes

    def mesh_text(self) -> str:
        return " x ".join(f"{axis}={size}" for axis, size in self.mesh.items() if size > 1) or "one device"

    def report(self) -> str:
        """The plan as a few lines of text."""
        lines = [
            f"{self.parameter_count / 1e9:.2f}B parameters on {self.devices} {self.platform} devices "
            f"({self.mesh_text()}), batch {self.batch_rows} x {self.seq_len} tokens; compiled in "
            f"{self.compile_seconds:.0f} s",
            "per device:",
            f"  parameters      {size_text(self.parameters)}",
            f"  optimizer state {size_text(self.optimizer_state)}",
            f"  other state     {size_text(self.other_state)}",
            f"  batch           {size_text(self.batch)}",
            f"  activations     {size_text(self.activations)}   (kept for the backward pass; part of temporaries)",
            f"  temporaries     {size_text(self.temporaries)}",
            f"  total           {size_text(self.total)}   (arguments + outputs - donated + temporaries)",
            "  fits " + "; ".join(f"{name}: {'yes' if self.fits(size) else 'no'}" for name, size in DEVICE_SIZES.items()),
            "collectives per step (count, bytes of results per device):",
        ]
        for collective in self.collectives.kinds:
            lines.append(f"  {collective.kind:<19}{collective.count:6d} {size_text(collective.bytes)}")
        if self.collectives.unknown_trip_counts:
            lines.append(f"  ({self.collectives.unknown_trip_counts} loops of unknown length counted once)")
        return "\n".join(lines)


def size_text(size: int) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:8.2f} {unit}"
    return f"{size:8d} B  "


def plan(model: CausalTransformer, mesh: MeshSpec, *, devices: int, batch: int, seq_len: int,
         layout: Layout = Layout(), optimizer: optax.GradientTransformation | None = None) -> Plan:
    """Compile one training step of `model` (next-token loss, AdamW by default) on `devices`
    devices laid out by `mesh`, for a global batch of `batch` rows of `seq_len` tokens, and
    measure it. Nothing the size of the model is allocated."""
    devices = count(devices, "devices")
    batch = count(batch, "batch")
    seq_len = count(seq_len, "seq_len")
    if not isinstance(mesh, MeshSpec):
        raise TypeError(f"mesh must be a dew.MeshSpec; got {type(mesh).__name__}.")
    mesh.shape(devices)  # raises, naming the factors, when they do not divide the devices
    chips = _available_devices(devices)
    objective = LMObjective(model, seq_len=seq_len)
    optimizer = optax.adamw(1e-4) if optimizer is None else optimizer
    trainer = Trainer(objective, optimizer, key=jax.random.key(0), mesh=mesh, layout=layout, devices=chips)
    splits = batch_divisor(trainer.mesh)
    if batch % splits:
        raise ValueError(
            f"batch={batch} rows do not split over the {splits} batch-parallel devices of "
            f"{mesh} on {devices} devices; use a batch that is a multiple of {splits}."
        )
    tokens = {"text": jax.ShapeDtypeStruct((batch, seq_len + 1), jnp.int32)}

    started = time.perf_counter()
    compiled = trainer.lower(tokens).compile()
    compile_seconds = time.perf_counter() - started
    memory = compiled.memory_analysis()
    state = trainer._abstract_with_shardings()
    placed_tokens = trainer._batch_sharding(tokens["text"].shape)
    parameters = _device_bytes(state.params)
    optimizer_state = _device_bytes(state.opt_state)
    everything = _device_bytes(state)

    return Plan(
        devices=devices,
        mesh={axis: size for axis, size in trainer.mesh.shape.items()},
        batch_rows=batch,
        seq_len=seq_len,
        parameter_count=sum(int(np.prod(leaf.shape)) for leaf in jax.tree_util.tree_leaves(state.params)),
        parameters=parameters,
        optimizer_state=optimizer_state,
        other_state=everything - parameters - optimizer_state,
        batch=_shard_bytes(tokens["text"].shape, jnp.dtype(jnp.int32), placed_tokens),
        arguments=memory.argument_size_in_bytes,
        outputs=memory.output_size_in_bytes,
        aliased=memory.alias_size_in_bytes,
        temporaries=memory.temp_size_in_bytes,
        activations=_activation_bytes(trainer, state, tokens, placed_tokens) - parameters,
        collectives=count_collectives(compiled.as_text()),
        compile_seconds=compile_seconds,
        platform=chips[0].platform,
    )


def _activation_bytes(trainer: Trainer, state: Any, tokens: Mapping[str, Any], sharding: Any) -> int:
    """Per-device bytes of the residuals the loss's backward pass reads (parameters among them),
    as XLA lays them out: the outputs of a compiled forward pass that returns them."""
    placed = {name: jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding) for name, value in tokens.items()}

    def residuals(variables, batch):
        step = Step(step=jnp.zeros((), jnp.int32), key=jax.random.key(0))
        loss = lambda params: trainer.objective.loss({**variables, "params": params}, batch, step)[0]  # noqa: E731
        with trainer.model_layout():  # the activations laid out as the step lays them out
            return jax.vjp(loss, variables["params"])[1]

    compiled = jax.jit(residuals).lower(state.variables, placed).compile()
    return compiled.memory_analysis().output_size_in_bytes


def _device_bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard's share)."""
    return sum(_shard_bytes(leaf.shape, leaf.dtype, leaf.sharding) for leaf in jax.tree_util.tree_leaves(tree))


def _shard_bytes(shape: tuple[int, ...], dtype: Any, sharding: Any) -> int:
    itemsize = dtype.itemsize if hasattr(dtype, "itemsize") else jnp.dtype(dtype).itemsize  # keys too
    return int(np.prod(sharding.shard_shape(tuple(shape)))) * itemsize
