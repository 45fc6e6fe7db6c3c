"""Build tiny diffusers SD3Transformer2DModels and record what diffusers computes with them.

Writes one directory per variant under tests/fixtures/sd3_transformer/, read by
tests/test_sd3_transformer.py:

    config.json, diffusion_pytorch_model.safetensors   (save_pretrained, float32)
    reference.npz   latents [2, H, W, 16] (NHWC, Dew's layout), encoder_hidden_states [2, 6, 32],
                    pooled_projections [2, 32], timesteps [2 calls, 2] (sigma * 1000, as the SD3
                    pipeline passes them), outputs [2 calls, 2, H, W, 16]; the same again with a
                    ``wide_`` prefix for a non-square latent (8 x 12: a 4 x 6 token grid), so the
                    cropped position table's row / column order is pinned down.

The structures are the released ones at small widths (attention_head_dim 8, joint_attention_dim
and pooled_projection_dim 32, pos_embed_max_size 16, sample_size 8):

    "sd3"   SD3-medium: plain joint blocks, no q/k norm; 2 layers, 4 heads (inner width 32), the
            last block's text stream context_pre_only.
    "sd35"  SD3.5-medium: qk_norm "rms_norm" (q, k and the text stream's added q, k) and
            dual_attention_layers (0,) (an extra image self-attention in block 0); 3 layers,
            2 heads (inner width 16).

RMSNorm weights are moved off 1 so that a missing or misplaced q/k norm changes the outputs far
beyond the test tolerance.

Run with the reference environment (torch CPU + diffusers), not Dew's:

    .venv-ref/bin/python tools/sd3_transformer_fixtures.py
"""

from __future__ import annotations

import pathlib
import shutil

import numpy as np
import torch
from diffusers import SD3Transformer2DModel
from diffusers.models.normalization import RMSNorm

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests/fixtures/sd3_transformer"

COMMON = dict(sample_size=8, patch_size=2, in_channels=16, out_channels=16, attention_head_dim=8,
              joint_attention_dim=32, pooled_projection_dim=32, pos_embed_max_size=16)
FIXTURES = {
    "sd3": dict(COMMON, num_layers=2, num_attention_heads=4, caption_projection_dim=32),
    "sd35": dict(COMMON, num_layers=3, num_attention_heads=2, caption_projection_dim=16,
                 qk_norm="rms_norm", dual_attention_layers=(0,)),
}
TEXT_TOKENS = 6
TIMESTEPS = np.array([[1000.0, 562.5], [37.5, 250.0]], np.float32)  # two calls, one per row


def build(settings, seed):
    torch.manual_seed(seed)
    model = SD3Transformer2DModel(**settings).to(torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RMSNorm) and module.weight is not None:
                module.weight.copy_(1.0 + 0.3 * torch.randn(module.weight.shape, generator=generator))
    return model


def run(model, latents, text, pooled):
    """Outputs [calls, B, H, W, C] for each row of TIMESTEPS; latents are NHWC."""
    outputs = []
    with torch.no_grad():
        for timesteps in TIMESTEPS:
            out = model(
                hidden_states=torch.from_numpy(latents.transpose(0, 3, 1, 2).copy()),
                encoder_hidden_states=torch.from_numpy(text),
                pooled_projections=torch.from_numpy(pooled),
                timestep=torch.from_numpy(timesteps),
                return_dict=False,
            )[0]
            outputs.append(out.numpy().transpose(0, 2, 3, 1))
    return np.stack(outputs).astype(np.float32)


def record(name, seed):
    settings = FIXTURES[name]
    model = build(settings, seed)
    directory = OUT / name
    shutil.rmtree(directory, ignore_errors=True)
    model.save_pretrained(directory, safe_serialization=True)

    rng = np.random.default_rng(seed)
    arrays = {"timesteps": TIMESTEPS}
    for prefix, (height, width) in (("", (8, 8)), ("wide_", (8, 12))):
        latents = rng.standard_normal((2, height, width, settings["in_channels"])).astype(np.float32)
        text = rng.standard_normal((2, TEXT_TOKENS, settings["joint_attention_dim"])).astype(np.float32)
        pooled = rng.standard_normal((2, settings["pooled_projection_dim"])).astype(np.float32)
        arrays.update({f"{prefix}latents": latents, f"{prefix}encoder_hidden_states": text,
                       f"{prefix}pooled_projections": pooled,
                       f"{prefix}outputs": run(model, latents, text, pooled)})
    np.savez_compressed(directory / "reference.npz", **arrays)
    size = sum(path.stat().st_size for path in directory.iterdir())
    print(f"{name}: {size / 1024:.0f} KiB, output spread {arrays['outputs'].std():.3f}")


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    for seed, name in enumerate(FIXTURES):
        record(name, seed)


if __name__ == "__main__":
    main()
