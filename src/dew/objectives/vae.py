"""Training an AutoencoderKL on images: reconstruction plus a small KL pull towards N(0, I).

Per example, as latent diffusion's autoencoder loss without its perceptual and adversarial terms
(Rombach et al. 2022, appendix G; ``LPIPSWithDiscriminator`` with a fixed unit output variance):

    reconstruction = sum over pixels of |x - decode(z)|      z drawn from the posterior q(z | x)
    kl             = 1/2 sum over latents of (mean^2 + var - 1 - log var)
    loss           = batch mean of (reconstruction + kl_weight * kl)

Both terms are sums, so ``kl_weight`` (1e-6 in the releases) keeps its meaning at any image size.
There is no perceptual (LPIPS) term: no maintained JAX port of its VGG weights exists.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from dew.nn.vae import AutoencoderKL
from dew.objectives.base import Aux, InputSpec, Objective
from dew.pixels import to_unit_range


class VAEObjective(Objective):
    """Trains ``model`` (an `AutoencoderKL`) on the uint8 images of ``inputs``' first field.

    `evaluate` reconstructs from the posterior mean and returns "samples" (reconstructions clipped
    to [-1, 1]) beside "images", so `PSNR` and `SSIM` score reconstructions. `autoencoder(variables)`
    is the trained model bound to its weights, the `Autoencoder` a latent diffusion objective takes.
    """

    def __init__(self, model: AutoencoderKL, inputs: InputSpec, *, kl_weight: float = 1e-6,
                 ema_decay: float | None = None):
        if not isinstance(model, AutoencoderKL):
            raise TypeError(f"VAEObjective trains an AutoencoderKL; got {type(model).__name__}")
        if not isinstance(inputs, InputSpec) or not inputs.fields:
            raise ValueError("VAEObjective needs InputSpec(Field(images, (height, width, channels))).")
        if kl_weight < 0:
            raise ValueError(f"kl_weight must be >= 0; got {kl_weight}")
        self.model = model
        self.inputs = inputs
        self.image_field = inputs.fields[0]
        model.latent_shape(self.image_field.shape)  # raises now when the sides do not divide
        self.kl_weight = kl_weight
        self.ema_decay = ema_decay

    def init(self, key, variables=None):
        if variables is not None:
            return variables
        return self.model.init(key, jnp.zeros((1,) + tuple(self.image_field.shape), jnp.float32))

    def _terms(self, variables, batch, key):
        x = to_unit_range(batch[self.image_field.key])
        reconstruction, mean, logvar = self.model.apply(variables, x, key)
        error = jnp.abs(x - reconstruction).reshape(x.shape[0], -1).sum(axis=1)
        kl = 0.5 * (mean**2 + jnp.exp(logvar) - 1.0 - logvar).reshape(x.shape[0], -1).sum(axis=1)
        return x, reconstruction, error, kl

    def loss(self, variables, batch, step):
        x, _, error, kl = self._terms(variables, batch, step.key)
        loss = jnp.mean(error + self.kl_weight * kl)
        pixels = x[0].size
        return loss, Aux(metrics={"l1": jnp.mean(error) / pixels, "kl": jnp.mean(kl)})

    def evaluate(self, variables, batch, step):
        x, reconstruction, error, kl = self._terms(variables, batch, None)
        return {"loss": jnp.mean(error + self.kl_weight * kl), "l1": jnp.mean(error) / x[0].size,
                "kl": jnp.mean(kl), "samples": jnp.clip(reconstruction, -1.0, 1.0), "images": x}

    def autoencoder(self, variables) -> Any:
        """The model bound to ``variables`` (e.g. ``state.averaged``): encode / decode / latent_shape."""
        params = {"params": variables["params"]}
        return self.model.bind(jax.tree.map(jnp.asarray, params))

    def settings(self) -> dict[str, Any]:
        return {"inputs": self.inputs, "kl_weight": self.kl_weight, "ema_decay": self.ema_decay}
