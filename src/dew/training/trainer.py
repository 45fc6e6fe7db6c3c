"""The Trainer: one jitted, pure training step and the loop around it.

The step `(state, batch) -> (state, metrics)` differentiates the objective's loss, applies the
Optax update, folds in changed non-param collections and the EMA, and donates the old state. The
loop feeds batches from the dataset's factory, pulls each step's metrics to the host one step late
(so the host never waits on the step it just dispatched; on a CPU it dispatches each step once the
last one is done), and writes checkpoints, evaluations and progress at their intervals.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dew.data.dataset import Dataset, Partition
from dew.eval.evaluation import Evaluation, EvaluationResult
from dew.nn.expert_parallel import exchanging
from dew.nn.gpipe import staging
from dew.nn.sequence_parallel import splitting
from dew.objectives.base import Aux, Objective, Step
from dew.training import mesh as mesh_lib
from dew.training import positions
from dew.training.checkpoints import CheckpointCorrupted, Checkpoints, CheckpointSaveFailed
from dew.training.mesh import Layout, MeshSpec
from dew.training.progress import ProgressReport
from dew.training.state import TrainState
from dew.telemetry.profile import Profiler, ProfileWindow, running_capture
from dew.tracking.base import Trackers
from dew.tracking.records import (
    CheckpointRejected,
    CheckpointSaved,
    Failure,
    ProfileCaptured,
    Progress,
    RunStarted,
)


class Trainer:
    """Train an objective with an Optax optimizer on a device mesh.

    `key` is the run's root key: initialization and every step draw from it, step `s` from
    `fold_in(step_root, s)`, so a resumed run draws what an uninterrupted run draws.
    `accumulation` splits each global batch into that many microbatches whose gradients are
    averaged before one update. `rollout(variables, batch, key) -> batch` (online RL) turns each
    batch of prompts into a training batch sampled from the current weights before the step.
    `profile=ProfileWindow(directory, steps=, warmup=)` traces that window of each fit into a new
    capture and reports it to the tracker as a `ProfileCaptured` record. `devices` are the devices
    the mesh spans (all of them by default).
    """

    def __init__(
        self,
        objective: Objective,
        optimizer: optax.GradientTransformation,
        *,
        key: jax.Array,
        mesh: MeshSpec = MeshSpec(),
        layout: Layout = Layout(),
        accumulation: int = 1,
        checkpoints: Checkpoints | None = None,
        tracker: Any = None,
        rollout: Any = None,
        profile: ProfileWindow | None = None,
        devices: Sequence[jax.Device] | None = None,
    ):
        if not (callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))):
            raise TypeError(
                f"optimizer must be an Optax GradientTransformation (with init and update); "
                f"got {type(optimizer).__name__}."
            )
        if not isinstance(accumulation, int) or accumulation < 1:
            raise ValueError(f"accumulation must be a positive int; got {accumulation!r}.")
        if rollout is not None and not callable(rollout):
            raise TypeError(
                "rollout must be callable as rollout(variables, batch, key) -> batch "
                f"(e.g. dew.objectives.rl.SampledRollout); got {type(rollout).__name__}."
            )
        if profile is not None and not isinstance(profile, ProfileWindow):
            raise TypeError(
                f"profile must be a dew.ProfileWindow(directory, steps=, warmup=); got {type(profile).__name__}."
            )
        if checkpoints is not None and not isinstance(checkpoints, Checkpoints):
            raise TypeError(f"checkpoints must be a dew.Checkpoints; got {type(checkpoints).__name__}.")
        self.objective = objective
        self.optimizer = optimizer
        self.key = _as_key(key)
        self.mesh_spec = mesh
        self.layout = layout
        self.mesh = mesh.build(devices)
        self.accumulation = accumulation
        self.checkpoints = checkpoints
        self.tracker = tracker
        # Every report goes through Trackers, which keeps a failing backend from stopping the run.
        self._reports = tracker if tracker is None or isinstance(tracker, Trackers) else Trackers(tracker)
        self.rollout = rollout
        self.profile = profile
        self.history: list[dict[str, float]] = []
        self.evaluations: list[EvaluationResult] = []
        self._shardings: TrainState | None = None
        self._abstract: TrainState | None = None
        self._step_fn = None
        self._init_fn = None
        self._batch_shardings: dict[tuple[int, bool], Any] = {}
        self._metric_names: tuple[str, ...] = ()
        self._evaluation: Evaluation | None = None

    # ----------------------------------------------------------------------------------------
    # State: its shapes, its shardings, and how it starts.

    def _held_variables(self):
        return getattr(self.objective, "variables", None)

    def _init_variables(self, key, held):
        variables = self.objective.init(jax.random.split(key)[0], held)
        if not isinstance(variables, Mapping) or "params" not in variables:
            got = sorted(variables) if isinstance(variables, Mapping) else type(variables).__name__
            raise ValueError(
                f"{type(self.objective).__name__}.init must return the Flax variables mapping with "
                f"a 'params' collection, like model.init(...) does; got {got}."
            )
        return variables

    def _plan(self) -> tuple[TrainState, TrainState]:
        """The abstract state (shapes and dtypes) and its shardings, computed without any FLOPs."""
        if self._abstract is not None:
            return self._abstract, self._shardings
        held = self._held_variables()
        boxed = jax.eval_shape(self._init_variables, self.key, held)
        names = mesh_lib.logical_names(boxed)
        if held is not None and not any(n is not None for n in jax.tree_util.tree_leaves(names, is_leaf=_is_names)):
            # Held weights (a loaded checkpoint) are plain arrays: take the logical axis names from
            # a fresh init of the same objective, collection by collection where the structure is
            # the same (a held collection init does not make, such as a checkpoint's multi-token
            # prediction layers, keeps no names).
            fresh = mesh_lib.logical_names(jax.eval_shape(self._init_variables, self.key, None))
            structure = functools.partial(jax.tree_util.tree_structure, is_leaf=_is_names)
            names = type(names)({
                collection: fresh[collection]
                if collection in fresh and structure(fresh[collection]) == structure(tree) else tree
                for collection, tree in names.items()
            })
        variables = mesh_lib.unbox(boxed)
        variable_shardings = mesh_lib.tree_shardings(variables, names, self.layout, self.mesh)
        params = variables["params"]
        param_shardings = variable_shardings["params"]
        opt_state = jax.eval_shape(self.optimizer.init, params)
        replicated = mesh_lib.replicated(self.mesh)
        opt_shardings = _optimizer_shardings(self.optimizer, opt_state, param_shardings, replicated)
        keeps_ema = self.objective.ema_decay is not None
        scalar = jax.ShapeDtypeStruct((), jnp.int32)
        abstract = TrainState(
            step=scalar,
            updates=scalar,
            variables=variables,
            opt_state=opt_state,
            ema=_float32(params) if keeps_ema else None,
            key=jax.eval_shape(lambda k: k, self.key),
        )
        shardings = TrainState(
            step=replicated,
            updates=replicated,
            variables=variable_shardings,
            opt_state=opt_shardings,
            ema=param_shardings if keeps_ema else None,
            key=replicated,
        )
        if self.layout.host:  # the parts Layout(host=...) names live in pinned host memory between steps
            mesh_lib.check_host_memory(self.mesh.devices.flat)
            shardings = shardings.replace(**{
                part: mesh_lib.in_memory(getattr(shardings, part), mesh_lib.HOST_MEMORY)
                for part in self.layout.host if getattr(shardings, part) is not None
            })
        self._abstract, self._shardings = abstract, shardings
        return abstract, shardings

    def init_state(self) -> TrainState:
        """A fresh state, created directly in its shardings."""
        if self._init_fn is None:
            self._init_fn = self._compile_init()
        return self._init_fn(self.key, self._held_variables())

    def _compile_init(self):
        _, shardings = self._plan()
        keeps_ema = self.objective.ema_decay is not None

        def init(key, held):
            variables = mesh_lib.unbox(self._init_variables(key, held))
            params = variables["params"]
            return TrainState(
                step=jnp.zeros((), jnp.int32),
                updates=jnp.zeros((), jnp.int32),
                variables=variables,
                opt_state=self.optimizer.init(params),
                ema=_float32(params, cast=True) if keeps_ema else None,
                key=key,
            )

        return jax.jit(init, out_shardings=shardings)

    def _abstract_with_shardings(self) -> TrainState:
        abstract, shardings = self._plan()
        return jax.tree_util.tree_map(
            lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
            abstract,
            shardings,
        )

    def restore_or_init(self) -> tuple[TrainState, Any, int | None]:
        """The newest intact checkpoint (its state, data position and step), or a fresh state.

        A damaged newest step is reported (a warning and a CheckpointRejected record naming the
        step, item, array and digests), set aside as `<step>.damaged` with any other step newer
        than the one restored (so the run can write those steps again), and the newest intact
        step is restored instead. When no step is intact, the CheckpointCorrupted error is raised.
        """
        latest = None if self.checkpoints is None else self.checkpoints.latest()
        if latest is None:
            return self.init_state(), None, None
        abstract = self._saved(self._abstract_with_shardings())
        try:
            state, position = self.checkpoints.restore(abstract, latest)
        except CheckpointCorrupted as damaged:
            if not damaged.intact_steps:
                raise
            step = damaged.intact_steps[-1]
            newer = [s for s in self.checkpoints.steps() if s > step]
            moved = [self.checkpoints.set_aside(s).name for s in newer]
            message = f"{damaged} Resuming from step {step}; set aside: {', '.join(moved)}."
            warnings.warn(message, stacklevel=3)
            self._log(CheckpointRejected(step=damaged.step, message=message, restored_step=step))
            state, position = self.checkpoints.restore(abstract, step)
            return self._with_frozen(state), position, step
        return self._with_frozen(state), position, latest

    def _saved(self, state: TrainState) -> TrainState:
        """The part of a state a checkpoint holds: all but the objective's frozen collections."""
        frozen = self.objective.frozen_collections
        if not frozen:
            return state
        return state.replace(variables={k: v for k, v in state.variables.items() if k not in frozen})

    def _with_frozen(self, restored: TrainState) -> TrainState:
        """A restored state completed with the frozen collections, taken from `init` again."""
        frozen = self.objective.frozen_collections
        if not frozen:
            return restored
        fresh = self.init_state().variables
        return restored.replace(variables={**restored.variables, **{k: fresh[k] for k in frozen}})

    # ----------------------------------------------------------------------------------------
    # The step.

    def _loss(self, params, variables, batch, step):
        loss, aux = self.objective.loss({**variables, "params": params}, batch, step)
        if not isinstance(aux, Aux):
            raise TypeError(
                f"{type(self.objective).__name__}.loss must return (scalar, Aux); "
                f"got a {type(aux).__name__} beside the loss."
            )
        if jnp.ndim(loss) != 0:
            raise ValueError(
                f"{type(self.objective).__name__}.loss must return a scalar; got shape {jnp.shape(loss)}."
            )
        return loss.astype(jnp.float32), aux

    def _gradients(self, state: TrainState, batch, step: Step):
        grad_fn = jax.value_and_grad(self._loss, has_aux=True)
        params = state.variables["params"]
        if self.accumulation == 1:
            (loss, aux), grads = grad_fn(params, state.variables, batch, step)
            return loss, aux, grads

        parts = self.accumulation

        def split(x):
            x = x.reshape((x.shape[0] // parts, parts) + x.shape[1:])
            return jnp.swapaxes(x, 0, 1)

        micro = jax.tree_util.tree_map(split, batch)

        def body(carry, inputs):
            variables, grad_sum, loss_sum, metric_sum = carry
            index, microbatch = inputs
            micro_step = Step(step=step.step, key=jax.random.fold_in(step.key, index))
            (loss, aux), grads = grad_fn(params, variables, microbatch, micro_step)
            variables = {**variables, **aux.variables}
            grad_sum = jax.tree_util.tree_map(jnp.add, grad_sum, grads)
            metric_sum = jax.tree_util.tree_map(jnp.add, metric_sum, aux.metrics)
            return (variables, grad_sum, loss_sum + loss, metric_sum), None

        first = jax.tree_util.tree_map(lambda x: x[0], micro)
        metric_shapes = jax.eval_shape(
            lambda: grad_fn(params, state.variables, first, step)[0][1].metrics
        )
        zeros = lambda tree: jax.tree_util.tree_map(  # noqa: E731
            lambda x: jnp.zeros(x.shape, jnp.result_type(x.dtype, jnp.float32)), tree
        )
        carry = (state.variables, zeros(params), jnp.zeros((), jnp.float32), zeros(metric_shapes))
        (variables, grad_sum, loss_sum, metric_sum), _ = jax.lax.scan(
            body, carry, (jnp.arange(parts), micro)
        )
        scale = 1.0 / parts
        grads = jax.tree_util.tree_map(lambda g, p: (g * scale).astype(p.dtype), grad_sum, params)
        changed = {k: v for k, v in variables.items() if k != "params"}
        aux = Aux(metrics=jax.tree_util.tree_map(lambda m: m * scale, metric_sum), variables=changed)
        return loss_sum * scale, aux, grads

    def _in_memory(self, state: TrainState, kind: str) -> TrainState:
        """`state` with the parts Layout(host=...) names moved to memory `kind` (inside the step)."""
        moved = {}
        for part in self.layout.host:
            tree, shardings = getattr(state, part), getattr(self._shardings, part)
            if tree is not None:
                moved[part] = jax.tree_util.tree_map(
                    lambda x, sharding: jax.device_put(x, sharding.with_memory_kind(kind)), tree, shardings
                )
        return state.replace(**moved) if moved else state

    @contextlib.contextmanager
    def model_layout(self):
        """The layout a model traced inside this block gives its activations on this trainer's mesh:
        token rows over the batch axes, lengths over `sequence` (`dew.nn.sequence_parallel`),
        mixtures' experts over `expert` (`dew.nn.expert_parallel`) and the layer stack as GPipe
        stages over `stage` (`dew.nn.gpipe`). Raises afterwards when the mesh asks for a sequence,
        expert or stage split the model never made, since those devices would only repeat each
        other's work."""
        split = mesh_lib.sequence_split(self.mesh, self.layout)
        stages = self.mesh_spec.stage_split(self.mesh)
        experts = mesh_lib.expert_split(self.mesh)
        with splitting(split) as split_lengths, staging(stages) as staged, exchanging(experts) as mixtures:
            yield
        if experts is not None and not mixtures:
            raise ValueError(
                f"MeshSpec(expert={experts.size}) splits mixture-of-experts layers' experts over {experts.size} "
                f"devices, but {type(self.objective).__name__}'s model has no mixture layers (dew.nn.moe.Mixture), "
                f"so the expert axis would only split the batch as the data axis does. Use expert=1 and give "
                f"the devices to fsdp= or the data axis."
            )
        if split is not None and split.size > 1 and not split_lengths:
            raise ValueError(
                f"MeshSpec(sequence={split.size}) splits sequences over {split.size} devices, but "
                f"{type(self.objective).__name__}'s model splits none (decoders such as CausalTransformer "
                f"do), so those devices would repeat each other's work. Use sequence=1 and give the "
                f"devices to fsdp= or the data axis."
            )
        if stages is not None and not staged.stacks:
            raise ValueError(
                f"MeshSpec(stage={stages.stages}) runs a model's layer stack as pipeline stages, but "
                f"{type(self.objective).__name__}'s model ran no stack as stages (CausalTransformer with "
                f"scan_layers=True does), so the stage devices would only repeat each other's work. Use stage=1."
            )

    def _train_step(self, state: TrainState, batch):
        state = self._in_memory(state, "device")
        step_root = jax.random.split(state.key)[1]
        step = Step(step=state.step, key=jax.random.fold_in(step_root, state.step))
        with self.model_layout():  # traced as the mesh lays activations out (rows, lengths, stages)
            loss, aux, grads = self._gradients(state, batch, step)
        params = state.variables["params"]
        updates, opt_state = self.optimizer.update(grads, state.opt_state, params)
        params = optax.apply_updates(params, updates)
        variables = {**state.variables, **aux.variables, "params": params}
        variables = self.objective.after_update(variables, step)
        ema = state.ema
        if ema is not None:
            decay = jnp.asarray(self.objective.ema_decay, jnp.float32)
            ema = jax.tree_util.tree_map(
                lambda e, p: decay * e + (1.0 - decay) * p.astype(jnp.float32), ema, params
            )
        grad_norm = optax.tree.norm(grads)
        metrics = {"loss": loss, **aux.metrics, "grad_norm": grad_norm}
        for name, value in metrics.items():
            if jnp.ndim(value) != 0:
                raise ValueError(
                    f"Aux metric {name!r} has shape {jnp.shape(value)}; logged metrics must be scalars."
                )
        metrics["finite"] = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        # One float32 vector, so the host fetches every metric in a single transfer.
        self._metric_names = tuple(metrics)
        metrics = jnp.stack([jnp.asarray(v, jnp.float32) for v in metrics.values()])
        new_state = state.replace(
            step=state.step + 1,
            updates=state.updates + 1,
            variables=variables,
            opt_state=opt_state,
            ema=ema,
        )
        return self._in_memory(new_state, mesh_lib.HOST_MEMORY), metrics

    def compiled_step(self):
        """The jitted step, with donated state and explicit shardings."""
        if self._step_fn is None:
            _, shardings = self._plan()
            self._step_fn = jax.jit(
                self._train_step,
                in_shardings=(shardings, None),
                out_shardings=(shardings, mesh_lib.replicated(self.mesh)),
                donate_argnums=(0,),
            )
        return self._step_fn

    def lower(self, batch: Mapping[str, Any]):
        """The step lowered for this trainer's state and a batch of these shapes, allocating nothing.

        `batch` maps each field to an array or a `jax.ShapeDtypeStruct` of the global batch; the
        result's `.compile()` gives XLA's memory analysis and HLO (what `dew.training.plan` reads).
        """
        shapes = {
            name: jax.ShapeDtypeStruct(np.shape(value), value.dtype, sharding=self._batch_sharding(np.shape(value)))
            for name, value in batch.items()
        }
        return self.compiled_step().lower(self._abstract_with_shardings(), shapes)

    # ----------------------------------------------------------------------------------------
    # Batches.

    def place(self, batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
        """Put this process's rows of a global batch on the mesh, split along the batch axes.

        Text columns (captions before tokenization) stay on the host and are left out.
        """
        batch = {k: v for k, v in batch.items() if np.asarray(v).dtype.kind not in "OUS"}
        if jax.process_count() == 1:
            shardings = {k: self._batch_sharding(np.shape(v)) for k, v in batch.items()}
            return jax.device_put(dict(batch), shardings)
        placed = {}
        processes = jax.process_count()
        for name, value in batch.items():
            value = np.asarray(value)
            sharding = mesh_lib.batch_sharding(self.mesh, max(value.ndim, 1))
            global_shape = (value.shape[0] * processes,) + value.shape[1:]
            placed[name] = jax.make_array_from_process_local_data(sharding, value, global_shape)
        return placed

    def _batch_sharding(self, shape: tuple[int, ...]):
        """Split rows over the batch axes; a batch too small to split is replicated instead."""
        splits = bool(shape) and shape[0] % mesh_lib.batch_divisor(self.mesh) == 0
        key = (len(shape), splits)
        cached = self._batch_shardings.get(key)
        if cached is None:
            cached = (
                mesh_lib.batch_sharding(self.mesh, len(shape))
                if splits
                else mesh_lib.replicated(self.mesh)
            )
            self._batch_shardings[key] = cached
        return cached

    def _check_batch(self, batch, dataset: Dataset) -> None:
        if not isinstance(batch, Mapping):
            raise TypeError(f"Training batches must be dicts of arrays; got {type(batch).__name__}.")
        self.objective.check(batch)
        rows = {name: np.shape(value)[0] if np.ndim(value) else None for name, value in batch.items()}
        if len(set(rows.values())) != 1 or None in rows.values():
            raise ValueError(f"Every field of a batch needs the same number of rows; got {rows}.")
        global_rows = next(iter(rows.values())) * jax.process_count()
        devices = mesh_lib.batch_divisor(self.mesh)
        if global_rows % devices:
            message = (
                f"The global batch has {global_rows} rows, which do not split over the mesh's "
                f"{devices} batch-parallel devices. Use a batch that is a multiple of {devices}"
            )
            if jax.process_count() > 1:
                raise ValueError(message + ".")
            warnings.warn(message + "; until then every device computes the whole batch.", stacklevel=3)
        if global_rows % self.accumulation:
            raise ValueError(
                f"The global batch has {global_rows} rows, which do not split into "
                f"{self.accumulation} microbatches. Use a batch that is a multiple of {self.accumulation}."
            )

    # ----------------------------------------------------------------------------------------
    # The loop.

    def fit(
        self,
        dataset: Dataset,
        *,
        steps: int,
        log_every: int = 100,
        eval_every: int | None = None,
        checkpoint_every: int | None = None,
        metrics: Sequence[Any] = (),
        preview: bool = False,
    ) -> TrainState:
        """Train until `state.step == steps` (an absolute target), resuming from checkpoints."""
        if not isinstance(dataset, Dataset):
            raise TypeError(f"fit takes a dew.Dataset; got {type(dataset).__name__}.")
        _check_interval("steps", steps, allow_zero=True)
        _check_interval("log_every", log_every)
        for name, value in (("eval_every", eval_every), ("checkpoint_every", checkpoint_every)):
            if value is not None:
                _check_interval(name, value)
        if checkpoint_every is not None and self.checkpoints is None:
            raise ValueError(
                "checkpoint_every needs somewhere to write: pass "
                "Trainer(..., checkpoints=Checkpoints(directory))."
            )
        if eval_every is not None and dataset.val is None:
            raise ValueError("eval_every needs validation data, but this Dataset has val=None.")

        return self._fit(dataset, steps, log_every, eval_every, checkpoint_every, metrics, preview)

    def _fit(self, dataset, steps, log_every, eval_every, checkpoint_every, metrics, preview):
        self._plan()
        state, position, last_checkpoint = self.restore_or_init()
        start = int(state.step)
        if steps < start:
            raise ValueError(
                f"fit(steps={steps}) is below the restored step {start} "
                f"(in {self.checkpoints.directory}). steps is the absolute target: pass steps >= {start}."
            )
        if self.profile is not None and steps > start:
            self.profile.check_fits(start, steps)
            if running_capture() is not None:
                raise RuntimeError(
                    "This Trainer traces a ProfileWindow, but a dew.Profiler capture is already "
                    "running around fit. Use the window or the outer Profiler, not both."
                )
        self._log(RunStarted(config=self._config(dataset), start_step=start, target_step=steps))
        if steps == start:
            return state

        iterator = dataset.train(Partition.current())
        resumable = callable(getattr(iterator, "get_state", None)) and callable(
            getattr(iterator, "set_state", None)
        )
        if checkpoint_every is not None and not resumable:
            raise ValueError(
                f"checkpoint_every needs an iterator that reports its position (get_state and "
                f"set_state, as Grain's are), but dataset.train returned a "
                f"{type(iterator).__name__}. Wrap the data in a Grain dataset (e.g. "
                f"grain.MapDataset.source(...).to_iter_dataset()) or drop checkpoint_every."
            )
        if position is not None:
            if not resumable:
                raise ValueError(
                    "The checkpoint records a data position, but this dataset's iterator cannot "
                    "restore one (it has no set_state)."
                )
            iterator.set_state(position)
        if checkpoint_every is not None:
            # A position a checkpoint cannot store fails here, before any step is trained.
            source = f"the {type(iterator).__name__} that dataset.train returned"
            positions.encode(iterator.get_state(), source=source)

        step_fn = self.compiled_step()
        on_cpu = all(device.platform == "cpu" for device in self.mesh.devices.flat)
        progress = ProgressReport(start, steps)
        window: list[dict[str, float]] = []
        pending: tuple[int, Any] | None = None
        profiler: Profiler | None = None

        def drain() -> None:
            """Host-side work for the step in flight: fetch, record and check its metrics."""
            nonlocal pending
            if pending is not None:
                window.append(self._collect(pending, last_checkpoint))
                progress.advance(pending[0])
                pending = None

        try:
            for step in range(start + 1, steps + 1):
                try:
                    batch = next(iterator)
                except StopIteration:
                    raise ValueError(
                        f"The training iterator ran out after {step - 1 - start} batches; training "
                        "iterators must repeat (e.g. grain's .repeat()) to reach the target step."
                    ) from None
                if self.rollout is not None:
                    # On-policy data: the rollout samples with the current weights (this syncs).
                    rollout_key = jax.random.fold_in(jax.random.fold_in(self.key, 0x0B5E), step)
                    batch = self.rollout(state.variables, batch, rollout_key)
                if step == start + 1:
                    self._check_batch(batch, dataset)
                saving = checkpoint_every is not None and (step % checkpoint_every == 0 or step == steps)
                if saving:
                    position = iterator.get_state()  # after this step's batch, before the next
                placed = self.place(batch)
                if self.profile is not None and step == self.profile.first_step(start):
                    profiler = self._start_profile(step_fn, state, placed)
                if on_cpu:
                    # XLA:CPU runs a step dispatched before its inputs are ready with about twice
                    # the CPU time (a large model's step took 2x as long): dispatch once the last
                    # step is done. The batch above was still read and placed while it ran.
                    jax.block_until_ready(state)
                if profiler is not None:
                    with jax.profiler.StepTraceAnnotation("train", step_num=step):
                        state, step_metrics = step_fn(state, placed)
                else:
                    state, step_metrics = step_fn(state, placed)
                drain()  # the previous step's metrics: one step late, so the device stays busy
                pending = (step, step_metrics)
                if profiler is not None and step == self.profile.last_step(start):
                    self._finish_profile(profiler, start)
                    profiler = None

                if saving:
                    drain()  # never save a state whose loss is not finite
                    with self._stopping_on_save_failure():
                        self.checkpoints.save(self._saved(state), position)
                    last_checkpoint = step
                    self._log(CheckpointSaved(step=step, directory=str(self.checkpoints.directory)))
                if step % log_every == 0 or step == steps:
                    drain()
                    self._report(progress, step, steps, window)
                    window = []
                if eval_every is not None and (step % eval_every == 0 or step == steps):
                    self._evaluate(state, dataset, step, metrics, preview, progress)
            if checkpoint_every is not None:
                with self._stopping_on_save_failure():
                    self.checkpoints.wait()  # fit returns with its last checkpoint on disk
        finally:
            if profiler is not None:  # the run stopped inside the window: end the trace
                profiler.stop(steps={"first": self.profile.first_step(start), "stopped_early": True})
            progress.close()
        return state

    def _start_profile(self, step_fn, state: TrainState, placed) -> Profiler:
        """Open the window's capture once the device is idle (so no earlier step leaks into it),
        keeping the compiled step's HLO in it (from the compilation cache: no recompile)."""
        hlo = step_fn.lower(state, placed).compile().as_text()
        jax.block_until_ready(state)
        profiler = Profiler(self.profile.directory, self.profile.options)
        profiler.start()
        profiler.add_hlo("train_step", hlo)
        return profiler

    def _finish_profile(self, profiler: Profiler, start: int) -> None:
        """Close the window's capture (stop waits for the device) and report it."""
        first, last = self.profile.first_step(start), self.profile.last_step(start)
        capture = profiler.stop(steps={"first": first, "last": last})
        self._log(
            ProfileCaptured(directory=str(capture), first_step=first, last_step=last, manifest=profiler.manifest)
        )

    @contextlib.contextmanager
    def _stopping_on_save_failure(self):
        """Record a failed checkpoint write with the tracker before the error stops the run."""
        try:
            yield
        except CheckpointSaveFailed as failed:
            self._log(Failure(step=failed.step, message=str(failed), last_checkpoint=failed.newest_complete))
            raise

    def _collect(self, pending, last_checkpoint) -> dict[str, float]:
        """Bring one step's metrics to the host, record them, and stop on a non-finite loss."""
        step, device_metrics = pending
        values = dict(zip(self._metric_names, np.asarray(device_metrics).tolist()))
        finite = bool(values.pop("finite"))
        values["step"] = step
        self.history.append(values)
        if not finite:
            where = (
                f"the last checkpoint is step {last_checkpoint} in {self.checkpoints.directory}"
                if last_checkpoint is not None and self.checkpoints is not None
                else "no checkpoint was written"
            )
            message = (
                f"The loss became non-finite at step {step} (loss {values['loss']}, gradient norm "
                f"{values['grad_norm']}); {where}. Nothing from step {step} on was saved. Lower the "
                "learning rate, check the data for NaN/Inf, or use float32 compute."
            )
            self._log(Failure(step=step, message=message, last_checkpoint=last_checkpoint))
            raise FloatingPointError(message)
        return values

    def _report(self, progress: ProgressReport, step: int, target: int, window) -> None:
        scalars: dict[str, float] = {}
        for row in window:
            for name, value in row.items():
                if name != "step":
                    scalars[name] = scalars.get(name, 0.0) + value / len(window)
        progress.report(step, scalars)
        self._log({f"train/{k}": v for k, v in scalars.items()}, step=step)
        self._log(
            Progress(
                step=step,
                target_step=target,
                steps_per_second=progress.rate(step),
                eta_seconds=progress.eta(step) if progress.eta(step) != math.inf else -1.0,
            )
        )

    def _evaluate(self, state, dataset, step, metrics, preview, progress) -> EvaluationResult:
        if self._evaluation is None:
            self._evaluation = Evaluation(self.objective)
        variables = state.averaged if state.ema is not None else state.variables
        result = self._evaluation.score(
            variables,
            dataset.val,
            metrics=metrics,
            key=jax.random.fold_in(self.key, 0x5EED),
            step=step,
            preview=preview,
            place=self.place,
        )
        self.evaluations.append(result)
        if result.scores:
            progress.message(f"step {step} eval " + " ".join(f"{k} {v:.4g}" for k, v in result.scores.items()))
            self._log(result.scalars, step=step)
        if self._reports is not None:
            for artifact in result.previews:
                self._reports.artifact(artifact, step=step)
        return result

    def _log(self, data, step=None) -> None:
        if self._reports is not None:
            self._reports.log(data, step=step)

    def _config(self, dataset: Dataset) -> dict[str, Any]:
        return {
            "objective": f"{type(self.objective).__module__}.{type(self.objective).__qualname__}",
            "mesh": dict(self.mesh.shape),
            "accumulation": self.accumulation,
            "batch": dataset.batch,
            "records": dataset.records,
            "ema_decay": self.objective.ema_decay,
        }


def _as_key(key: Any) -> jax.Array:
    if isinstance(key, int):
        return jax.random.key(key)
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key
    if key.dtype == jnp.uint32 and key.shape == (2,):
        return jax.random.wrap_key_data(key)
    raise TypeError(f"key must be a jax.random.key(...) (or an int seed); got {key.dtype}{key.shape}.")


def _is_names(x) -> bool:
    return x is None or isinstance(x, tuple)


def _float32(tree, cast: bool = False):
    """The EMA copy's leaves: float32 whatever the parameters' storage dtype."""
    if cast:
        return jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), tree)
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), tree)


def _optimizer_shardings(optimizer, opt_state, param_shardings, replicated):
    """Shard optimizer leaves that mirror parameters like those parameters; replicate the rest."""
    try:
        return optax.tree_map_params(
            optimizer,
            lambda _, sharding: sharding,
            opt_state,
            param_shardings,
            transform_non_params=lambda _: replicated,
        )
    except Exception:  # an optimizer optax cannot map: keep its state replicated
        return jax.tree_util.tree_map(lambda _: replicated, opt_state)


def _check_interval(name: str, value: Any, allow_zero: bool = False) -> None:
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an int >= {low}; got {value!r}.")
