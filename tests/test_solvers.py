"""Solvers, sample() and classifier-free guidance.

The toy problem: data x0 ~ N(MU, S^2) elementwise. Its exact denoiser is
E[x0 | x] = MU + S^2 / (S^2 + sigma^2) (x - MU), and the probability-flow ODE carries x from sigma_T
to sigma as x(sigma) - MU = (x_T - MU) sqrt(S^2 + sigma^2) / sqrt(S^2 + sigma_T^2).
"""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.diffusion import karras_sigmas
from dew.sampling import (CFG, DDIM, DDPM, DEIS, KDPM2, LCM, LMS, PNDM, RK4, TCD, DPMSolver,
                          DPMSolverPP2M, DPMSolverPP2S, DPMSolverPPSDE, EDMStochastic, Euler,
                          EulerAncestral, Heun, MultiStepDPM, UniPC, sample)

MU, S = 0.3, 0.5
FIXTURES = pathlib.Path(__file__).parent / "fixtures/diffusion/diffusers_trajectories.npz"


def gaussian_denoiser(x, sigma, conditions=None):
    return MU + S**2 / (S**2 + sigma**2) * (x - MU)


def ode_solution(x_T, sigma_T, sigma):
    return MU + (x_T - MU) * jnp.sqrt(S**2 + sigma**2) / jnp.sqrt(S**2 + sigma_T**2)


# ---------------------------------------------------------------- convergence order

ORDERS = [
    (Euler(), 1), (Heun(), 2), (RK4(), 4), (KDPM2(), 2), (LMS(), 3), (PNDM(), 2),
    (DEIS(), 2), (DPMSolver(order=2), 2), (DPMSolver(order=3), 3), (DPMSolverPP2M(), 2),
    (DPMSolverPP2S(), 2), (DPMSolverPPSDE(eta=0.0), 2), (MultiStepDPM(), 3), (UniPC(), 2),
]
STEP_COUNTS = (10, 20, 40)


@pytest.mark.parametrize("solver,order", ORDERS, ids=lambda o: repr(o))
def test_deterministic_solvers_converge_to_the_exact_ode_solution_at_their_order(solver, order):
    sigma_T, sigma_end = 10.0, 0.05
    with jax.enable_x64(True):
        x_T = sigma_T * jax.random.normal(jax.random.key(0), (8,), jnp.float64)
        errors = []
        for steps in STEP_COUNTS:
            # a Karras grid that stops at sigma_end (no final jump to 0), so the order shows
            grid = jnp.asarray(np.asarray(karras_sigmas(steps + 1, sigma_end, sigma_T))[:-1], jnp.float64)
            x = sample(gaussian_denoiser, x_T, solver=solver, steps=steps, grid=grid)
            errors.append(float(jnp.max(jnp.abs(x - ode_solution(x_T, sigma_T, grid[-1])))))
    slope = -np.polyfit(np.log(STEP_COUNTS), np.log(errors), 1)[0]
    assert errors[0] > errors[1] > errors[2], errors
    assert slope > order - 0.5, f"{solver!r}: errors {errors} fall at order {slope:.2f}, expected {order}"


def test_first_order_solvers_agree():
    grid = karras_sigmas(12, 0.002, 80.0)
    x_T = 80.0 * jax.random.normal(jax.random.key(3), (16,))
    euler = sample(gaussian_denoiser, x_T, solver=Euler(), steps=12, grid=grid)
    for solver in (DDIM(eta=0.0), DPMSolver(order=1)):
        np.testing.assert_allclose(sample(gaussian_denoiser, x_T, solver=solver, steps=12, grid=grid),
                                   euler, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- stochastic solvers


def consistency_function(x, sigma, conditions=None):
    """The exact consistency function of the toy problem: the ODE's map from sigma to 0."""
    return ode_solution(x, sigma, 0.0)


STOCHASTIC = [
    (DDPM(), gaussian_denoiser), (EulerAncestral(), gaussian_denoiser),
    (DDIM(eta=1.0), gaussian_denoiser),
    (EDMStochastic(churn=30.0, s_noise=1.0), gaussian_denoiser),
    (DPMSolverPP2S(eta=1.0), gaussian_denoiser), (DPMSolverPPSDE(), gaussian_denoiser),
    (MultiStepDPM(eta=1.0), gaussian_denoiser), (LCM(), consistency_function),
    (TCD(gamma=1.0), consistency_function),
]


@pytest.mark.parametrize("solver,denoise", STOCHASTIC, ids=lambda o: repr(o) if not callable(o) or hasattr(o, "integrate") else o.__name__)
def test_stochastic_solvers_draw_the_target_distribution(solver, denoise):
    # DDPM-like samplers are first order in distribution (40 steps leave DDPM's std near 0.43),
    # so this uses 200 steps; 8192 draws put the std's own sampling error near 0.004.
    steps = 200
    grid = karras_sigmas(steps, 0.002, 80.0)
    x_T = 80.0 * jax.random.normal(jax.random.key(0), (8192,))
    x = sample(denoise, x_T, solver=solver, steps=steps, grid=grid, key=jax.random.key(1))
    assert abs(float(x.mean()) - MU) < 0.02, float(x.mean())
    assert abs(float(x.std()) - S) < 0.02, float(x.std())
    # a different key gives a different sample
    other = sample(denoise, x_T, solver=solver, steps=steps, grid=grid, key=jax.random.key(2))
    assert float(jnp.max(jnp.abs(other - x))) > 1e-3


@pytest.mark.parametrize("solver", [solver for solver, _ in STOCHASTIC], ids=repr)
def test_stochastic_solvers_refuse_to_run_without_a_key(solver):
    grid = karras_sigmas(4, 0.002, 80.0)
    x_T = jnp.ones((2, 3))
    assert solver.stochastic
    name = type(solver).__name__
    with pytest.raises(ValueError, match=rf"{name}\(.*\) is stochastic.*needs a key.*key=jax.random.key"):
        sample(gaussian_denoiser, x_T, solver=solver, steps=4, grid=grid)
    with pytest.raises(ValueError, match=rf"{name}\(.*\) is stochastic"):
        solver(gaussian_denoiser, x_T, grid)


def test_deterministic_solvers_need_no_key_and_ignore_one():
    grid = karras_sigmas(6, 0.002, 80.0)
    x_T = 80.0 * jax.random.normal(jax.random.key(0), (16,))
    for solver, _ in ORDERS:
        assert not solver.stochastic, solver
        without = sample(gaussian_denoiser, x_T, solver=solver, steps=6, grid=grid)
        with_key = sample(gaussian_denoiser, x_T, solver=solver, steps=6, grid=grid, key=jax.random.key(9))
        np.testing.assert_array_equal(without, with_key)
    # the noise-free settings of stochastic solvers are deterministic too: each is an Euler step
    euler = sample(gaussian_denoiser, x_T, solver=Euler(), steps=6, grid=grid)
    for solver in (DDIM(eta=0.0), EulerAncestral(eta=0.0), TCD(gamma=0.0), EDMStochastic(churn=0.0)):
        assert not solver.stochastic, solver
        got = sample(gaussian_denoiser, x_T, solver=solver, steps=6, grid=grid)
        reference = euler if not isinstance(solver, EDMStochastic) else sample(
            gaussian_denoiser, x_T, solver=Heun(), steps=6, grid=grid)
        np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-5)


def test_tcd_with_gamma_one_is_lcm():
    grid = karras_sigmas(6, 0.002, 80.0)
    x_T = 80.0 * jax.random.normal(jax.random.key(0), (32,))
    key = jax.random.key(5)
    np.testing.assert_allclose(
        sample(consistency_function, x_T, solver=TCD(gamma=1.0), steps=6, grid=grid, key=key),
        sample(consistency_function, x_T, solver=LCM(), steps=6, grid=grid, key=key), rtol=1e-6)


# ---------------------------------------------------------------- diffusers parity


def analytic_denoiser(x, sigma, conditions=None):
    """The same function as tools/diffusers_trajectories.py's `denoise`."""
    return 0.3 + (x - 0.3) * 0.25 / (0.25 + sigma**2) + 0.05 * jnp.tanh(x) / (1.0 + sigma)


PARITY = {"Euler": Euler(), "Heun": Heun(), "LMS": LMS(), "KDPM2": KDPM2(), "DDIM": DDIM(),
          "PNDM": PNDM(), "DPMSolverPP2M": DPMSolverPP2M(), "UniPC": UniPC()}
# a solver that must not match each reference (the negative control)
IMPOSTOR = {"Euler": Heun(), "Heun": KDPM2(), "LMS": PNDM(), "KDPM2": Heun(), "DDIM": Heun(),
            "PNDM": LMS(), "DPMSolverPP2M": UniPC(), "UniPC": DPMSolverPP2M()}


@pytest.mark.parametrize("name", sorted(PARITY))
def test_solvers_match_diffusers_schedulers(name):
    data = np.load(FIXTURES)
    grid = jnp.asarray(data[f"{name}/sigmas"], jnp.float32)
    x_T = jnp.asarray(data[f"{name}/x_T"], jnp.float32)
    reference = data[f"{name}/x0"]
    steps = int(data["steps"])
    x = sample(analytic_denoiser, x_T, solver=PARITY[name], steps=steps, grid=grid)
    np.testing.assert_allclose(x, reference, atol=1e-5, rtol=1e-5)
    # negative controls: another solver, or one level of the grid moved by 5%, does not match
    other = sample(analytic_denoiser, x_T, solver=IMPOSTOR[name], steps=steps, grid=grid)
    assert float(np.max(np.abs(np.asarray(other) - reference))) > 1e-4
    moved = grid.at[steps // 2].multiply(1.05)
    perturbed = sample(analytic_denoiser, x_T, solver=PARITY[name], steps=steps, grid=moved)
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(perturbed, reference, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- classifier-free guidance


def conditional_denoiser(x, sigma, conditions=None):
    """Bound conditions (None) pull toward +1, the null condition ({}) toward -1."""
    target = -1.0 if conditions == {} else 1.0
    return gaussian_denoiser(x, sigma) + 0.2 * target * x / (1.0 + sigma)


def test_cfg_scale_one_is_conditional_and_zero_is_unconditional():
    grid = karras_sigmas(8, 0.002, 80.0)
    x_T = 80.0 * jax.random.normal(jax.random.key(0), (4, 6))

    def run(guidance, denoise=conditional_denoiser):
        return sample(denoise, x_T, solver=Heun(), steps=8, grid=grid, guidance=guidance)

    conditional = run(None)
    unconditional = run(None, lambda x, s, c=None: conditional_denoiser(x, s, {}))
    np.testing.assert_allclose(run(CFG(1.0)), conditional, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(run(CFG(0.0)), unconditional, rtol=1e-5, atol=1e-5)
    guided = run(CFG(3.0))
    assert float(jnp.max(jnp.abs(guided - conditional))) > 1e-2


def test_cfg_rescale_zero_leaves_guidance_unchanged_and_one_matches_the_conditional_std():
    cond = jax.random.normal(jax.random.key(0), (3, 4, 4, 2))
    uncond = 0.5 * jax.random.normal(jax.random.key(1), (3, 4, 4, 2))
    plain = uncond + 7.5 * (cond - uncond)
    np.testing.assert_array_equal(CFG(7.5, rescale=0.0).combine(cond, uncond), plain)
    rescaled = CFG(7.5, rescale=1.0).combine(cond, uncond)
    np.testing.assert_allclose(rescaled.std(axis=(1, 2, 3)), cond.std(axis=(1, 2, 3)), rtol=1e-5)
    half = CFG(7.5, rescale=0.5).combine(cond, uncond)
    np.testing.assert_allclose(half, 0.5 * rescaled + 0.5 * plain, rtol=1e-5, atol=1e-5)


def test_cfg_interval_turns_guidance_off_outside():
    grid = karras_sigmas(10, 0.002, 80.0)
    guidance = CFG(4.0, interval=(0.25, 0.55))
    guided = jax.jit(guidance.bind(conditional_denoiser, grid))
    x = jnp.linspace(-2.0, 2.0, 5)
    for sigma in (80.0, 20.0, 0.01, 0.002):  # positions 0, 0.13, 0.86, 1: outside
        assert float(guidance.position(sigma, grid)) < 0.25 or float(guidance.position(sigma, grid)) > 0.55
        np.testing.assert_allclose(guided(x, sigma), conditional_denoiser(x, sigma), rtol=1e-6, atol=1e-6)
    for sigma in (5.0, 1.0):  # positions ~0.26, ~0.41: inside
        expected = guidance.combine(conditional_denoiser(x, sigma), conditional_denoiser(x, sigma, {}))
        np.testing.assert_allclose(guided(x, sigma), expected, rtol=1e-6, atol=1e-6)
        assert float(jnp.max(jnp.abs(expected - conditional_denoiser(x, sigma)))) > 1e-3


def test_cfg_rejects_bad_settings():
    with pytest.raises(ValueError, match="interval"):
        CFG(2.0, interval=(0.8, 0.2))
    with pytest.raises(ValueError, match="rescale"):
        CFG(2.0, rescale=1.5)


# ---------------------------------------------------------------- errors


def test_nan_in_a_sample_names_the_step():
    grid = karras_sigmas(10, 0.002, 80.0)

    def breaks_below_one(x, sigma, conditions=None):
        return jnp.where(sigma < 1.0, jnp.nan, gaussian_denoiser(x, sigma))

    first_bad = int(np.argmax(np.asarray(grid) < 1.0)) + 1  # 1-based step whose start is below 1
    with pytest.raises(FloatingPointError, match=f"step {first_bad} of 10"):
        sample(breaks_below_one, 80.0 * jnp.ones((2, 3)), solver=Euler(), steps=10, grid=grid)


def test_sample_checks_its_grid():
    x = jnp.ones((2, 2))
    with pytest.raises(ValueError, match="11 noise levels"):
        sample(gaussian_denoiser, x, solver=Euler(), steps=10, grid=karras_sigmas(12, 0.002, 80.0))
    with pytest.raises(ValueError, match="needs a sigma grid"):
        sample(gaussian_denoiser, x, solver=Euler(), steps=10)
    with pytest.raises(ValueError, match="positive integer"):
        sample(gaussian_denoiser, x, solver=Euler(), steps=0, grid=karras_sigmas(1, 0.002, 80.0))
    got = sample(gaussian_denoiser, x, solver=Euler(), steps=4,
                 grid=lambda n: karras_sigmas(n, 0.002, 80.0))
    assert got.shape == x.shape


def test_solver_settings_are_checked():
    grid = karras_sigmas(3, 0.002, 80.0)
    for solver in (DPMSolver(order=4), MultiStepDPM(order=5), DEIS(order=0), UniPC(variant="bh3")):
        with pytest.raises(ValueError, match="order|variant"):
            sample(gaussian_denoiser, jnp.ones((1, 2)), solver=solver, steps=3, grid=grid)
