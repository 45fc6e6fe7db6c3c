"""Process: a schedule, a prediction transform and a loss weighting, as one object.

Training draws ``(x_t, t, target, weight)`` from it; sampling asks it for a sigma grid, for x_T and
for a denoiser in sigma space.

The backbone call convention, used by `Process.denoiser` (and by training code through
`Process.model_input`)::

    output = model.apply(variables, x_in, noise_input, conditions)

- ``x_in``: the noisy input as the transform wants it (x_t, or c_in * x for EDM), shaped like x;
- ``noise_input``: float32 [B], the schedule time t in [0, 1] for eps/x0/v/flow prediction and
  c_noise = ln(sigma) / 4 for `KarrasPreconditioning`;
- ``conditions``: a dict of condition arrays, or None for an unconditional model. A key missing
  from the dict means that condition is dropped (its null embedding): classifier-free guidance's
  unconditional branch passes ``{}``, and condition dropout in training should do the same.

``output`` has x's shape; the transform turns it into the denoised x0.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from dew.diffusion.transforms import EpsilonPrediction, Transform, _expand
from dew.diffusion.weighting import ScheduleWeighting


class Example(NamedTuple):
    """One noised training batch: the loss is ``weight * mean((output - target)^2)`` per example."""

    x_t: jax.Array      # alpha(t) x0 + sigma(t) eps, in the schedule's own space
    t: jax.Array        # [B] schedule times
    target: jax.Array   # what the backbone output regresses on
    weight: jax.Array   # [B] weight on the squared error of the output


@dataclasses.dataclass(frozen=True)
class UniformTimes:
    """Training times t ~ U(t_min, t_max)."""

    t_min: float = 1e-5
    t_max: float = 1.0

    def __call__(self, key, batch, schedule):
        return jax.random.uniform(key, (batch,), minval=self.t_min, maxval=self.t_max)


@dataclasses.dataclass(frozen=True)
class LogNormalSigmas:
    """EDM's training distribution (Karras et al. 2022): ln sigma ~ N(mean, std^2), mapped to t."""

    mean: float = -1.2
    std: float = 1.2

    def __call__(self, key, batch, schedule):
        sigma = jnp.exp(self.mean + self.std * jax.random.normal(key, (batch,)))
        return schedule.time(sigma)


@dataclasses.dataclass(frozen=True)
class LogitNormalTimes:
    """t = sigmoid(z), z ~ N(mean, std^2): the rectified-flow sampling of Esser et al. (2024)."""

    mean: float = 0.0
    std: float = 1.0

    def __call__(self, key, batch, schedule):
        return jax.nn.sigmoid(self.mean + self.std * jax.random.normal(key, (batch,)))


@dataclasses.dataclass(frozen=True)
class Process:
    """A diffusion process. ``grid`` (steps -> descending sigma-space levels ending in 0) replaces
    the schedule's own sampling grid; training and sampling may thus use different schedules."""

    schedule: Any
    transform: Transform = EpsilonPrediction()
    weighting: Any = ScheduleWeighting()
    train_times: Callable = UniformTimes()
    grid: Callable[[int], jax.Array] | None = None

    def __post_init__(self):
        self.transform.check(self.schedule)

    # ------------------------------------------------------------ sampling side

    def sigmas(self, steps: int) -> jax.Array:
        """The sampling grid for ``steps`` steps: ``steps + 1`` sigma-space levels ending in 0."""
        grid = self.grid if self.grid is not None else self.schedule.grid
        return grid(steps)

    @property
    def sigma_max(self) -> float:
        """The grid's first noise level (the same for every step count)."""
        with jax.ensure_compile_time_eval():  # a constant of the schedule, also inside a jit
            return float(self.sigmas(1)[0])

    def noise(self, key, shape, dtype=jnp.float32, *, steps: int | None = None) -> jax.Array:
        """x_T in sigma space: ``sigma_max * eps``, what `dew.sample` starts from. ``steps`` is not
        read (the first level is the same for every step count); a published scheduler's process
        (`dew.interop.schedulers`) starts where its grid for that many steps does."""
        return (self.sigma_max * jax.random.normal(key, shape)).astype(dtype)

    def final(self, x, sigmas) -> jax.Array:
        """The sample at the grid's last level as this process returns it: sigma space, x itself (a
        published scheduler's process rescales to its own space there)."""
        return x

    def denoiser(self, model, variables, conditions=None) -> "Denoiser":
        """``denoise(x, sigma, conditions=None) -> x0_hat`` in sigma space over ``model``."""
        return Denoiser(model, self, variables, conditions)

    # ------------------------------------------------------------ training side

    def add_noise(self, key, x0, t) -> Example:
        """Noise x0 to times t ([B] or scalar) and give the transform's target and weight."""
        t = jnp.broadcast_to(jnp.asarray(t, jnp.float32), x0.shape[:1])
        eps = jax.random.normal(key, x0.shape, x0.dtype)
        s = self.schedule
        x_t = _expand(s.alpha(t), x0) * x0 + _expand(s.sigma(t), x0) * eps
        target = self.transform.target(x0, eps, t, s)
        return Example(x_t, t, target, self.target_weight(t))

    def training_example(self, key, x0) -> Example:
        """Draw t from ``train_times`` and noise x0 there."""
        time_key, noise_key = jax.random.split(key)
        t = self.train_times(time_key, x0.shape[0], self.schedule)
        return self.add_noise(noise_key, x0, t)

    def target_weight(self, t):
        """The weight on the output's squared error: ``lambda(t) * x0_scale(t)^2``."""
        if isinstance(self.weighting, ScheduleWeighting):
            return jnp.ones_like(jnp.asarray(t, jnp.float32))
        scale = self.transform.x0_scale(t, self.schedule)
        return self.weighting(t, self.schedule, self.transform) * scale**2

    def model_input(self, x_t, t):
        """(x_in, noise_input) for the backbone call convention above."""
        return self.transform.model_input(x_t, t, self.schedule)

    def denoised(self, output, x_t, t):
        return self.transform.denoised(output, x_t, t, self.schedule)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Denoiser:
    """A backbone with its variables, seen as a sigma-space denoiser D(x, sigma) -> x0_hat.

    ``x`` is in sigma space (x0 + sigma eps); for a VP or flow schedule the denoiser scales it to
    the schedule's own space, x_t = alpha(t) x with t = schedule.time(sigma), before calling the
    backbone. ``conditions`` given at call time replace the bound ones. A pytree (variables and
    conditions are leaves), so `dew.sample` can jit over it without baking weights in.
    """

    model: Any
    process: Process
    variables: Any
    conditions: Any = None

    def __call__(self, x, sigma, conditions=None):
        conditions = self.conditions if conditions is None else conditions
        schedule = self.process.schedule
        sigma = jnp.broadcast_to(jnp.asarray(sigma, jnp.float32), x.shape[:1])
        t = schedule.time(sigma)
        x_t = _expand(schedule.alpha(t), x) * x
        x_in, noise_input = self.process.model_input(x_t, t)
        output = self.model.apply(self.variables, x_in, noise_input, conditions)
        return self.process.denoised(output, x_t, t).astype(x.dtype)

    def tree_flatten(self):
        return (self.variables, self.conditions), (self.model, self.process)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(aux[0], aux[1], *children)
