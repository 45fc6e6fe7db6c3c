"""Published diffusers schedulers rebuilt from their configs (dew.interop.schedulers).

The fixtures (tools/scheduler_fixtures.py) ran each scheduler as its pipeline does over an analytic
network in the scheduler's own space and units; `Network` below is that network in JAX. Dew's
rebuilt scheduler must give the same timesteps (within 1e-4, relative 1e-6 for flow's t * 1000)
and the same final sample (within 1e-4, float32) from the same latents.
"""

import json
import math
import pathlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.interop.schedulers import FLOW_CEILING, SourceScheduler
from dew.sampling import sample
from dew.sampling.scheduler_solvers import AncestralEuler, DynamicThreshold

FIXTURES = pathlib.Path(__file__).parent / "fixtures/schedulers"
CONFIGS = json.loads((FIXTURES / "configs.json").read_text())
MU, S = 0.3, 0.6
TOLERANCE = 1e-4


@dataclasses.dataclass(frozen=True)
class Network:
    """tools/scheduler_fixtures.py's `network`: x and the timestep in the scheduler's units in, the
    prediction_type's output out. ``timestep_error`` adds a constant to the timestep it reads."""

    prediction: str
    timestep_error: float = 0.0

    def apply(self, variables, x, timesteps, conditions):
        u = jnp.clip((timesteps + self.timestep_error) / 1000.0, 0.0, 1.0)[:, None, None, None]
        if self.prediction == "flow":
            a, s = 1.0 - u, u
        else:
            abar = jnp.cos(0.5 * math.pi * u) ** 2 * 0.995 + 0.0048
            a, s = jnp.sqrt(abar), jnp.sqrt(1.0 - abar)
        x0 = MU + a * S**2 * (x - a * MU) / (a**2 * S**2 + s**2) + 0.1 * jnp.tanh(x) * u
        eps = (x - a * x0) / s
        return {"epsilon": eps, "v_prediction": a * eps - s * x0, "sample": x0, "flow": eps - x0}[self.prediction]


def nhwc(a):
    return jnp.asarray(np.moveaxis(np.asarray(a), -3, -1))


def load(name, **changes):
    entry = CONFIGS[name]
    data = np.load(FIXTURES / f"{name}.npz")
    tokens = int(data["image_tokens"])
    config = {**entry["config"], **changes}
    # a changed key no longer holds the saving class's default (diffusers would drop it otherwise)
    config["_use_default_values"] = [k for k in config.get("_use_default_values", []) if k not in changes]
    scheduler = SourceScheduler.from_config(config,
                                            pipeline_sigmas=entry["pipeline_sigmas"],
                                            image_tokens=tokens if tokens >= 0 else None)
    return scheduler, data, entry["steps"]


def run(scheduler, data, steps, network=None):
    grid = scheduler.grid(steps)
    x_T = scheduler.initial(nhwc(data["latents"]), grid)
    denoise = scheduler.process.denoiser(network or Network(scheduler.prediction), {})
    if isinstance(scheduler.solver, AncestralEuler):
        noises = jnp.asarray(np.moveaxis(data["noises"], -3, -1))
        x, _ = jax.jit(scheduler.solver.with_noises)(denoise, x_T, grid, noises)
    else:
        x = sample(denoise, x_T, solver=scheduler.solver, steps=steps, grid=grid)
    return np.asarray(scheduler.final(x, grid)), grid


def distance(got, data):
    return float(np.max(np.abs(got - np.asarray(nhwc(data["final"])))))


def per_level(scheduler, recorded):
    """The recorded network timesteps, one per grid level: PNDM evaluates its second level twice
    (the Heun start's corrector, then its first multistep), other schedulers once per level."""
    recorded = np.asarray(recorded, np.float32)
    return np.delete(recorded, 1) if scheduler.class_name == "PNDMScheduler" else recorded


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_rebuilt_scheduler_reproduces_the_recorded_run(name):
    scheduler, data, steps = load(name)
    got, grid = run(scheduler, data, steps)
    assert grid.shape == (steps + 1,) and bool(jnp.all(grid[:-1] > grid[1:]))
    np.testing.assert_allclose(scheduler.timesteps(grid), per_level(scheduler, data["timesteps"]),
                               atol=TOLERANCE, rtol=1e-5)
    assert distance(got, data) < TOLERANCE, distance(got, data)


NEGATIVE_CONTROLS = {
    "wrong timestep_spacing": ("sdxl_euler", {"timestep_spacing": "trailing"}),
    "wrong steps_offset": ("sd15_pndm", {"steps_offset": 0}),
    "wrong shift": ("sd3_flow", {"shift": 2.5}),
    "epsilon read as v": ("sd21_ddim_v", {"prediction_type": "epsilon"}),
    "v read as epsilon (Euler)": ("sd21_euler_karras_v", {"prediction_type": "epsilon"}),
    "no clipping": ("sd15_ddim_clip_trailing", {"clip_sample": False}),
    "no thresholding": ("sd15_dpmpp_3m_threshold_trailing", {"thresholding": False}),
    "second order at the last step": ("sd15_dpm_2m_heun_sigma_min", {"lower_order_final": False}),
    "midpoint for heun": ("sd15_dpm_2m_heun_sigma_min", {"solver_type": "midpoint"}),
    "no karras grid": ("sd15_dpmpp_2m_karras", {"use_karras_sigmas": False}),
}


@pytest.mark.parametrize("mistake", sorted(NEGATIVE_CONTROLS))
def test_a_wrong_setting_fails_the_same_check(mistake):
    name, changes = NEGATIVE_CONTROLS[mistake]
    scheduler, data, steps = load(name, **changes)
    got, _ = run(scheduler, data, steps)
    assert distance(got, data) > 10 * TOLERANCE, distance(got, data)


@pytest.mark.parametrize("name", ["sd15_ddim", "sdxl_euler", "sd15_dpmpp_2m_karras", "flux_flow"])
def test_a_timestep_off_by_one_fails_the_same_check(name):
    scheduler, data, steps = load(name)
    got, _ = run(scheduler, data, steps, Network(scheduler.prediction, timestep_error=1.0))
    assert distance(got, data) > 10 * TOLERANCE, distance(got, data)


def test_flux_grid_follows_the_image_token_count():
    scheduler, data, steps = load("flux_flow")
    other = dataclasses.replace(scheduler, image_tokens=4096)
    got, _ = run(other, data, steps)
    assert distance(got, data) > 10 * TOLERANCE
    assert float(scheduler.grid(steps)[1]) < float(scheduler.grid(steps, image_tokens=4096)[1])


def test_flow_starts_at_t_one_where_the_network_sees_the_latents():
    scheduler, data, steps = load("sd3_flow")
    grid = scheduler.grid(steps)
    assert float(grid[0]) == FLOW_CEILING
    assert float(scheduler.timestep_of(grid[0])) == 1000.0
    latents = nhwc(data["latents"])
    x_T = scheduler.initial(latents, grid)
    np.testing.assert_array_equal(scheduler.model_input(x_T, jnp.full((2,), grid[0])), latents)


UNSUPPORTED = [
    ({"_class_name": "LMSDiscreteScheduler"}, r"_class_name 'LMSDiscreteScheduler' is not one Dew rebuilds"),
    ({"_class_name": "DDIMScheduler", "rescale_betas_zero_snr": True}, r"rescale_betas_zero_snr=True"),
    ({"_class_name": "PNDMScheduler"}, r"skip_prk_steps=False .*Runge-Kutta"),
    ({"_class_name": "PNDMScheduler", "skip_prk_steps": True, "prediction_type": "v_prediction"},
     r"prediction_type='v_prediction' .*supported: 'epsilon'"),
    ({"_class_name": "EulerDiscreteScheduler", "interpolation_type": "log_linear"}, r"interpolation_type='log_linear'"),
    ({"_class_name": "EulerAncestralDiscreteScheduler", "prediction_type": "sample"}, r"prediction_type='sample'"),
    ({"_class_name": "DPMSolverMultistepScheduler", "algorithm_type": "sde-dpmsolver++"},
     r"algorithm_type='sde-dpmsolver\+\+' .*supported: 'dpmsolver\+\+', 'dpmsolver'"),
    ({"_class_name": "DPMSolverMultistepScheduler", "solver_order": 4}, r"solver_order=4"),
    ({"_class_name": "DPMSolverMultistepScheduler", "use_lu_lambdas": True}, r"use_lu_lambdas=True"),
    ({"_class_name": "DPMSolverMultistepScheduler", "variance_type": "learned_range"}, r"variance_type='learned_range'"),
    ({"_class_name": "DPMSolverMultistepScheduler", "algorithm_type": "dpmsolver"},
     r"final_sigmas_type='zero' does not work with algorithm_type='dpmsolver'"),
    ({"_class_name": "DPMSolverMultistepScheduler", "use_karras_sigmas": True, "use_beta_sigmas": True},
     r"use_karras_sigmas and use_beta_sigmas"),
    ({"_class_name": "EulerDiscreteScheduler", "beta_schedule": "sigmoid"}, r"beta_schedule='sigmoid'"),
    ({"_class_name": "FlowMatchEulerDiscreteScheduler", "invert_sigmas": True}, r"invert_sigmas=True"),
    ({"_class_name": "FlowMatchEulerDiscreteScheduler", "stochastic_sampling": True}, r"stochastic_sampling=True"),
    ({"_class_name": "FlowMatchEulerDiscreteScheduler", "shift_terminal": 0.1}, r"shift_terminal=0.1"),
]


@pytest.mark.parametrize("config,message", UNSUPPORTED, ids=[m for _, m in UNSUPPORTED])
def test_unsupported_settings_raise_naming_key_and_value(config, message):
    with pytest.raises(ValueError, match=message):
        SourceScheduler.from_config(config)


def test_unsupported_step_plans_raise_when_the_grid_is_built():
    ddim = SourceScheduler.from_config({"_class_name": "DDIMScheduler", "timestep_spacing": "trailing"})
    ddim.grid(10)  # 1000 // 10 apart: the steps land where the next evaluation is
    with pytest.raises(ValueError, match=r"trailing.* at 12 steps .*does not reproduce that mismatch"):
        ddim.grid(12)
    with pytest.raises(ValueError, match=r"PNDMScheduler at 1 step"):
        SourceScheduler.from_config(CONFIGS["sd15_pndm"]["config"]).grid(1)
    flux = SourceScheduler.from_config(CONFIGS["flux_flow"]["config"], pipeline_sigmas="flux")
    with pytest.raises(ValueError, match=r"use_dynamic_shifting=True .*image_tokens="):
        flux.grid(10)


def test_config_round_trips_and_reads_a_pipeline_folder(tmp_path):
    for name in ("sd15_pndm", "sdxl_euler", "sd15_dpmpp_3m_threshold_trailing", "flux_flow"):
        scheduler = SourceScheduler.from_config(CONFIGS[name]["config"])
        again = SourceScheduler.from_config(json.loads(json.dumps(scheduler.to_config())))
        assert again == scheduler
        assert "skip_prk_steps" not in scheduler.config or scheduler.class_name == "PNDMScheduler"
    inherited = {"_class_name": "DPMSolverMultistepScheduler", "timestep_spacing": "leading",
                 "_use_default_values": ["timestep_spacing"]}  # PNDM's default, not the DPM's
    assert SourceScheduler.from_config(inherited).config["timestep_spacing"] == "linspace"
    folder = tmp_path / "pipeline/scheduler"
    folder.mkdir(parents=True)
    (folder / "scheduler_config.json").write_text(json.dumps(CONFIGS["sd3_flow"]["config"]))
    assert SourceScheduler.from_config(tmp_path / "pipeline").config["shift"] == 3.0


def test_ancestral_euler_draws_its_noise_from_the_key():
    scheduler, data, steps = load("sd15_euler_ancestral")
    grid = scheduler.grid(steps)
    x_T = scheduler.initial(nhwc(data["latents"]), grid)
    denoise = scheduler.process.denoiser(Network("epsilon"), {})
    key = jax.random.key(3)
    drawn = sample(denoise, x_T, solver=scheduler.solver, steps=steps, grid=grid, key=key)
    noises = jax.random.normal(key, (steps,) + x_T.shape)
    replayed, _ = scheduler.solver.with_noises(denoise, x_T, grid, noises)
    np.testing.assert_allclose(drawn, replayed, atol=1e-6)
    with pytest.raises(ValueError, match="needs a key"):
        sample(denoise, x_T, solver=scheduler.solver, steps=steps, grid=grid)


def test_dynamic_threshold_clamps_each_sample_to_its_own_quantile():
    x0 = jnp.stack([jnp.linspace(-3.0, 3.0, 64), jnp.linspace(-0.5, 0.5, 64)]).reshape(2, 4, 4, 4)
    out = DynamicThreshold(ratio=0.9, max_value=2.0)(x0)
    assert float(jnp.max(jnp.abs(out[0]))) == pytest.approx(1.0)  # clamped to 2.0, divided by 2.0
    np.testing.assert_allclose(out[1], x0[1])  # quantile below 1: left as it is


def test_text_to_image_samples_through_a_source_scheduler():
    from dew.inference.image import TextToImage

    scheduler, _, steps = load("sd15_pndm")  # its last level is not 0: final() rescales there
    task = TextToImage(Network("epsilon"), {}, scheduler.process, (4, 4, 4), solver=scheduler.solver,
                       steps=steps)
    drawn = task(["", ""], seed=0).images
    noise_key, _ = jax.random.split(jax.random.key(0))
    grid = scheduler.grid(steps)
    x_T = scheduler.initial(jax.random.normal(noise_key, (2, 4, 4, 4)), grid)
    x = sample(scheduler.process.denoiser(Network("epsilon"), {}), x_T, solver=scheduler.solver,
               steps=steps, grid=grid)
    np.testing.assert_allclose(drawn, jnp.clip(scheduler.final(x, grid), -1, 1), atol=1e-6)
    assert float(jnp.max(jnp.abs(jnp.clip(x, -1, 1) - drawn))) > 1e-5


@pytest.mark.reference
@pytest.mark.parametrize("steps", [8, 20])  # 20: past lower_order_final's 15-step threshold
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_live_diffusers_reads_to_config_and_takes_the_same_steps(name, steps):
    diffusers = pytest.importorskip("diffusers")
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "scheduler_fixtures", pathlib.Path(__file__).parents[1] / "tools/scheduler_fixtures.py")
    tools = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tools)
    scheduler, data, _ = load(name)
    config = scheduler.to_config()
    theirs = getattr(diffusers, config["_class_name"]).from_config(config)
    assert {key: theirs.config[key] for key in scheduler.config} == json.loads(json.dumps(scheduler.config))
    tokens = scheduler.image_tokens
    arrays = tools.trajectory(config, CONFIGS[name]["pipeline_sigmas"], tokens, steps=steps)
    got, grid = run(scheduler, arrays, steps)
    np.testing.assert_allclose(scheduler.timesteps(grid), per_level(scheduler, arrays["timesteps"]),
                               atol=TOLERANCE, rtol=1e-5)
    assert distance(got, arrays) < TOLERANCE, distance(got, arrays)


@dataclasses.dataclass(frozen=True)
class FluxUnits:
    """A network taking FluxPipeline's timestep / 1000, scaling it back up inside as Flux does."""

    def apply(self, variables, x, timesteps, conditions):
        return Network("flow").apply(variables, x, timesteps * 1000.0, conditions)


def test_model_timestep_scale_passes_the_pipelines_units():
    scheduler, data, steps = load("flux_flow")
    flux = dataclasses.replace(scheduler, model_timestep_scale=0.001)
    got, _ = run(flux, data, steps, FluxUnits())
    assert distance(got, data) < TOLERANCE
    unscaled, _ = run(scheduler, data, steps, FluxUnits())
    assert distance(unscaled, data) > 10 * TOLERANCE
