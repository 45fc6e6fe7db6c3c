"""Build tiny diffusers UNet2DConditionModels and record what diffusers computes with them.

Writes one directory per structure under tests/fixtures/unet_condition/, read by
tests/test_unet_condition.py:

    config.json, diffusion_pytorch_model.safetensors   (save_pretrained, float32)
    reference.npz   sample [2, 8, 8, 4] latents, timesteps [2] (one whole, one fractional),
                    encoder_hidden_states [2, 5, 16], SDXL's text_embeds [2, 12] and time_ids
                    [2, 6], and the model's output [2, 8, 8, 4]; "sd15" also holds odd_sample
                    [2, 7, 9, 4] and odd_output (the path where an upsampler matches its skip's size)

Arrays are NHWC, Dew's layout. The structures are the released ones at small widths:

    "sd15"  SD 1.x: CrossAttnDownBlock2D then DownBlock2D (UpBlock2D then CrossAttnUpBlock2D),
            conv proj_in/proj_out, one int head count for every block.
    "sd21"  SD 2.x: as sd15 but linear projections, a head count per block and upcast_attention.
    "sdxl"  SDXL: DownBlock2D then two CrossAttnDownBlock2D, linear projections,
            2 layers per block, transformer_layers_per_block [1, 1, 2], and the text_time added embedding of a pooled
            text vector and six size/crop ids.

Norm scales and biases are moved off 1 and 0 so that a wrong eps, a missing affine or a wrong
group count changes the outputs far beyond the test tolerance.

Run with the reference environment (torch CPU + diffusers), not Dew's:

    .venv-ref/bin/python tools/unet_condition_fixtures.py
"""

from __future__ import annotations

import pathlib
import shutil

import numpy as np
import torch
from diffusers import UNet2DConditionModel

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests/fixtures/unet_condition"
CROSS = 16  # cross_attention_dim: the text encoder's width
POOLED = 12  # SDXL: the pooled text embedding's width
TIME_ID = 4  # SDXL: addition_time_embed_dim

COMMON = dict(sample_size=8, in_channels=4, out_channels=4, norm_num_groups=4, cross_attention_dim=CROSS)
FIXTURES = {
    "sd15": dict(
        block_out_channels=(8, 16), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), layers_per_block=1, attention_head_dim=2, **COMMON,
    ),
    "sd21": dict(
        block_out_channels=(8, 16), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), layers_per_block=1, attention_head_dim=(2, 4),
        use_linear_projection=True, upcast_attention=True, **COMMON,
    ),
    "sdxl": dict(
        block_out_channels=(8, 8, 16), layers_per_block=2,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 2, 4), transformer_layers_per_block=(1, 1, 2), use_linear_projection=True,
        addition_embed_type="text_time", addition_time_embed_dim=TIME_ID,
        projection_class_embeddings_input_dim=POOLED + 6 * TIME_ID, **COMMON,
    ),
}
TIMESTEPS = np.array([999.0, 37.5], np.float32)


def build(settings, seed):
    torch.manual_seed(seed)
    model = UNet2DConditionModel(**settings).to(torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if "norm" in name and name.endswith(".weight"):
                tensor.copy_(1.0 + 0.3 * torch.randn(tensor.shape, generator=generator))
            elif "norm" in name and name.endswith(".bias"):
                tensor.copy_(0.2 * torch.randn(tensor.shape, generator=generator))
    return model


def nchw(array):
    return torch.from_numpy(np.ascontiguousarray(array.transpose(0, 3, 1, 2)))


def nhwc(tensor):
    return np.ascontiguousarray(tensor.numpy().astype(np.float32).transpose(0, 2, 3, 1))


def record(name, seed):
    model = build(FIXTURES[name], seed)
    directory = OUT / name
    shutil.rmtree(directory, ignore_errors=True)
    model.save_pretrained(directory, safe_serialization=True)

    rng = np.random.default_rng(seed)
    arrays = {
        "sample": rng.standard_normal((2, 8, 8, 4)).astype(np.float32),
        "timesteps": TIMESTEPS,
        "encoder_hidden_states": rng.standard_normal((2, 5, CROSS)).astype(np.float32),
    }
    added = None
    if name == "sdxl":
        arrays["text_embeds"] = rng.standard_normal((2, POOLED)).astype(np.float32)
        arrays["time_ids"] = np.array([[1024, 1024, 0, 0, 1024, 1024], [768, 512, 16, 32, 768, 512]], np.float32)
        added = {key: torch.from_numpy(arrays[key]) for key in ("text_embeds", "time_ids")}

    def run(sample):
        with torch.no_grad():
            return nhwc(model(nchw(sample), torch.from_numpy(TIMESTEPS),
                              torch.from_numpy(arrays["encoder_hidden_states"]), added_cond_kwargs=added).sample)

    arrays["output"] = run(arrays["sample"])
    if name == "sd15":
        arrays["odd_sample"] = rng.standard_normal((2, 7, 9, 4)).astype(np.float32)
        arrays["odd_output"] = run(arrays["odd_sample"])
    np.savez_compressed(directory / "reference.npz", **arrays)
    size = sum(path.stat().st_size for path in directory.iterdir())
    print(f"{name}: {size / 1024:.0f} KiB, output std {arrays['output'].std():.3f}")


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    for seed, name in enumerate(FIXTURES):
        record(name, seed)


if __name__ == "__main__":
    main()
