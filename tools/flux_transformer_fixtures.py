"""Build tiny diffusers FluxTransformer2DModels and record what they compute inside FluxPipeline.

Writes one directory per variant under tests/fixtures/flux_transformer/, read by
tests/test_flux_transformer.py:

    config.json, diffusion_pytorch_model.safetensors   (save_pretrained, float32)
    reference.npz   latents [2, H, W, C] (plain latents, NHWC), encoder_hidden_states [2, L, 32],
                    pooled_projections [2, 32], timesteps [2 calls, 2 samples] (what FluxPipeline
                    passes: t / 1000), guidance [2] ("dev" only), and outputs [2 calls, 2, H, W, C]:
                    the transformer's output on the packed latents, unpacked back to NHWC

The transformer is called exactly as FluxPipeline calls it: latents packed into 2x2 patches
(`FluxPipeline._pack_latents`), image ids from `_prepare_latent_image_ids` on the packed grid, zero
text ids with three axes, and the output unpacked with `_unpack_latents`. The latent grid is not
square (8 x 12), so a transposed packing or a swapped ids axis changes the outputs.

The structures are FLUX.1's at small widths (2 heads of 16, axes_dims_rope (4, 6, 6), text width
32, pooled width 32, 4 latent channels packed into in_channels 16):

    "dev"       guidance_embeds=True (CombinedTimestepGuidanceTextProjEmbeddings), 2 double blocks
    "schnell"   guidance_embeds=False (CombinedTimestepTextProjEmbeddings), 1 double block

both with 2 single-stream blocks. The qk RMSNorm weights are moved off 1 so that a missing norm
weight changes the outputs far beyond the test tolerance.

Run with the reference environment (torch CPU + diffusers), not Dew's:

    .venv-ref/bin/python tools/flux_transformer_fixtures.py
"""

from __future__ import annotations

import pathlib
import shutil

import numpy as np
import torch
from diffusers import FluxPipeline, FluxTransformer2DModel

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests/fixtures/flux_transformer"

STRUCTURE = dict(patch_size=1, in_channels=16, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
                 joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6))
FIXTURES = {
    "dev": dict(STRUCTURE, num_layers=2, guidance_embeds=True),
    "schnell": dict(STRUCTURE, num_layers=1, guidance_embeds=False),
}
LATENT_CHANNELS = 4
HEIGHT, WIDTH = 8, 12  # latent grid (packed: 4 x 6 tokens)
TEXT_TOKENS = 5
TIMESTEPS = np.array([[1.0, 0.75], [0.3, 0.05]], np.float32)  # two calls, one value per sample
GUIDANCE = np.array([3.5, 5.0], np.float32)
VAE_SCALE_FACTOR = 8  # FluxPipeline's: _unpack_latents takes the image size in pixels


def build(settings, seed):
    torch.manual_seed(seed)
    model = FluxTransformer2DModel(**settings).to(torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.split(".")[-2] in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
                tensor.copy_(1.0 + 0.3 * torch.randn(tensor.shape, generator=generator))
    return model


def pipeline_call(model, latents, encoder_hidden_states, pooled_projections, timestep, guidance):
    """The transformer's output for NHWC ``latents`` as FluxPipeline computes it, back in NHWC."""
    batch, height, width, channels = latents.shape
    nchw = torch.from_numpy(np.ascontiguousarray(latents.transpose(0, 3, 1, 2)))
    packed = FluxPipeline._pack_latents(nchw, batch, channels, height, width)
    img_ids = FluxPipeline._prepare_latent_image_ids(batch, height // 2, width // 2, "cpu", torch.float32)
    txt_ids = torch.zeros(encoder_hidden_states.shape[1], 3)
    with torch.no_grad():
        out = model(
            hidden_states=packed,
            timestep=torch.from_numpy(timestep),
            guidance=None if guidance is None else torch.from_numpy(guidance),
            pooled_projections=torch.from_numpy(pooled_projections),
            encoder_hidden_states=torch.from_numpy(encoder_hidden_states),
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]
    out = FluxPipeline._unpack_latents(out, height * VAE_SCALE_FACTOR, width * VAE_SCALE_FACTOR, VAE_SCALE_FACTOR)
    return np.ascontiguousarray(out.numpy().transpose(0, 2, 3, 1))


def record(name, seed):
    settings = FIXTURES[name]
    model = build(settings, seed)
    directory = OUT / name
    shutil.rmtree(directory, ignore_errors=True)
    model.save_pretrained(directory, safe_serialization=True)

    rng = np.random.default_rng(seed)
    latents = rng.standard_normal((2, HEIGHT, WIDTH, LATENT_CHANNELS)).astype(np.float32)
    text = rng.standard_normal((2, TEXT_TOKENS, settings["joint_attention_dim"])).astype(np.float32)
    pooled = rng.standard_normal((2, settings["pooled_projection_dim"])).astype(np.float32)
    guidance = GUIDANCE if settings["guidance_embeds"] else None
    outputs = np.stack([pipeline_call(model, latents, text, pooled, t, guidance) for t in TIMESTEPS])
    arrays = dict(latents=latents, encoder_hidden_states=text, pooled_projections=pooled, timesteps=TIMESTEPS,
                  outputs=outputs)
    if guidance is not None:
        arrays["guidance"] = guidance
    np.savez_compressed(directory / "reference.npz", **arrays)
    size = sum(path.stat().st_size for path in directory.iterdir())
    print(f"{name}: {size / 1024:.0f} KiB, outputs {outputs.shape}, |out| max {np.abs(outputs).max():.3f}")


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    for seed, name in enumerate(FIXTURES):
        record(name, seed)


if __name__ == "__main__":
    main()
