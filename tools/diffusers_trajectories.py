"""Run diffusers' schedulers on a fixed analytic denoiser and save what they produce.

Writes tests/fixtures/diffusion/diffusers_trajectories.npz, read by tests/test_solvers.py.

For each scheduler the file holds, in k-diffusion's sigma space (x = x0 + sigma eps):
``<name>/sigmas`` (the grid the scheduler steps through, ending in its last level),
``<name>/x_T`` (the start), ``<name>/x0`` (the scheduler's final sample) and ``<name>/config``
(the scheduler config as JSON). VP schedulers (DDIM, PNDM, DPMSolverMultistep, UniPC) run on
x_t = alpha x; their results are divided by alpha to land in sigma space.

The "model" is eps-prediction wrapped around the analytic denoiser `denoise` below, which the test
recomputes in JAX. Samples are float64 so the reference is exact to the scheduler's own float32
coefficients.

Run with the reference environment (torch CPU + diffusers), not Dew's:

    python3 -m venv .venv-ref
    .venv-ref/bin/pip install torch==2.13.0
    .venv-ref/bin/pip install diffusers transformers numpy safetensors
    .venv-ref/bin/python tools/diffusers_trajectories.py
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import torch
import diffusers

STEPS = 8
SHAPE = (2, 8)
OUT = pathlib.Path(__file__).resolve().parents[1] / "tests/fixtures/diffusion/diffusers_trajectories.npz"


def denoise(x, sigma):
    """The analytic denoiser (also in tests/test_solvers.py): Gaussian shrinkage plus a tanh term."""
    return 0.3 + (x - 0.3) * 0.25 / (0.25 + sigma**2) + 0.05 * torch.tanh(x) / (1.0 + sigma)


SIGMA_SPACE = {
    "Euler": (diffusers.EulerDiscreteScheduler, {}),
    "Heun": (diffusers.HeunDiscreteScheduler, {}),
    "LMS": (diffusers.LMSDiscreteScheduler, {}),
    "KDPM2": (diffusers.KDPM2DiscreteScheduler, {}),
}
VP_SPACE = {
    "DDIM": (diffusers.DDIMScheduler, {"set_alpha_to_one": True, "clip_sample": False}),
    "PNDM": (diffusers.PNDMScheduler, {"skip_prk_steps": True, "set_alpha_to_one": True}),
    "DPMSolverPP2M": (diffusers.DPMSolverMultistepScheduler,
                      {"algorithm_type": "dpmsolver++", "solver_order": 2}),
    "UniPC": (diffusers.UniPCMultistepScheduler, {}),
}


def run_sigma_space(cls, overrides, z):
    sched = cls(**overrides)
    sched.set_timesteps(STEPS)
    grid = sched.sigmas.double()
    x = z * grid[0]
    x_T = x.clone()
    for t in sched.timesteps:
        sched.scale_model_input(x, t)  # initializes step_index
        if isinstance(sched, diffusers.KDPM2DiscreteScheduler) and not sched.state_in_first_order:
            sigma = sched.sigmas_interpol[sched.step_index].double()
        else:
            sigma = sched.sigmas[sched.step_index].double()
        eps = (x - denoise(x, sigma)) / sigma
        x = sched.step(eps, t, x).prev_sample
    if isinstance(sched, (diffusers.HeunDiscreteScheduler, diffusers.KDPM2DiscreteScheduler)):
        grid = torch.unique_consecutive(grid)  # drop the repeats of the two-stage steps
    return grid, x_T, x, sched


def run_vp_space(cls, overrides, z):
    sched = cls(**overrides)
    sched.set_timesteps(STEPS)
    abar = sched.alphas_cumprod.double()
    level = lambda t: ((1 - abar[t]) / abar[t]).sqrt()  # noqa: E731
    timesteps = [int(t) for t in sched.timesteps]
    unique = list(dict.fromkeys(timesteps))
    grid = torch.stack([level(t) for t in unique] + [torch.zeros((), dtype=torch.float64)])
    x = z * grid[0] * abar[unique[0]].sqrt()
    x_T = x / abar[unique[0]].sqrt()
    for t in sched.timesteps:
        a = abar[int(t)].sqrt()
        sigma = level(int(t))
        x_k = x / a
        eps = (x_k - denoise(x_k, sigma)) / sigma
        x = sched.step(eps, t, x).prev_sample
    return grid, x_T, x, sched  # the last level is 0, where alpha = 1


def main():
    torch.manual_seed(0)
    z = torch.randn(SHAPE, dtype=torch.float64)
    arrays = {"shape": np.array(SHAPE), "steps": np.array(STEPS)}
    for table, runner in ((SIGMA_SPACE, run_sigma_space), (VP_SPACE, run_vp_space)):
        for name, (cls, overrides) in table.items():
            grid, x_T, x0, sched = runner(cls, overrides, z)
            assert grid.shape == (STEPS + 1,), (name, grid.shape)
            config = {"class": cls.__name__, "diffusers": diffusers.__version__, "steps": STEPS,
                      **{k: v for k, v in dict(sched.config).items() if not k.startswith("_")}}
            arrays[f"{name}/sigmas"] = grid.numpy()
            arrays[f"{name}/x_T"] = x_T.numpy()
            arrays[f"{name}/x0"] = x0.numpy()
            arrays[f"{name}/config"] = np.array(json.dumps(config, default=str))
            print(name, grid.numpy().round(4).tolist(), float(x0.abs().mean()))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT, **arrays)
    print(OUT, OUT.stat().st_size, "bytes")


if __name__ == "__main__":
    main()
