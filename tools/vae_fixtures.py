"""Build tiny diffusers AutoencoderKLs and record what diffusers computes with them.

Writes one directory per VAE under tests/fixtures/vae/, read by tests/test_vae.py:

    config.json, diffusion_pytorch_model.safetensors   (save_pretrained, float32)
    reference.npz   images [2, H, W, 3] in [-1, 1]; the posterior's mean and logvar and the
                    latents ((mean - shift_factor) * scaling_factor), all [2, h, w, latent_channels];
                    decoded [2, H, W, 3] (decode(latents / scaling_factor + shift_factor))

Arrays are NHWC, Dew's layout. The structures are the released ones at small widths:

    "sd"    SD / SDXL: three DownEncoderBlock2D levels, 2 ResNet layers per block (3 per decoder
            block), mid-block attention, quant_conv and post_quant_conv, 4 latent channels,
            scaling_factor 0.18215, no shift.
    "flux"  SD3 / Flux: 16 latent channels, no quant convs, scaling_factor 0.3611 and
            shift_factor 0.1159.

GroupNorm scales and biases are moved off 1 and 0 so that a wrong group count or a missing
affine changes the outputs far beyond the test tolerance.

Run with the reference environment (torch CPU + diffusers), not Dew's:

    .venv-ref/bin/python tools/vae_fixtures.py
"""

from __future__ import annotations

import pathlib
import shutil

import numpy as np
import torch
from diffusers import AutoencoderKL

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests/fixtures/vae"

FIXTURES = {
    "sd": dict(
        block_out_channels=(8, 16, 16), down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3, layers_per_block=2, latent_channels=4,
        norm_num_groups=4, scaling_factor=0.18215, sample_size=16,
    ),
    "flux": dict(
        block_out_channels=(8, 8), down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=2, latent_channels=16,
        norm_num_groups=4, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
        use_post_quant_conv=False, sample_size=16,
    ),
}
IMAGE_SIZE = 16


def build(settings, seed):
    torch.manual_seed(seed)
    model = AutoencoderKL(**settings).to(torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if "norm" in name and name.endswith(".weight"):
                tensor.copy_(1.0 + 0.3 * torch.randn(tensor.shape, generator=generator))
            elif "norm" in name and name.endswith(".bias"):
                tensor.copy_(0.2 * torch.randn(tensor.shape, generator=generator))
    return model


def record(name, seed):
    settings = FIXTURES[name]
    model = build(settings, seed)
    directory = OUT / name
    shutil.rmtree(directory, ignore_errors=True)
    model.save_pretrained(directory, safe_serialization=True)

    rng = np.random.default_rng(seed)
    images = rng.uniform(-1.0, 1.0, size=(2, 3, IMAGE_SIZE, IMAGE_SIZE)).astype(np.float32)
    scale = model.config.scaling_factor
    shift = model.config.shift_factor or 0.0
    with torch.no_grad():
        posterior = model.encode(torch.from_numpy(images)).latent_dist
        latents = (posterior.mean - shift) * scale
        decoded = model.decode(latents / scale + shift).sample

    def nhwc(tensor):
        return np.ascontiguousarray(np.asarray(tensor, dtype=np.float32).transpose(0, 2, 3, 1))

    np.savez_compressed(
        directory / "reference.npz", images=nhwc(images), mean=nhwc(posterior.mean),
        logvar=nhwc(posterior.logvar), latents=nhwc(latents), decoded=nhwc(decoded),
    )
    size = sum(path.stat().st_size for path in directory.iterdir())
    print(f"{name}: {size / 1024:.0f} KiB, latents {tuple(latents.shape)}")


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    for seed, name in enumerate(FIXTURES):
        record(name, seed)


if __name__ == "__main__":
    main()
