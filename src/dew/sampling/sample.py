"""sample(): run a solver over a sigma grid from x_T to x0."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dew.checks import count


@functools.partial(jax.jit, static_argnames=("solver",))
def _integrate(solver, denoise, guidance, x, sigmas, key):
    if guidance is not None:
        denoise = guidance.bind(denoise, sigmas)
    return solver.integrate(denoise, x, sigmas, key)


def _grid(denoise, steps, grid, process):
    steps = count(steps, "steps")
    if grid is not None and process is not None:
        raise ValueError("pass grid= or process=, not both")
    if grid is None:
        process = process if process is not None else getattr(denoise, "process", None)
        if process is None:
            raise ValueError("sample needs a sigma grid: pass grid= (an array of steps + 1 levels or a "
                             "function of steps), process=, or a denoiser from Process.denoiser")
        return process.sigmas(steps)
    sigmas = grid(steps) if callable(grid) else jnp.asarray(grid)
    if not jnp.issubdtype(sigmas.dtype, jnp.floating):
        sigmas = sigmas.astype(jnp.float32)
    if sigmas.ndim != 1 or sigmas.shape[0] != steps + 1:
        raise ValueError(f"a grid for {steps} steps has {steps + 1} noise levels, got shape "
                         f"{tuple(sigmas.shape)}")
    return sigmas


def sample(denoise, x_T, *, solver, steps, key=None, guidance=None, grid=None, process=None):
    """Integrate from x_T (in sigma space, at the grid's first level) down the grid with ``solver``.

    ``denoise(x, sigma, conditions=None) -> x0_hat`` is a sigma-space denoiser (`Process.denoiser`
    gives one for a backbone; its process supplies the grid). ``grid`` is an explicit array of
    ``steps + 1`` descending levels or a function of steps; ``process`` takes the grid from a
    Process. ``guidance`` (e.g. `CFG`) wraps the denoiser; None turns guidance off. ``key`` feeds
    stochastic solvers, which raise without one (there is no default key); deterministic solvers
    need none. The run is jitted, with the weights as arguments.

    Raises FloatingPointError naming the first step whose result held NaN or Inf (checked after the
    scan; skipped when sample itself is traced inside a caller's jit).
    """
    sigmas = _grid(denoise, steps, grid, process)
    if not isinstance(denoise, jax.tree_util.Partial) and not _is_pytree_denoiser(denoise):
        denoise = jax.tree_util.Partial(denoise)
    x, bad = _integrate(solver, denoise, guidance, x_T, sigmas, key)
    if not isinstance(bad, jax.core.Tracer):
        bad = int(bad)
        if bad >= 0:
            levels = np.asarray(sigmas)
            raise FloatingPointError(
                f"sample: step {bad + 1} of {steps} (sigma {levels[bad]:.4g} -> {levels[bad + 1]:.4g}) "
                f"produced NaN or Inf with {solver!r}; check the denoiser at that noise level")
    return x


def _is_pytree_denoiser(denoise):
    """A denoiser that is itself a pytree (`Process.denoiser`'s, a source scheduler's) is passed to the
    jit as one, so its weights are arguments rather than constants."""
    return not jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(denoise))
