"""`dew.pipeline`: the inference task a saved run, a checkpoint directory or a Hub repository serves.

A saved run (run.json beside its checkpoint steps) rebuilds its objective from the record and asks
it for its task over one step's weights, exactly as `objective.pipeline(state)` does after
training. A Hugging Face checkpoint directory, or a Hub repository id resolved through the local
Hugging Face cache, loads through `dew.interop`. With `mesh=`, the weights are placed by the same
logical-axis rules the Trainer uses (by default data parallelism over all devices), and results
are sharded by row.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from dew.config.run import RUN_FILE
from dew.hub import is_repo_id, local_directory
from dew.inference import image

CONFIG_FILE = "config.json"
MODEL_INDEX = "model_index.json"  # a diffusers pipeline directory


def pipeline(
    source: str | os.PathLike,
    *,
    mesh: Any = None,
    layout: Any = None,
    dtype: Any = None,
    param_dtype: Any = None,
    ema: bool = True,
    step: int | None = None,
    revision: str | None = None,
):
    """The task `source` serves: TextGeneration, MaskedGeneration or TextToImage.

    Args:
      source: a run directory, a Hugging Face checkpoint directory, a diffusers pipeline directory
        (model_index.json), or a Hub repository id.
      mesh, layout: a MeshSpec and Layout to place the weights on (default: MeshSpec(), data
        parallelism over every device, with the weights replicated).
      dtype: the compute dtype. param_dtype: the storage dtype of the weights; None keeps a run's
        stored dtypes and loads a published checkpoint in float32, "auto" keeps the stored dtypes.
      ema: a run's moving-average weights (raises when the run keeps none); False for the live ones.
      step: which of a run's checkpoint steps (default: the newest).
      revision: a branch, tag or commit of a Hub repository.
    """
    path = Path(source).expanduser()
    if path.is_dir():
        if (path / RUN_FILE).is_file():
            if revision is not None:
                raise ValueError(f"revision={revision!r} pins a Hub repository; {path} is a saved run (pass step= instead).")
            return _from_run(path, step=step, ema=ema, mesh=mesh, layout=layout, dtype=dtype, param_dtype=param_dtype)
        if (path / MODEL_INDEX).is_file():
            return _from_diffusers(path, step=step, mesh=mesh, dtype=dtype, param_dtype=param_dtype)
        if (path / CONFIG_FILE).is_file():
            return _from_published(path, step=step, mesh=mesh, layout=layout, dtype=dtype, param_dtype=param_dtype)
        present = sorted(p.name for p in path.iterdir())[:12]
        raise FileNotFoundError(
            f"{path} is a directory, but neither a saved run (no {RUN_FILE}) nor a Hugging Face "
            f"checkpoint directory (no {CONFIG_FILE}, nor a diffusers pipeline's {MODEL_INDEX}); it holds {present}."
        )
    if not is_repo_id(str(source)):
        raise FileNotFoundError(
            f"{str(source)!r} is not a directory (so neither a saved run nor a checkpoint directory) and "
            "not a Hub repository id of the form owner/name."
        )
    directory = local_directory(str(source), revision=revision)
    if (directory / MODEL_INDEX).is_file():
        return _from_diffusers(directory, step=step, mesh=mesh, dtype=dtype, param_dtype=param_dtype)
    return _from_published(directory, step=step, mesh=mesh, layout=layout, dtype=dtype, param_dtype=param_dtype)


# --- saved runs -----------------------------------------------------------------------------------


def _from_run(path: Path, *, step, ema, mesh, layout, dtype, param_dtype):
    import jax.numpy as jnp

    from dew.config.run import RunConfig
    from dew.config.saved import load_run, objective_class
    from dew.objectives.base import Objective

    cls = objective_class(RunConfig.load(path), path)
    if cls.pipeline is Objective.pipeline:  # checked before any weights are read
        raise TypeError(
            f"{path} is a {cls.__name__} run, which has no generation task, so dew.pipeline cannot serve "
            f"it; {cls.no_task_hint}."
        )
    run = load_run(path, step=step)
    model = run.config.model.build()
    if dtype is not None:
        if not hasattr(model, "dtype"):
            raise ValueError(f"dtype= sets a model's compute dtype, but {type(model).__name__} has no dtype field.")
        model = model.clone(dtype=jnp.dtype(dtype))
    objective = _build_objective(run, model)
    state = run.state()
    if "base" in getattr(model, "frozen_collections", ()):  # a LoRA run: its checkpoints hold the factors alone
        state = state.replace(variables={**state.variables, "base": _adapted_base(path, model)})
    if param_dtype not in (None, "auto"):
        state = state.replace(variables=_cast(state.variables, param_dtype), ema=_cast(state.ema, param_dtype))
    row_sharding = None
    mesh = _default_mesh(mesh)
    if mesh is not None:
        state, row_sharding = _place_state(objective, state, mesh, layout)
    task = objective.pipeline(state, ema=ema)
    replacements: dict[str, Any] = {}
    tokenizer = run.tokenizer()
    if tokenizer is not None and _has_field(task, "processor"):
        from dew.inference.processor import RunProcessor

        replacements["processor"] = RunProcessor(tokenizer)
    if run.config.sampling is not None and _has_field(task, "sampling"):
        replacements["sampling"] = run.config.sampling
    if isinstance(run.config.sampling, dict):  # a diffusion run's solver, steps and guidance
        replacements.update({name: value for name, value in run.config.sampling.items() if _has_field(task, name)})
    if row_sharding is not None and _has_field(task, "row_sharding"):
        replacements["row_sharding"] = row_sharding
    return dataclasses.replace(task, **replacements) if replacements else task


def _build_objective(run: Any, model: Any) -> Any:
    """The run's objective around `model`; an objective that keeps parts of itself as files in the run
    (a diffusion run's text encoder and autoencoder) rebuilds them with the loaders of `dew.interop`."""
    rebuild = getattr(run.objective_class, "rebuild", None)
    if rebuild is None:
        return run.config.objective.build(model)
    from dew.config.records import from_record
    from dew.interop.autoencoders import PretrainedAutoencoder
    from dew.interop.text_encoders import PretrainedTextEncoder

    return rebuild(model, from_record(run.config.objective.settings), run.directory,
                   load_text_encoder=PretrainedTextEncoder.load, load_autoencoder=PretrainedAutoencoder.load)


def text_to_image_from_run(directory: str | os.PathLike, *, step: int | None = None, ema: bool = True,
                           mesh: Any = None, layout: Any = None, dtype: Any = None, param_dtype: Any = None) -> Any:
    """`TextToImage.from_run`: a saved diffusion run's task; a run of another kind raises before any
    weights are read."""
    from dew.config.run import RunConfig
    from dew.config.saved import objective_class
    from dew.objectives.diffusion import DiffusionObjective

    path = Path(directory).expanduser()
    cls = objective_class(RunConfig.load(path), path)
    if not issubclass(cls, DiffusionObjective):
        raise ValueError(
            f"{path} is a {cls.__name__} run, not a diffusion run, so TextToImage cannot load it. "
            f"dew.pipeline({str(path)!r}) builds the task each kind of run serves."
        )
    return _from_run(path, step=step, ema=ema, mesh=mesh, layout=layout, dtype=dtype, param_dtype=param_dtype)


image.reads_runs_with(text_to_image_from_run)


def read_autoencoder(directory: str | os.PathLike) -> Any:
    """A diffusers AutoencoderKL directory as a `PretrainedAutoencoder` (what `autoencoder="dir"` means)."""
    from dew.interop.autoencoders import PretrainedAutoencoder

    return PretrainedAutoencoder.load(directory)


image.reads_autoencoders_with(read_autoencoder)


def _adapted_base(path: Path, model: Any) -> Any:
    """The frozen base weights of an adapted run, loaded from the checkpoint its run.json names."""
    from dew.interop import PretrainedDecoder

    if model.base is None:
        raise ValueError(f"{path} trains a LoRA adapter, but its run.json names no base checkpoint to load.")
    decoder = model.model
    return PretrainedDecoder.load(model.base, dtype=decoder.dtype, param_dtype=decoder.param_dtype,
                                  max_seq_len=decoder.max_seq_len, scan_layers=decoder.scan_layers).variables["params"]


def _has_field(task: Any, name: str) -> bool:
    return dataclasses.is_dataclass(task) and name in {f.name for f in dataclasses.fields(task)}


def _cast(tree: Any, dtype: Any) -> Any:
    """Floating leaves of `tree` stored as `dtype`."""
    if tree is None:
        return None
    import jax
    import jax.numpy as jnp

    target = jnp.dtype(dtype)
    return jax.tree_util.tree_map(lambda a: a.astype(target) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def _placement(init: Any, mesh_spec: Any, layout: Any):
    """How the Trainer would place the variables `init` makes: a function that places a variables
    tree (or, with a "params/" prefix, a bare params tree) by logical axes, and the sharding of
    result rows. Parameters without logical names are replicated."""
    import jax
    from flax import traverse_util

    from dew.training import mesh as mesh_lib

    layout = mesh_lib.Layout() if layout is None else layout
    mesh = mesh_spec.build()
    boxed = jax.eval_shape(init)  # shapes and logical names, no FLOPs
    shardings = mesh_lib.tree_shardings(mesh_lib.unbox(boxed), mesh_lib.logical_names(boxed), layout, mesh)
    by_path = traverse_util.flatten_dict(shardings, sep="/")
    replicated = mesh_lib.replicated(mesh)

    def place(tree: Any, prefix: str = "") -> Any:
        flat = traverse_util.flatten_dict(dict(tree), sep="/")
        placed = {name: jax.device_put(value, by_path.get(prefix + name, replicated)) for name, value in flat.items()}
        return traverse_util.unflatten_dict(placed, sep="/")

    return place, mesh_lib.batch_sharding(mesh, 1)


def _default_mesh(mesh: Any) -> Any:
    """`mesh`, or data parallelism over every device of the process pool when there are several."""
    import jax

    from dew.training.mesh import MeshSpec

    if mesh is None and jax.device_count() > 1:
        return MeshSpec()
    return mesh


def _place_state(objective: Any, state: Any, mesh_spec: Any, layout: Any):
    """`state`'s weights placed as the Trainer places them, and the sharding of result rows."""
    import jax

    place, rows = _placement(lambda: objective.init(jax.random.key(0), None), mesh_spec, layout)
    ema = None if state.ema is None else place(state.ema, "params/")
    return state.replace(variables=place(state.variables), ema=ema), rows


# --- published checkpoints ------------------------------------------------------------------------


def _from_published(directory: Path, *, step, mesh, layout, dtype, param_dtype):
    import jax
    import jax.numpy as jnp

    from dew.interop import Pretrained

    if step is not None:
        raise ValueError(f"step={step!r} picks one of a saved run's checkpoints; {directory} is a published checkpoint.")
    options: dict[str, Any] = {}
    if dtype is not None:
        options["dtype"] = jnp.dtype(dtype)
    if param_dtype == "auto":
        options["param_dtype"] = "auto"
    elif param_dtype is not None:
        options["param_dtype"] = jnp.dtype(param_dtype)
    bundle = Pretrained.load(directory, **options)
    task = bundle.text_generation()
    mesh = _default_mesh(mesh)
    if mesh is None:
        return task
    model = bundle.model
    place, rows = _placement(lambda: model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)), mesh, layout)
    return dataclasses.replace(task, variables=place(bundle.variables), row_sharding=rows)


# --- diffusers pipelines --------------------------------------------------------------------------


def _from_diffusers(directory: Path, *, step, mesh, dtype, param_dtype):
    """The TextToImage a diffusers pipeline directory serves (`dew.interop.diffusion_pipelines`)."""
    import jax.numpy as jnp

    from dew.interop.diffusion_pipelines import DiffusionPipeline

    if step is not None:
        raise ValueError(f"step={step!r} picks one of a saved run's checkpoints; {directory} is a diffusers pipeline.")
    if mesh is not None:
        raise NotImplementedError(
            f"{directory} is a diffusers pipeline; placing its weights on a mesh is not supported yet (leave mesh= unset)."
        )
    if param_dtype == "auto":
        raise ValueError("param_dtype='auto' keeps a checkpoint's stored dtypes; for a diffusers pipeline pass a dtype.")
    options = {name: jnp.dtype(value) for name, value in (("dtype", dtype), ("param_dtype", param_dtype)) if value is not None}
    return DiffusionPipeline.load(directory, **options).text_to_image()
