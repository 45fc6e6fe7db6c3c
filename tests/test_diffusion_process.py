"""Schedules, prediction transforms, weightings, Process and presets."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.diffusion import (EDM, Cosine, CosineSchedule, EpsilonPrediction, ExponentialSchedule,
                           Flow, FlowPrediction, FlowSchedule, Karras, KarrasPreconditioning,
                           KarrasSchedule, LinearSchedule, MinSNRWeighting, P2Weighting, Process,
                           ScheduleWeighting, Sqrt, SqrtSchedule, VPrediction, X0Prediction,
                           as_process)
from dew.sampling import Heun, sample

VP = [LinearSchedule(), CosineSchedule(), SqrtSchedule()]
VE = [KarrasSchedule(), ExponentialSchedule()]
FLOW = [FlowSchedule(), FlowSchedule(shift=3.0)]
TIMES = jnp.linspace(0.02, 0.98, 25)


def test_edm_preconditioning_matches_table_1_at_sigma_half():
    c_in, c_skip, c_out, c_noise = KarrasPreconditioning(sigma_data=0.5).scalings(0.5)
    np.testing.assert_allclose(c_in, 1 / math.sqrt(0.5), rtol=1e-6)
    np.testing.assert_allclose(c_skip, 0.5, rtol=1e-6)
    np.testing.assert_allclose(c_out, 0.5 / math.sqrt(2), rtol=1e-6)
    np.testing.assert_allclose(c_noise, math.log(0.5) / 4, rtol=1e-6)


def test_edm_weight_times_c_out_squared_is_one_at_every_sigma():
    schedule, transform = KarrasSchedule(), KarrasPreconditioning()
    t = jnp.linspace(0.0, 1.0, 50)
    lam = ScheduleWeighting()(t, schedule, transform)
    c_out = transform.scalings(schedule.sigma(t))[2]
    np.testing.assert_allclose(lam * c_out**2, 1.0, rtol=1e-5)
    sigma = schedule.sigma(t)
    np.testing.assert_allclose(lam, (sigma**2 + 0.25) / (sigma * 0.5) ** 2, rtol=1e-5)
    np.testing.assert_allclose(EDM()().target_weight(t), 1.0)


@pytest.mark.parametrize("schedule", VP, ids=lambda s: type(s).__name__)
def test_vp_schedules_preserve_variance(schedule):
    np.testing.assert_allclose(schedule.alpha(TIMES) ** 2 + schedule.sigma(TIMES) ** 2, 1.0, atol=1e-5)


@pytest.mark.parametrize("schedule", VP + VE + FLOW, ids=lambda s: type(s).__name__)
def test_noise_level_and_time_invert_each_other(schedule):
    levels = schedule.noise_level(TIMES)
    assert jnp.all(jnp.diff(levels) > 0), "noise must rise with t"
    np.testing.assert_allclose(schedule.time(levels), TIMES, rtol=2e-3, atol=2e-4)
    np.testing.assert_allclose(schedule.log_snr(TIMES), -2 * jnp.log(levels), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("schedule", VP + VE + FLOW, ids=lambda s: type(s).__name__)
def test_grids_descend_to_zero_from_the_same_first_level(schedule):
    for steps in (1, 7, 30):
        grid = schedule.grid(steps)
        assert grid.shape == (steps + 1,) and float(grid[-1]) == 0.0
        assert jnp.all(jnp.diff(grid) < 0)
        np.testing.assert_allclose(grid[0], schedule.sigma_max, rtol=1e-4)


def test_a_discrete_grid_refuses_more_steps_than_timesteps():
    assert LinearSchedule(timesteps=1000).grid(1000).shape == (1001,)
    with pytest.raises(ValueError, match="1000 discrete timesteps.*2000 steps"):
        LinearSchedule(timesteps=1000).grid(2000)
    with pytest.raises(ValueError, match="1000 discrete timesteps"):
        sample(lambda x, s, c=None: x, jnp.zeros((1, 2)), solver=Heun(), steps=2000,
               process=Process(LinearSchedule()))


def test_linear_schedule_matches_ddpm_betas():
    betas = np.linspace(1e-4, 0.02, 1000)
    alpha_bar = np.cumprod(1 - betas)
    t = np.array([0, 1, 500, 999]) / 999
    np.testing.assert_allclose(LinearSchedule().alpha(t) ** 2, alpha_bar[[0, 1, 500, 999]], rtol=1e-4)


COMPATIBLE = [(s, tr) for s in VP for tr in (EpsilonPrediction(), X0Prediction(), VPrediction())]
COMPATIBLE += [(s, tr) for s in VE for tr in (EpsilonPrediction(), X0Prediction(), KarrasPreconditioning())]
COMPATIBLE += [(s, tr) for s in FLOW for tr in (EpsilonPrediction(), X0Prediction(), FlowPrediction())]


@pytest.mark.parametrize("schedule,transform", COMPATIBLE,
                         ids=lambda o: type(o).__name__)
def test_transform_target_round_trips_to_x0(schedule, transform):
    x0 = jax.random.normal(jax.random.key(0), (6, 4, 3))
    process = Process(schedule, transform)
    t = jnp.linspace(0.05, 0.95, 6)
    example = process.add_noise(jax.random.key(1), x0, t)
    np.testing.assert_allclose(process.denoised(example.target, example.x_t, t), x0, atol=2e-4, rtol=1e-3)
    # a wrong output does not round-trip (the check can fail)
    wrong = process.denoised(example.target + 0.1, example.x_t, t)
    assert float(jnp.max(jnp.abs(wrong - x0))) > 1e-3


@pytest.mark.parametrize("schedule,transform,pattern", [
    (CosineSchedule(), KarrasPreconditioning(), "KarrasPreconditioning does not fit CosineSchedule"),
    (FlowSchedule(), KarrasPreconditioning(), "'ve'"),
    (KarrasSchedule(), FlowPrediction(), "FlowPrediction does not fit KarrasSchedule"),
    (LinearSchedule(), FlowPrediction(), "'flow'"),
    (KarrasSchedule(), VPrediction(), "VPrediction does not fit"),
    (FlowSchedule(), VPrediction(), "'vp'"),
])
def test_a_transform_that_does_not_fit_the_schedule_raises(schedule, transform, pattern):
    with pytest.raises(ValueError, match=pattern):
        Process(schedule, transform)


def test_min_snr_and_p2_weights_in_the_targets_own_space():
    t = jnp.linspace(0.05, 0.95, 9)
    schedule = CosineSchedule()
    snr = 1 / schedule.noise_level(t) ** 2
    eps = Process(schedule, EpsilonPrediction(), MinSNRWeighting(5.0)).target_weight(t)
    v = Process(schedule, VPrediction(), MinSNRWeighting(5.0)).target_weight(t)
    np.testing.assert_allclose(eps, jnp.minimum(snr, 5) / snr, rtol=1e-4)
    np.testing.assert_allclose(v, jnp.minimum(snr, 5) / (snr + 1), rtol=1e-4)
    p2 = Process(schedule, EpsilonPrediction(), P2Weighting(gamma=1.0, k=1.0)).target_weight(t)
    np.testing.assert_allclose(p2, 1 / (1 + snr), rtol=1e-4)
    flat = Process(schedule, EpsilonPrediction(), P2Weighting(gamma=0.0)).target_weight(t)
    np.testing.assert_allclose(flat, 1.0, rtol=1e-5)
    assert jnp.all(jnp.isfinite(Process(FlowSchedule(), FlowPrediction(), P2Weighting()).target_weight(
        jnp.array([0.0, 0.5, 1.0]))))


def test_edm_trains_on_a_log_normal_sigma():
    process = EDM(regime="pixel")()
    example = process.training_example(jax.random.key(0), jnp.zeros((20000, 1)))
    log_sigma = jnp.log(process.schedule.sigma(example.t))
    assert abs(float(log_sigma.mean()) + 1.2) < 0.05 and abs(float(log_sigma.std()) - 1.2) < 0.05
    assert example.x_t.shape == (20000, 1) and example.weight.shape == (20000,)


def test_presets_build_processes():
    pixel, latent = EDM(regime="pixel")(), EDM(regime="latent")()
    assert pixel.transform.sigma_data == 0.5 and latent.transform.sigma_data == 1.0
    assert latent.sigma_max == pytest.approx(2 * pixel.sigma_max, rel=1e-5)
    with pytest.raises(ValueError, match="regime"):
        EDM(regime="voxel")()
    for preset in (Karras(), Cosine(), Cosine("v"), Flow(), Flow(shift=3.0, times="logit_normal"), Sqrt()):
        process = as_process(preset)
        assert isinstance(process, Process) and as_process(process) is process
        ex = process.training_example(jax.random.key(0), jnp.ones((4, 2, 2, 1)))
        assert ex.x_t.shape == ex.target.shape == (4, 2, 2, 1)
        assert bool(jnp.all(jnp.isfinite(ex.x_t)) & jnp.all(jnp.isfinite(ex.weight)))


def test_noise_starts_at_the_grids_first_level():
    process = EDM()()
    x_T = process.noise(jax.random.key(0), (4096, 4))
    assert float(x_T.std()) == pytest.approx(80.0, rel=0.03)


class _Recorder(nn.Module):
    """A backbone that checks the call convention: (x_in, noise_input [B], conditions)."""

    @nn.compact
    def __call__(self, x, noise, conditions):
        assert noise.shape == x.shape[:1], (noise.shape, x.shape)
        scale = self.param("scale", nn.initializers.zeros, ())
        shift = 0.0 if not conditions else conditions["shift"][:, None, None, None]
        return scale * x + shift


def test_denoiser_follows_the_call_convention_and_samples():
    process = EDM()()
    model = _Recorder()
    x = jnp.ones((2, 4, 4, 3))
    variables = model.init(jax.random.key(0), x, jnp.zeros(2), None)
    denoise = process.denoiser(model, variables)
    sigma = 2.0
    c_in, c_skip, c_out, _ = process.transform.scalings(sigma)
    # output 0 -> D = c_skip x
    np.testing.assert_allclose(denoise(x, sigma), c_skip * x, rtol=1e-6)
    cond = {"shift": jnp.array([1.0, 2.0])}
    got = denoise(x, sigma, cond)
    np.testing.assert_allclose(got[1], c_skip * x[1] + c_out * 2.0, rtol=1e-6)
    images = sample(denoise, process.noise(jax.random.key(1), x.shape), solver=Heun(), steps=4,
                    key=jax.random.key(2))
    assert images.shape == x.shape and bool(jnp.all(jnp.isfinite(images)))


def test_denoiser_scales_vp_inputs_into_sigma_space():
    """For a VP schedule the backbone sees x_t = alpha x and t; x0 comes back unchanged."""

    class Eps(nn.Module):
        @nn.compact
        def __call__(self, x, t, conditions):
            return jnp.zeros_like(x)  # eps = 0 -> x0 = x_t / alpha = x in sigma space

    process = Cosine()()
    denoise = process.denoiser(Eps(), {})
    x = jnp.full((3, 2), 0.7)
    np.testing.assert_allclose(denoise(x, 1.5), x, rtol=1e-5)
