"""Run diffusers' schedulers with released configs over a fixed analytic network; save what they do.

Writes tests/fixtures/schedulers/<name>.npz and tests/fixtures/schedulers/configs.json, read by
tests/test_source_schedulers.py.

Each scheduler runs as its pipeline drives it (float32, CPU): `set_timesteps`, latents drawn as
`randn * init_noise_sigma` (`prepare_latents`), then per timestep `scale_model_input`, the network,
and `step`. The network (`network` below, recomputed in JAX by the test) works in the *source's*
space and units: it reads the sample the scheduler hands it and the timestep value it is passed,
so a wrong timestep mapping or input scaling changes its output. It is elementwise, so the NCHW
arrays saved here equal Dew's NHWC ones up to a transpose.

Per scheduler the npz holds: ``latents`` (the unit Gaussian draw, NCHW), ``timesteps`` (every value
passed to the network, in call order), ``intermediates`` (the sample after each step), ``final``
(the last step's sample), ``image_tokens`` (-1 when the pipeline passes no `mu`) and, for
EulerAncestral, ``noises`` (the draw `step` added at each step, replayed by the test).
configs.json maps each name to ``{"config", "steps", "pipeline_sigmas"}``: the dict given to
diffusers' `from_config` (a released scheduler_config.json, or a released one swapped into another
class the way users do, ``Other.from_config(pipe.scheduler.config)``).

Run with the reference environment (torch CPU + diffusers), not Dew's:

    .venv-ref/bin/python tools/scheduler_fixtures.py
"""

from __future__ import annotations

import json
import math
import pathlib

import diffusers
import numpy as np
import torch

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests/fixtures/schedulers"
SHAPE = (2, 4, 4, 4)
STEPS = 10
MU, S = 0.3, 0.6  # the network's data model: x0 ~ N(MU, S^2), so some x0 estimates leave [-1, 1]

# scheduler/scheduler_config.json as the pipelines publish them
SD15 = {"_class_name": "PNDMScheduler", "_diffusers_version": "0.6.0", "beta_end": 0.012,
        "beta_schedule": "scaled_linear", "beta_start": 0.00085, "num_train_timesteps": 1000,
        "set_alpha_to_one": False, "skip_prk_steps": True, "steps_offset": 1, "trained_betas": None,
        "clip_sample": False}
SD21 = {"_class_name": "DDIMScheduler", "_diffusers_version": "0.8.0", "beta_end": 0.012,
        "beta_schedule": "scaled_linear", "beta_start": 0.00085, "clip_sample": False,
        "num_train_timesteps": 1000, "prediction_type": "v_prediction", "set_alpha_to_one": False,
        "skip_prk_steps": True, "steps_offset": 1, "trained_betas": None}
SDXL = {"_class_name": "EulerDiscreteScheduler", "_diffusers_version": "0.19.0.dev0", "beta_end": 0.012,
        "beta_schedule": "scaled_linear", "beta_start": 0.00085, "clip_sample": False,
        "interpolation_type": "linear", "num_train_timesteps": 1000, "prediction_type": "epsilon",
        "sample_max_value": 1.0, "set_alpha_to_one": False, "skip_prk_steps": True, "steps_offset": 1,
        "timestep_spacing": "leading", "trained_betas": None, "use_karras_sigmas": False}
SD3 = {"_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": "0.29.0.dev0",
       "num_train_timesteps": 1000, "shift": 3.0}
FLUX = {"_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": "0.30.0.dev0",
        "base_image_seq_len": 256, "base_shift": 0.5, "max_image_seq_len": 4096, "max_shift": 1.15,
        "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True}
FLUX_IMAGE_TOKENS = 1024  # a 512 x 512 image: 64 x 64 latents packed 2 x 2


def swapped(cls_name, released, **changes):
    """``cls.from_config(pipe.scheduler.config, **changes)``'s config, as a plain dict."""
    source = getattr(diffusers, released["_class_name"]).from_config(released)
    scheduler = getattr(diffusers, cls_name).from_config(source.config, **changes)
    config = json.loads(json.dumps({"_class_name": cls_name, **dict(scheduler.config)}))
    config["_use_default_values"] = sorted(config.get("_use_default_values", []))  # a set: fix the order
    return config


def variants():
    """name -> (config, pipeline_sigmas, image_tokens)."""
    return {
        "sd15_pndm": (SD15, None, None),
        "sd15_ddim": (swapped("DDIMScheduler", SD15), None, None),
        "sd15_euler": (swapped("EulerDiscreteScheduler", SD15), None, None),
        "sd15_euler_ancestral": (swapped("EulerAncestralDiscreteScheduler", SD15), None, None),
        "sd15_dpmpp_2m": (swapped("DPMSolverMultistepScheduler", SD15), None, None),
        "sd15_dpmpp_2m_karras": (swapped("DPMSolverMultistepScheduler", SD15, use_karras_sigmas=True),
                                 None, None),
        "sd15_dpmpp_3m_threshold_trailing": (swapped(
            "DPMSolverMultistepScheduler", SD15, solver_order=3, thresholding=True, sample_max_value=1.5,
            timestep_spacing="trailing"), None, None),
        "sd15_dpm_2m_heun_sigma_min": (swapped(
            "DPMSolverMultistepScheduler", SD15, algorithm_type="dpmsolver", solver_type="heun",
            final_sigmas_type="sigma_min", timestep_spacing="linspace"), None, None),
        "sd15_ddim_clip_trailing": (swapped("DDIMScheduler", SD15, clip_sample=True, clip_sample_range=1.0,
                                            timestep_spacing="trailing", set_alpha_to_one=True), None, None),
        "sd21_ddim_v": (SD21, None, None),
        "sd21_euler_karras_v": (swapped("EulerDiscreteScheduler", SD21, use_karras_sigmas=True), None, None),
        "sdxl_euler": (SDXL, None, None),
        "sdxl_euler_ancestral": (swapped("EulerAncestralDiscreteScheduler", SDXL), None, None),
        "sd21_euler_zero_snr_trailing": (swapped("EulerDiscreteScheduler", SD21, rescale_betas_zero_snr=True,
                                                 timestep_spacing="trailing"), None, None),
        "sd15_dpmpp_3m_exponential": (swapped("DPMSolverMultistepScheduler", SD15, solver_order=3,
                                              use_exponential_sigmas=True), None, None),
        "cosine_dpm_3_lambda_clipped": (swapped(
            "DPMSolverMultistepScheduler", SD15, beta_schedule="squaredcos_cap_v2", algorithm_type="dpmsolver",
            solver_order=3, final_sigmas_type="sigma_min", lambda_min_clipped=-5.1, prediction_type="sample"),
            None, None),
        "sd15_euler_beta_sigmas": (swapped("EulerDiscreteScheduler", SD15, use_beta_sigmas=True), None, None),
        "trained_betas_euler_ancestral": ({"_class_name": "EulerAncestralDiscreteScheduler",
                                           "trained_betas": np.linspace(2e-4, 0.03, 1000).round(7).tolist()},
                                          None, None),
        "sd3_flow": (SD3, None, None),
        "sd3_flow_karras": (swapped("FlowMatchEulerDiscreteScheduler", SD3, use_karras_sigmas=True), None, None),
        "flux_flow": (FLUX, "flux", FLUX_IMAGE_TOKENS),
    }


def network(x, timestep, prediction):
    """The analytic "model" (also in tests/test_source_schedulers.py): the posterior mean of
    N(MU, S^2) data under a cosine guess of the noise level read from the timestep, plus a tanh
    term, returned as the prediction type asks."""
    u = torch.clamp(torch.as_tensor(timestep, dtype=torch.float32) / 1000.0, 0.0, 1.0)
    if prediction == "flow_prediction":
        a, s = 1.0 - u, u
    else:
        abar = torch.cos(0.5 * math.pi * u) ** 2 * 0.995 + 0.0048
        a, s = abar.sqrt(), (1.0 - abar).sqrt()
    x0 = MU + a * S**2 * (x - a * MU) / (a**2 * S**2 + s**2) + 0.1 * torch.tanh(x) * u
    eps = (x - a * x0) / s
    return {"epsilon": eps, "v_prediction": a * eps - s * x0, "sample": x0,
            "flow_prediction": eps - x0}[prediction]


def pipeline_sigmas(kind, steps):
    """The sigmas a pipeline passes to `set_timesteps` itself (FluxPipeline: linspace(1, 1/n, n))."""
    return None if kind is None else np.linspace(1.0, 1 / steps, steps)


def calculate_shift(tokens, config):
    """FluxPipeline's mu: linear in the image token count between the base and max settings."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift as shift
    return shift(tokens, config["base_image_seq_len"], config["max_image_seq_len"], config["base_shift"],
                 config["max_shift"])


def trajectory(config, sigmas_kind, image_tokens, steps=STEPS):
    """Drive the scheduler from ``config`` as its pipeline does; returns the arrays the npz holds."""
    cls = getattr(diffusers, config["_class_name"])
    scheduler = cls.from_config(config)
    prediction = ("flow_prediction" if config["_class_name"] == "FlowMatchEulerDiscreteScheduler"
                  else scheduler.config.prediction_type)
    kwargs = {}
    if image_tokens is not None:
        kwargs["mu"] = calculate_shift(image_tokens, dict(scheduler.config))
    sigmas = pipeline_sigmas(sigmas_kind, steps)
    if sigmas is not None:
        scheduler.set_timesteps(sigmas=sigmas, **kwargs)
    else:
        scheduler.set_timesteps(steps, **kwargs)
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(SHAPE, generator=generator, dtype=torch.float32)
    sample = latents * getattr(scheduler, "init_noise_sigma", 1.0)  # flow pipelines: none
    step_generator = torch.Generator().manual_seed(1)
    ancestral = isinstance(scheduler, diffusers.EulerAncestralDiscreteScheduler)
    timesteps, intermediates, noises = [], [], []
    for t in scheduler.timesteps:
        model_input = scheduler.scale_model_input(sample, t) if hasattr(scheduler, "scale_model_input") else sample
        timesteps.append(float(t))
        output = network(model_input, t, prediction)
        if ancestral:
            copy = torch.Generator().manual_seed(0)
            copy.set_state(step_generator.get_state())
            noises.append(torch.randn(SHAPE, generator=copy, dtype=torch.float32).numpy())
            sample = scheduler.step(output, t, sample, generator=step_generator).prev_sample
        else:
            sample = scheduler.step(output, t, sample).prev_sample
        intermediates.append(sample.numpy().copy())
    arrays = {"latents": latents.numpy(), "timesteps": np.array(timesteps, np.float32),
              "intermediates": np.stack(intermediates), "final": sample.numpy(),
              "image_tokens": np.array(-1 if image_tokens is None else image_tokens)}
    if ancestral:
        arrays["noises"] = np.stack(noises)
    return arrays


def run(name, config, sigmas_kind, image_tokens):
    arrays = trajectory(config, sigmas_kind, image_tokens)
    np.savez_compressed(OUT / f"{name}.npz", **arrays)
    t, final = arrays["timesteps"], arrays["final"]
    print(f"{name:36s} {len(t):3d} calls  t0={t[0]:9.3f}  |final|={float(np.abs(final).mean()):.4f}")


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    configs = {}
    for name, (config, sigmas_kind, image_tokens) in variants().items():
        run(name, config, sigmas_kind, image_tokens)
        configs[name] = {"config": config, "steps": STEPS, "pipeline_sigmas": sigmas_kind}
    (OUT / "configs.json").write_text(json.dumps(configs, indent=1, sort_keys=True) + "\n")
    print("diffusers", diffusers.__version__, "->", OUT)


if __name__ == "__main__":
    main()
