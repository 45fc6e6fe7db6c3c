"""`dew plan`: per-device memory and collectives of a decoder's training step on a mesh, from the
compiler alone (no weights are allocated)."""

from __future__ import annotations

import dataclasses
import json
from typing import Literal


def run(
    preset: str | None = None,
    config: str | None = None,
    devices: int = 8,
    fsdp: int = 1,
    tensor: int = 1,
    expert: int = 1,
    dispatch: Literal["global", "exchange"] = "exchange",
    capacity_factor: float | None = None,
    sequence: int = 1,
    stage: int = 1,
    microbatches: int | None = None,
    batch: int | None = None,
    seq_len: int = 2048,
    dtype: Literal["bfloat16", "float32"] = "bfloat16",
    remat: str | None = "full",
    min_shard: int = 2**10,
    json_out: str | None = None,
):
    """Compile one training step (next-token loss, AdamW, float32 weights) on DEVICES virtual devices
    and print what each device holds and which collectives a step runs.

    Args:
        preset: A named decoder shape (see dew.training.plan.PRESETS), e.g. llama-3-8b.
        config: A Hugging Face config.json (or the directory holding it) to take the shape from instead.
        devices: How many devices the mesh spans; data parallelism takes what the other axes leave.
        fsdp: Devices that shard parameters, optimizer state and the batch.
        tensor: Devices that split heads, MLP and vocabulary.
        expert: Devices that split mixture layers' experts (and the batch); needs a mixture model.
        dispatch: How mixture layers reach their experts: "exchange" (all-to-alls over the expert
            axis) or "global" (every device runs every expert, gathering them).
        capacity_factor: The exchange's send slots per expert shard as a multiple of an even share
            (default: enough that nothing is dropped; see dew.nn.expert_parallel).
        sequence: Devices that split each sequence's positions.
        stage: GPipe stages the layer stack runs as (weights replicated over them).
        microbatches: Microbatches per batch for the stages (default: one per stage).
        batch: Global batch in rows (default: one row per device).
        seq_len: Tokens per row; a longer context than the config's extends max_seq_len.
        dtype: Compute dtype (weights and optimizer state stay float32).
        remat: Rematerialization policy of each layer (None keeps every activation).
        min_shard: Leaves with fewer elements stay replicated (Layout.min_shard).
        json_out: Also write the plan as JSON to this path.
    """
    from dew.training.plan import use_virtual_devices

    use_virtual_devices(devices)  # before anything starts JAX's backends

    import jax.numpy as jnp

    from dew.files import write_atomic
    from dew.training.mesh import Layout, MeshSpec
    from dew.training.plan import PRESETS, decoder, plan

    if (preset is None) == (config is None):
        raise ValueError(f"dew plan needs exactly one of --preset (one of {sorted(PRESETS)}) or --config "
                         f"(a config.json); got preset={preset!r}, config={config!r}")
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"--preset {preset!r} is not a known shape; presets are {sorted(PRESETS)}")
    settings = dict(PRESETS[preset] if preset is not None else _config_settings(config))
    if settings.get("mixture") is not None:
        settings["mixture"] = {**settings["mixture"], "dispatch": dispatch, "capacity_factor": capacity_factor}
    model = decoder(settings, seq_len=seq_len, dtype=getattr(jnp, dtype), remat=remat)
    mesh = MeshSpec(fsdp=fsdp, tensor=tensor, expert=expert, sequence=sequence, stage=stage, microbatches=microbatches)
    result = plan(model, mesh, devices=devices, batch=devices if batch is None else batch, seq_len=seq_len,
                  layout=Layout(min_shard=min_shard))
    print(result.report())
    if json_out is not None:
        fields = dataclasses.asdict(result)
        fields["total"] = result.total
        write_atomic(json_out, json.dumps(fields, indent=2).encode())
    return result


def _config_settings(config: str) -> dict:
    """CausalTransformer arguments from a Hugging Face config.json (a file or its directory)."""
    from pathlib import Path

    from dew.interop.families import decoder_family

    path = Path(config)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"--config {config}: no such config.json (give the file or the directory holding it)")
    values = json.loads(path.read_text())
    return decoder_family(values, where=str(path)).model_kwargs(values)
