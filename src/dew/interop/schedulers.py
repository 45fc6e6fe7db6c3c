"""A diffusers pipeline's own scheduler, rebuilt from its scheduler_config.json in sigma space.

`SourceScheduler.from_config(config_or_path)` reads the config a published pipeline ships (SD, SDXL,
SD 2.x, SD3, Flux, or one a user swapped in with ``Other.from_config(pipe.scheduler.config)``) and
gives what sampling needs to take that scheduler's steps:

- ``grid(steps)``: the descending sigma-space levels the scheduler visits (k-diffusion's
  x = x0 + sigma eps); ``timesteps(sigmas)``: the timestep values it passes the network there;
- ``process``: a process whose ``denoiser(model, variables, conditions)`` calls the model on the
  scheduler's own input (x_t = alpha x) with those timesteps and reads its output per
  prediction_type; ``solver``: a Dew solver whose steps are the scheduler's updates;
- ``initial(latents, sigmas)`` / ``final(x, sigmas)``: the pipeline's unit Gaussian latents as x_T
  in sigma space, and the sample at the grid's last level back in the scheduler's space.
- ``training_process(train_times)``: the same process with the source's training recipe
  (``training_example``: its noise table, prediction target and timestep units), which
  `DiffusionObjective.from_pipeline` fine-tunes with.

Three spaces map into sigma space. DDIM, PNDM and DPM-Solver keep the variance-preserving sample
alpha x (alpha = 1 / sqrt(1 + sigma^2)); the Euler schedulers keep x itself and hand the network
x / sqrt(1 + sigma^2); flow matching keeps (1 - t) x0 + t eps, i.e. x / (1 + sigma) with
sigma = t / (1 - t). Flow's first level t = 1 has no finite sigma, so it stands at 2^24, where
t = sigma / (1 + sigma) rounds to 1 in float32, x_T = 2^24 latents exactly, and the network sees
the latents themselves (the solver there is DDIM's form x' = D + s' (x - D) / s, which stays
exact for a huge s).

Every setting is checked: a value Dew does not reproduce raises, naming the key, the value and
what is supported. Keys outside the class's signature have no effect in diffusers either and are
dropped, as are keys listed under ``_use_default_values`` (diffusers gives those the class's own
defaults); `to_config()` gives back the class's full settings for diffusers' ``from_config``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew.checks import count
from dew.diffusion import betas as discrete
from dew.diffusion.process import Example, UniformTimes
from dew.sampling.scheduler_solvers import (AncestralEuler, ClipSample, DynamicThreshold, FilteredDDIM,
                                            MultistepDPM)
from dew.sampling.solvers import DDIM, PNDM, Euler

FLOW_CEILING = 2.0**24  # the sigma-space stand-in for flow time t = 1

_DISCRETE = {"num_train_timesteps": 1000, "beta_start": 0.0001, "beta_end": 0.02, "beta_schedule": "linear",
             "trained_betas": None}
_GRIDS = {"use_karras_sigmas": False, "use_exponential_sigmas": False, "use_beta_sigmas": False}

# each class's constructor settings and defaults (diffusers 0.42.1)
DEFAULTS: dict[str, dict[str, Any]] = {
    "DDIMScheduler": {**_DISCRETE, "clip_sample": True, "set_alpha_to_one": True, "steps_offset": 0,
                      "prediction_type": "epsilon", "thresholding": False, "dynamic_thresholding_ratio": 0.995,
                      "clip_sample_range": 1.0, "sample_max_value": 1.0, "timestep_spacing": "leading",
                      "rescale_betas_zero_snr": False},
    "PNDMScheduler": {**_DISCRETE, "skip_prk_steps": False, "set_alpha_to_one": False,
                      "prediction_type": "epsilon", "timestep_spacing": "leading", "steps_offset": 0},
    "EulerDiscreteScheduler": {**_DISCRETE, "prediction_type": "epsilon", "interpolation_type": "linear",
                               **_GRIDS, "sigma_min": None, "sigma_max": None, "timestep_spacing": "linspace",
                               "timestep_type": "discrete", "steps_offset": 0, "rescale_betas_zero_snr": False,
                               "final_sigmas_type": "zero"},
    "EulerAncestralDiscreteScheduler": {**_DISCRETE, "prediction_type": "epsilon", "timestep_spacing": "linspace",
                                        "steps_offset": 0, "rescale_betas_zero_snr": False},
    "DPMSolverMultistepScheduler": {
        **_DISCRETE, "solver_order": 2, "prediction_type": "epsilon", "thresholding": False,
        "dynamic_thresholding_ratio": 0.995, "sample_max_value": 1.0, "algorithm_type": "dpmsolver++",
        "solver_type": "midpoint", "lower_order_final": True, "euler_at_final": False, **_GRIDS,
        "use_lu_lambdas": False, "use_flow_sigmas": False, "flow_shift": 1.0, "final_sigmas_type": "zero",
        "lambda_min_clipped": -math.inf, "variance_type": None, "timestep_spacing": "linspace",
        "steps_offset": 0, "rescale_betas_zero_snr": False, "use_dynamic_shifting": False,
        "time_shift_type": "exponential"},
    "FlowMatchEulerDiscreteScheduler": {
        "num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": False, "base_shift": 0.5,
        "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096, "invert_sigmas": False,
        "shift_terminal": None, **_GRIDS, "time_shift_type": "exponential", "stochastic_sampling": False},
}

# settings with a closed set of values Dew reproduces, per class (absent: any value of the right kind)
_SPACINGS = ("leading", "trailing", "linspace")
_CHOICES: dict[str, dict[str, tuple]] = {
    "DDIMScheduler": {"prediction_type": ("epsilon", "v_prediction", "sample"), "timestep_spacing": _SPACINGS,
                      "rescale_betas_zero_snr": (False,)},
    "PNDMScheduler": {"prediction_type": ("epsilon",), "skip_prk_steps": (True,), "timestep_spacing": _SPACINGS},
    "EulerDiscreteScheduler": {"prediction_type": ("epsilon", "v_prediction", "sample"),
                               "interpolation_type": ("linear",), "timestep_spacing": _SPACINGS,
                               "timestep_type": ("discrete", "continuous"), "final_sigmas_type": ("zero", "sigma_min")},
    "EulerAncestralDiscreteScheduler": {"prediction_type": ("epsilon", "v_prediction"),
                                        "timestep_spacing": _SPACINGS},
    "DPMSolverMultistepScheduler": {
        "prediction_type": ("epsilon", "v_prediction", "sample"), "algorithm_type": ("dpmsolver++", "dpmsolver"),
        "solver_order": (1, 2, 3), "solver_type": ("midpoint", "heun"), "use_lu_lambdas": (False,),
        "use_flow_sigmas": (False,), "final_sigmas_type": ("zero", "sigma_min"), "variance_type": (None,),
        "timestep_spacing": _SPACINGS, "use_dynamic_shifting": (False,)},
    "FlowMatchEulerDiscreteScheduler": {"invert_sigmas": (False,), "shift_terminal": (None,),
                                        "time_shift_type": ("exponential", "linear"),
                                        "stochastic_sampling": (False,)},
}
_WHY = {
    "skip_prk_steps": "PNDM's Runge-Kutta warm-up is not implemented; Stable Diffusion ships skip_prk_steps true",
    "rescale_betas_zero_snr": "DDIM's rescaled table puts the top timestep at alpha_bar = 0, which has no "
                              "sigma-space level (Euler and DPM-Solver keep 2^-24 there and are supported)",
    "interpolation_type": "'log_linear' pairs log-spaced sigmas with timesteps that are not a function of them",
    "variance_type": "learned variances (an output with twice the channels) are not read",
    "stochastic_sampling": "the stochastic flow step is not implemented",
}


def _resolve(config: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    name = config.get("_class_name")
    if name not in DEFAULTS:
        raise ValueError(f"scheduler _class_name {name!r} is not one Dew rebuilds; it rebuilds "
                         f"{', '.join(sorted(DEFAULTS))}. Replace the scheduler (Other.from_config(config)) "
                         "with one of these before loading.")
    settings = dict(DEFAULTS[name])
    # keys a saved config lists under _use_default_values took the saving class's defaults, so
    # diffusers gives them this class's defaults instead (what a swapped scheduler inherits)
    defaulted = set(config.get("_use_default_values", ()))
    settings.update({key: value for key, value in config.items() if key in settings and key not in defaulted})
    for key, allowed in _CHOICES[name].items():
        if settings[key] not in allowed:
            why = f" ({_WHY[key]})" if key in _WHY else ""
            raise ValueError(f"{name} setting {key}={settings[key]!r} is not supported by Dew{why}; "
                             f"supported: {', '.join(repr(a) for a in allowed)}.")
    grids = [key for key in _GRIDS if settings.get(key)]
    if len(grids) > 1:
        raise ValueError(f"{name} sets {' and '.join(grids)}; only one of {', '.join(_GRIDS)} may be true.")
    if name == "DPMSolverMultistepScheduler" and settings["algorithm_type"] == "dpmsolver" \
            and settings["final_sigmas_type"] == "zero":
        raise ValueError("DPMSolverMultistepScheduler setting final_sigmas_type='zero' does not work with "
                         "algorithm_type='dpmsolver' (diffusers refuses it too); use final_sigmas_type='sigma_min'.")
    if "beta_schedule" in settings and settings["trained_betas"] is None \
            and settings["beta_schedule"] not in discrete.BETA_SCHEDULES:
        raise ValueError(f"{name} setting beta_schedule={settings['beta_schedule']!r} is not supported by Dew; "
                         f"supported: {', '.join(discrete.BETA_SCHEDULES)} (or trained_betas).")
    count(settings["num_train_timesteps"], "num_train_timesteps", minimum=2)
    if settings.get("trained_betas") is not None:
        settings["trained_betas"] = tuple(float(b) for b in settings["trained_betas"])
    return name, settings


def _read(config: Mapping[str, Any] | str | pathlib.Path) -> Mapping[str, Any]:
    if isinstance(config, Mapping):
        return config
    path = pathlib.Path(config)
    if path.is_dir():
        path = path / ("scheduler_config.json" if (path / "scheduler_config.json").exists()
                       else "scheduler/scheduler_config.json")
    if not path.is_file():
        raise FileNotFoundError(f"no scheduler config at {path}: pass a scheduler_config.json, the folder "
                                "holding it, or a pipeline folder with scheduler/scheduler_config.json")
    return json.loads(path.read_text())


def _spaced(spacing: str, train: int, steps: int, offset: int, *, integer: bool) -> np.ndarray:
    """DDIM / PNDM / Euler timestep spacing (Lin et al. 2023, Table 2), descending."""
    if spacing == "linspace":
        t = np.linspace(0, train - 1, steps)[::-1]
        return t.round() if integer else t.astype(np.float32)
    if spacing == "leading":
        return (np.arange(0, steps) * (train // steps)).round()[::-1] + offset
    return np.round(np.arange(train, 0, -train / steps)) - 1


def _converted(kind: str, low: float, high: float, steps: int) -> np.ndarray:
    """Karras (rho 7), exponential or beta(0.6, 0.6) levels from ``high`` down to ``low``."""
    if kind == "use_karras_sigmas":
        ramp = np.linspace(0, 1, steps)
        return (high ** (1 / 7) + ramp * (low ** (1 / 7) - high ** (1 / 7))) ** 7
    if kind == "use_exponential_sigmas":
        return np.exp(np.linspace(math.log(high), math.log(low), steps))
    import scipy.stats

    ppf = np.array([scipy.stats.beta.ppf(t, 0.6, 0.6) for t in 1 - np.linspace(0, 1, steps)])
    return low + ppf * (high - low)


def image_shift(image_tokens: int, settings: Mapping[str, Any]) -> float:
    """mu for dynamic shifting: linear in the image token count between base and max (Flux, SD3)."""
    m = (settings["max_shift"] - settings["base_shift"]) / (settings["max_image_seq_len"]
                                                           - settings["base_image_seq_len"])
    return image_tokens * m + settings["base_shift"] - m * settings["base_image_seq_len"]


@dataclasses.dataclass(frozen=True)
class SourceScheduler:
    """A published diffusers scheduler rebuilt in sigma space (see the module docstring).

    ``pipeline_sigmas`` names sigmas a pipeline passes to set_timesteps itself: "flux" for
    FluxPipeline's linspace(1, 1/steps, steps); None when the pipeline passes only a step count.
    ``image_tokens`` is the latent token count dynamic shifting reads (``grid`` can also take it).
    ``model_timestep_scale`` multiplies the scheduler's timesteps into what the pipeline passes its
    network (FluxPipeline divides by 1000: 0.001).
    """

    class_name: str
    settings: tuple
    pipeline_sigmas: str | None = None
    image_tokens: int | None = None
    model_timestep_scale: float = 1.0

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | str | pathlib.Path, *, pipeline_sigmas: str | None = None,
                    image_tokens: int | None = None, model_timestep_scale: float = 1.0) -> SourceScheduler:
        name, settings = _resolve(_read(config))
        if pipeline_sigmas not in (None, "flux"):
            raise ValueError(f"pipeline_sigmas must be None or 'flux', got {pipeline_sigmas!r}")
        if pipeline_sigmas is not None and name != "FlowMatchEulerDiscreteScheduler":
            raise ValueError(f"pipeline_sigmas={pipeline_sigmas!r} is FluxPipeline's, for a flow-matching "
                             f"scheduler; this config is a {name}")
        if image_tokens is not None:
            count(image_tokens, "image_tokens")
        return cls(name, tuple(settings.items()), pipeline_sigmas, image_tokens, float(model_timestep_scale))

    # ------------------------------------------------------------ the config

    @property
    def config(self) -> dict[str, Any]:
        """The class's full settings, as diffusers' ``scheduler.config`` holds them."""
        settings = dict(self.settings)
        if settings.get("trained_betas") is not None:
            settings["trained_betas"] = list(settings["trained_betas"])
        return settings

    def to_config(self) -> dict[str, Any]:
        """A scheduler_config.json dict that diffusers' ``from_config`` rebuilds this scheduler from."""
        return {"_class_name": self.class_name, **self.config}

    def _get(self, key):
        return dict(self.settings)[key]

    @property
    def space(self) -> str:
        """Where the scheduler's sample lives: "vp" (alpha x), "sigma" (x) or "flow" (x / (1 + sigma))."""
        if self.class_name == "FlowMatchEulerDiscreteScheduler":
            return "flow"
        if self.class_name in ("EulerDiscreteScheduler", "EulerAncestralDiscreteScheduler"):
            return "sigma"
        return "vp"

    @property
    def prediction(self) -> str:
        return "flow" if self.space == "flow" else self._get("prediction_type")

    # ------------------------------------------------------------ the discrete table

    def _betas(self) -> np.ndarray:
        """The float32 betas of the training timesteps (rescaled to zero terminal SNR when set)."""
        settings = dict(self.settings)
        if settings["trained_betas"] is not None:
            betas = np.asarray(settings["trained_betas"], np.float32)
        else:
            betas = discrete.betas(settings["beta_schedule"], settings["num_train_timesteps"],
                                   settings["beta_start"], settings["beta_end"])
        if settings.get("rescale_betas_zero_snr", False):
            betas = discrete.rescale_zero_terminal_snr(betas)
        return betas

    def _levels(self) -> np.ndarray:
        """The sigma-space level of each training timestep (float32, ascending)."""
        zero_snr = dict(self.settings).get("rescale_betas_zero_snr", False)
        return discrete.noise_levels(discrete.alphas_cumprod(self._betas(), zero_terminal_snr=zero_snr))

    def alphas_cumprod(self) -> np.ndarray:
        """alpha_bar of each training timestep (float32), as the DDPM scheduler a diffusers training
        script builds from this config holds it: a zero-SNR table ends in 0 here, not 2^-24."""
        if self.space == "flow":
            raise ValueError(f"{self.class_name} is a flow-matching scheduler; it has no alpha_bar table "
                             "(its training levels are training_sigmas())")
        return discrete.alphas_cumprod(self._betas())

    def training_sigmas(self) -> np.ndarray:
        """A flow-matching scheduler's training levels t (float32, descending from 1): its timestep
        table over ``num_train_timesteps``, shifted by ``shift`` unless shifting is dynamic (diffusers
        then shifts only the sampling grid, by the image size)."""
        if self.space != "flow":
            raise ValueError(f"{self.class_name} is a discrete scheduler; its training table is alphas_cumprod()")
        s = dict(self.settings)
        train = s["num_train_timesteps"]
        t = np.linspace(1, train, train, dtype=np.float32)[::-1] / np.float32(train)
        if not s["use_dynamic_shifting"]:
            t = s["shift"] * t / (1 + (s["shift"] - 1) * t)
        return t.astype(np.float32)

    # ------------------------------------------------------------ the grid

    def grid(self, steps: int, *, image_tokens: int | None = None) -> jax.Array:
        """``steps + 1`` descending sigma-space levels: the ``steps`` levels the scheduler evaluates the
        network at, then the level its last step lands on."""
        steps = count(steps, "steps")
        build = {"DDIMScheduler": self._ddim_grid, "PNDMScheduler": self._ddim_grid,
                 "EulerDiscreteScheduler": self._euler_grid, "EulerAncestralDiscreteScheduler": self._euler_grid,
                 "DPMSolverMultistepScheduler": self._dpm_grid,
                 "FlowMatchEulerDiscreteScheduler": self._flow_grid}[self.class_name]
        if self.class_name == "FlowMatchEulerDiscreteScheduler":
            return jnp.asarray(build(steps, image_tokens if image_tokens is not None else self.image_tokens))
        return jnp.asarray(build(steps))

    def _ddim_grid(self, steps):
        s = dict(self.settings)
        train = s["num_train_timesteps"]
        if steps > train:
            raise ValueError(f"{self.class_name} has {train} training timesteps; {steps} steps do not exist")
        if self.class_name == "PNDMScheduler" and steps < 2:
            raise ValueError("PNDMScheduler at 1 step takes a single DDIM step, not its Heun start; "
                             "Dew reproduces it from 2 steps up (or use DDIMScheduler for 1 step)")
        timesteps = _spaced(s["timestep_spacing"], train, steps, s["steps_offset"], integer=True).astype(np.int64)
        stride = train // steps
        landing = timesteps - stride
        if steps > 1 and np.any(landing[:-1] != timesteps[1:]):
            i = int(np.nonzero(landing[:-1] != timesteps[1:])[0][0])
            raise ValueError(
                f"{self.class_name} with timestep_spacing={s['timestep_spacing']!r} at {steps} steps steps from "
                f"timestep {timesteps[i]} to {landing[i]} (t - {train} // {steps}) but evaluates the network at "
                f"{timesteps[i + 1]} next; Dew does not reproduce that mismatch. Use a step count whose "
                f"timesteps are {train} // steps apart (a divisor of {train} for 'trailing'), or 'leading'.")
        levels = self._levels()
        if landing[-1] >= 0:
            last = levels[landing[-1]]
        else:
            last = 0.0 if s["set_alpha_to_one"] else levels[0]
        return np.append(levels[timesteps], np.float32(last)).astype(np.float32)

    def _euler_grid(self, steps):
        s = dict(self.settings)
        levels = self._levels()
        timesteps = _spaced(s["timestep_spacing"], s["num_train_timesteps"], steps, s["steps_offset"],
                            integer=False).astype(np.float32)
        sigmas = np.interp(timesteps, np.arange(len(levels)), levels)
        kind = next((key for key in _GRIDS if s.get(key)), None)
        if kind is not None:
            low = s["sigma_min"] if s.get("sigma_min") is not None else sigmas[-1].item()
            high = s["sigma_max"] if s.get("sigma_max") is not None else sigmas[0].item()
            sigmas = _converted(kind, low, high, steps)
        last = levels[0] if s.get("final_sigmas_type") == "sigma_min" else 0.0
        return np.append(sigmas, last).astype(np.float32)

    def _dpm_timesteps(self, steps):
        s = dict(self.settings)
        levels = self._levels()
        lambdas = -np.log(levels)  # lambda_t descends with t
        clipped = int(np.searchsorted(lambdas[::-1], s["lambda_min_clipped"], side="left"))
        last_timestep = s["num_train_timesteps"] - clipped
        spacing = s["timestep_spacing"]
        if spacing == "linspace":
            return np.linspace(0, last_timestep - 1, steps + 1).round()[::-1][:-1].astype(np.int64)
        if spacing == "leading":
            ratio = last_timestep // (steps + 1)
            return (np.arange(0, steps + 1) * ratio).round()[::-1][:-1].astype(np.int64) + s["steps_offset"]
        return np.arange(last_timestep, 0, -s["num_train_timesteps"] / steps).round().astype(np.int64) - 1

    def _dpm_grid(self, steps):
        s = dict(self.settings)
        levels = self._levels()
        kind = next((key for key in _GRIDS if s.get(key)), None)
        if kind is not None:
            sigmas = _converted(kind, levels[0].item(), levels[-1].item(), steps)
        else:
            sigmas = np.interp(self._dpm_timesteps(steps), np.arange(len(levels)), levels)
        last = levels[0] if s["final_sigmas_type"] == "sigma_min" else 0.0
        return np.append(sigmas, last).astype(np.float32)

    def _flow_grid(self, steps, image_tokens):
        s = dict(self.settings)
        train = s["num_train_timesteps"]
        if self.pipeline_sigmas == "flux":
            t = np.linspace(1.0, 1 / steps, steps).astype(np.float32)
        else:
            table = np.linspace(1, train, train, dtype=np.float32)[::-1] / train
            if not s["use_dynamic_shifting"]:
                table = s["shift"] * table / (1 + (s["shift"] - 1) * table)
            t = np.linspace(float(table[0]) * train, float(table[-1]) * train, steps) / train
        if s["use_dynamic_shifting"]:
            if image_tokens is None:
                raise ValueError("FlowMatchEulerDiscreteScheduler with use_dynamic_shifting=True shifts by the "
                                 "image's latent token count: pass image_tokens= (to grid or from_config)")
            mu = image_shift(image_tokens, s)
            shift = math.exp(mu) if s["time_shift_type"] == "exponential" else mu
            t = shift / (shift + (1 / t - 1))
        else:
            t = s["shift"] * t / (1 + (s["shift"] - 1) * t)
        kind = next((key for key in _GRIDS if s.get(key)), None)
        if kind is not None:
            t = _converted(kind, float(t[-1]), float(t[0]), steps)
        t = np.asarray(t, np.float32).astype(np.float64)
        with np.errstate(divide="ignore"):
            levels = np.minimum(t / (1.0 - t), FLOW_CEILING)
        return np.append(levels, 0.0).astype(np.float32)

    # ------------------------------------------------------------ timesteps

    def timestep_of(self, sigma: jax.Array) -> jax.Array:
        """The scheduler's timestep at sigma-space level ``sigma`` (traceable; float32)."""
        sigma = jnp.asarray(sigma, jnp.float32)
        if self.space == "flow":
            return self._get("num_train_timesteps") * (sigma / (1.0 + sigma))
        levels = self._levels()
        index = jnp.arange(len(levels), dtype=jnp.float32)
        by_log = jnp.interp(jnp.log(sigma), jnp.asarray(np.log(levels)), index)
        s = dict(self.settings)
        converted = any(s.get(key) for key in _GRIDS)
        if self.class_name in ("DDIMScheduler", "PNDMScheduler"):
            return jnp.round(by_log)
        if self.space == "sigma":
            if s.get("timestep_type") == "continuous" and s["prediction_type"] == "v_prediction":
                return 0.25 * jnp.log(sigma)
            return by_log if converted else jnp.interp(sigma, jnp.asarray(levels), index)
        # DPMSolverMultistep: integer timesteps, rounded where diffusers rounds and truncated elsewhere
        rounds = not converted or (s["use_karras_sigmas"] and s["beta_schedule"] != "squaredcos_cap_v2")
        return jnp.round(by_log) if rounds else jnp.trunc(by_log)

    def timesteps(self, sigmas: jax.Array) -> jax.Array:
        """The timestep values at each evaluated level of a grid (all but its last level), in the
        scheduler's own units (``scheduler.timesteps``; PNDM passes its second level twice)."""
        return self.timestep_of(jnp.asarray(sigmas)[:-1])

    # ------------------------------------------------------------ moving between spaces

    def _scale(self, sigma):
        """x_source = scale * x_sigma."""
        if self.space == "flow":
            return 1.0 / (1.0 + sigma)
        return 1.0 / jnp.sqrt(1.0 + sigma**2)

    def initial(self, latents: jax.Array, sigmas: jax.Array) -> jax.Array:
        """The pipeline's unit Gaussian ``latents`` (before ``init_noise_sigma``) as x_T in sigma space."""
        latents = jnp.asarray(latents, jnp.float32)
        s0 = jnp.asarray(sigmas, jnp.float32)[0]
        if self.space == "sigma":
            leading = self._get("timestep_spacing") == "leading"  # init_noise_sigma = sqrt(max^2 + 1)
            return latents * (jnp.sqrt(s0**2 + 1.0) if leading else s0)
        if self.space == "flow":
            return latents * (1.0 + s0)
        return latents * jnp.sqrt(1.0 + s0**2)

    def final(self, x: jax.Array, sigmas: jax.Array) -> jax.Array:
        """The sample at the grid's last level as the scheduler returns it (its own space)."""
        last = jnp.asarray(sigmas, jnp.float32)[-1]
        return x if self.space == "sigma" else x * self._scale(last)

    def model_input(self, x: jax.Array, sigma: jax.Array) -> jax.Array:
        """What the network is called on at level ``sigma`` ([B]): the scheduler's sample, or for the
        Euler schedulers their scale_model_input, x / sqrt(1 + sigma^2)."""
        return x * _expand(self._scale(sigma), x)

    def denoised(self, output: jax.Array, x: jax.Array, sigma: jax.Array) -> jax.Array:
        """x0 from the network's output at sigma-space x, per prediction_type."""
        s = _expand(sigma, x)
        if self.prediction == "flow":
            return x / (1.0 + s) - (s / (1.0 + s)) * output
        if self.prediction == "epsilon":
            return x - s * output
        if self.prediction == "v_prediction":
            return x / (1.0 + s**2) - output * s / jnp.sqrt(1.0 + s**2)
        return output

    # ------------------------------------------------------------ what sampling uses

    @property
    def x0_filter(self):
        s = dict(self.settings)
        if s.get("thresholding"):
            return DynamicThreshold(s["dynamic_thresholding_ratio"], s["sample_max_value"])
        if s.get("clip_sample"):
            return ClipSample(s["clip_sample_range"])
        return None

    @property
    def solver(self):
        """The Dew solver that takes this scheduler's steps (deterministic DDIM: the pipelines' eta 0)."""
        s = dict(self.settings)
        if self.class_name == "DDIMScheduler":
            return FilteredDDIM(self.x0_filter)
        if self.class_name == "PNDMScheduler":
            return PNDM()
        if self.class_name == "EulerDiscreteScheduler":
            return Euler()
        if self.class_name == "EulerAncestralDiscreteScheduler":
            return AncestralEuler()
        if self.class_name == "DPMSolverMultistepScheduler":
            return MultistepDPM(order=s["solver_order"], data_prediction=s["algorithm_type"] == "dpmsolver++",
                                heun=s["solver_type"] == "heun", lower_order_final=s["lower_order_final"],
                                euler_at_final=s["euler_at_final"], final_zero=s["final_sigmas_type"] == "zero",
                                x0_filter=self.x0_filter)
        return DDIM()

    @property
    def process(self) -> SourceProcess:
        return SourceProcess(self)

    def training_process(self, train_times: Any = None) -> SourceProcess:
        """The process with training timesteps drawn through ``train_times`` (None: uniform)."""
        return SourceProcess(self, UniformTimes(0.0, 1.0) if train_times is None else train_times)


def _expand(a, x):
    a = jnp.asarray(a, jnp.float32)
    return a.reshape(a.shape + (1,) * (x.ndim - a.ndim))


@dataclasses.dataclass(frozen=True)
class SourceProcess:
    """A `dew.diffusion.Process` for a source scheduler. Sampling: its grid, its x_T and a sigma-space
    denoiser that calls the network in the scheduler's units. Training: the source's own recipe
    (diffusers' training scripts), so a fine-tuned network keeps the schedule it was trained on.

    Training draws an index into the scheduler's training table, ``floor(u * num_train_timesteps)``
    with u from ``train_times`` (uniform: the discrete scripts' randint; `LogitNormalTimes()` is the
    SD3 scripts' "logit_normal" weighting scheme). A discrete scheduler noises x0 to
    ``sqrt(alpha_bar) x0 + sqrt(1 - alpha_bar) eps`` (DDPM's add_noise) at that integer timestep
    and regresses eps, the velocity ``sqrt(alpha_bar) eps - sqrt(1 - alpha_bar) x0`` (get_velocity)
    or x0, per prediction_type; a flow-matching one noises to ``(1 - t) x0 + t eps`` at the table's
    t and regresses ``eps - x0``, with timestep ``t * num_train_timesteps``. The network is called
    on x_t with the timestep times the pipeline's ``model_timestep_scale``, as sampling calls it.
    """

    scheduler: SourceScheduler
    train_times: Any = UniformTimes(0.0, 1.0)

    def sigmas(self, steps: int) -> jax.Array:
        return self.scheduler.grid(steps)

    def noise(self, key, shape, dtype=jnp.float32, *, steps: int) -> jax.Array:
        """x_T for a ``steps``-step grid from the pipeline's unit Gaussian draw under ``key``."""
        latents = jax.random.normal(key, shape, jnp.float32)
        return self.scheduler.initial(latents, self.sigmas(steps)).astype(dtype)

    def final(self, x, sigmas) -> jax.Array:
        """The sample at the grid's last level in the scheduler's space (what its pipeline decodes)."""
        return self.scheduler.final(x, sigmas)

    def denoiser(self, model, variables, conditions=None) -> SourceDenoiser:
        return SourceDenoiser(model, self.scheduler, variables, conditions)

    # ------------------------------------------------------------ training side

    def training_timesteps(self, key, batch: int) -> jax.Array:
        """[batch] float32 timesteps in the scheduler's units, drawn from its training table."""
        train = self.scheduler._get("num_train_timesteps")
        u = self.train_times(key, batch, None)
        index = jnp.clip(jnp.floor(u * train).astype(jnp.int32), 0, train - 1)
        if self.scheduler.space == "flow":
            return jnp.asarray(self.scheduler.training_sigmas())[index] * train
        return index.astype(jnp.float32)

    def add_noise(self, x0, noise, timesteps) -> Example:
        """x0 noised with ``noise`` at ``timesteps`` ([B], the scheduler's units), with the regression
        target of its prediction type and unit weights."""
        timesteps = jnp.broadcast_to(jnp.asarray(timesteps, jnp.float32), x0.shape[:1])
        if self.scheduler.space == "flow":
            t = _expand(timesteps / self.scheduler._get("num_train_timesteps"), x0)
            return Example((1.0 - t) * x0 + t * noise, timesteps, noise - x0, jnp.ones_like(timesteps))
        alpha_bar = jnp.asarray(self.scheduler.alphas_cumprod())[timesteps.astype(jnp.int32)]
        a, s = _expand(jnp.sqrt(alpha_bar), x0), _expand(jnp.sqrt(1.0 - alpha_bar), x0)
        prediction = self.scheduler.prediction
        target = {"epsilon": noise, "v_prediction": a * noise - s * x0, "sample": x0}[prediction]
        return Example(a * x0 + s * noise, timesteps, target, jnp.ones_like(timesteps))

    def training_example(self, key, x0) -> Example:
        """Timesteps from the first half of ``split(key)``, Gaussian noise from the second."""
        time_key, noise_key = jax.random.split(key)
        noise = jax.random.normal(noise_key, x0.shape, x0.dtype)
        return self.add_noise(x0, noise, self.training_timesteps(time_key, x0.shape[0]))

    def model_input(self, x_t, timesteps):
        """(x_in, network timesteps): x_t as it is, the timesteps times ``model_timestep_scale``."""
        return x_t, timesteps * self.scheduler.model_timestep_scale


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class SourceDenoiser:
    """D(x, sigma) -> x0 over a published network: ``model.apply(variables, x_in, timesteps,
    conditions)`` with x_in the scheduler's model input and timesteps its values at sigma (times the
    pipeline's ``model_timestep_scale``). A pytree over variables and conditions, like `Denoiser`."""

    model: Any
    scheduler: SourceScheduler
    variables: Any
    conditions: Any = None

    @property
    def process(self) -> SourceProcess:
        return self.scheduler.process

    def __call__(self, x, sigma, conditions=None):
        conditions = self.conditions if conditions is None else conditions
        sigma = jnp.broadcast_to(jnp.asarray(sigma, jnp.float32), x.shape[:1])
        timesteps = self.scheduler.timestep_of(sigma) * self.scheduler.model_timestep_scale
        output = self.model.apply(self.variables, self.scheduler.model_input(x, sigma), timesteps, conditions)
        return self.scheduler.denoised(output, x, sigma).astype(x.dtype)

    def tree_flatten(self):
        return (self.variables, self.conditions), (self.model, self.scheduler)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(aux[0], aux[1], *children)
