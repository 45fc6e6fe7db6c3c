"""Record diffusers' image workflows (img2img, inpainting, the SDXL base -> refiner handoff) on the
tiny pipelines of tools/diffusion_pipeline_fixtures.py.

Reads tests/fixtures/pipelines/{sd15,sdxl} and writes tests/fixtures/pipelines/image_workflows/,
read by tests/test_image_workflows.py:

    inpaint_unet/   a 9-channel UNet2DConditionModel (latents, mask, masked-image latents) with the
                    sd15 UNet's structure, for StableDiffusionInpaintPipeline
    refiner/        a StableDiffusionXLImg2ImgPipeline with text_encoder_2 only and an aesthetic-score
                    UNet (the released refiner's structure); its vae, text_encoder_2, tokenizer_2 and
                    scheduler folders are links to sdxl's
    reference.npz   inputs: image (uint8 [2, 16, 16, 3]), mask ([2, 16, 16, 1], 1 = repaint),
                    sd15_noise, sdxl_noise, sdxl_latents (the base's starting latents), and
                    sd15_image_latents (the scaled posterior mean of image); outputs <case>/latents
                    (output_type="latent") and <case>/images ("np", [0, 1]) for
                    sd15_img2img (DDIM, strength 0.6), sd15_img2img_negative (the same with a
                    negative prompt; latents only), sd15_inpaint9 (strength 1), sd15_inpaint4 (the
                    sd15 UNet's blend, strength 0.8), sdxl_img2img (Euler, strength 0.6), sdxl_base
                    (denoising_end 0.6; latents only) and sdxl_refiner (denoising_start 0.6)

Every case uses guidance GUIDANCE. The pipelines draw their VAE posterior samples and noise from a
torch generator, which Dew cannot replay, so the recording swaps both for fixed values: the
posterior mean (Dew's encode_key=None) and the saved noise arrays (Dew's noise=).

    .venv-ref/bin/python tools/image_workflow_fixtures.py
"""

from __future__ import annotations

import pathlib
import shutil

import diffusers
import numpy as np
import torch
from diffusers.pipelines.stable_diffusion import pipeline_stable_diffusion_img2img as sd_img2img
from diffusers.pipelines.stable_diffusion import pipeline_stable_diffusion_inpaint as sd_inpaint
from diffusers.pipelines.stable_diffusion_xl import pipeline_stable_diffusion_xl_img2img as sdxl_img2img

import diffusion_pipeline_fixtures as base

PIPELINES = base.OUT
OUT = PIPELINES / "image_workflows"
PROMPTS = base.PROMPTS[:2]
NEGATIVE = "a photo of a dog"
GUIDANCE = 5.0
SD_STEPS = 5
STRENGTH = 0.6
INPAINT_BLEND_STRENGTH = 0.8
SDXL_STEPS = 6
HANDOFF = 0.6  # the base's denoising_end and the refiner's denoising_start
SIDE = base.SIDE
SHARED = ("vae", "text_encoder_2", "tokenizer_2", "scheduler")  # refiner folders linked to sdxl's


def posterior_mean(encoder_output, generator=None, sample_mode="sample"):
    return encoder_output.latent_dist.mode()


def fixed_noise(noise):
    def draw(shape, generator=None, device=None, dtype=None, layout=None):
        assert tuple(shape) == tuple(noise.shape), (shape, noise.shape)
        return noise.clone()
    return draw


def inputs():
    rng = np.random.default_rng(7)
    image = rng.integers(0, 256, (2, SIDE, SIDE, 3), dtype=np.uint8)
    mask = np.zeros((2, SIDE, SIDE, 1), np.float32)
    mask[0, 4:12, 2:10] = 1.0
    mask[1, :, 8:] = 1.0
    generator = torch.Generator().manual_seed(99)
    noise = torch.randn((2, 4, SIDE // 2, SIDE // 2), generator=generator)
    sdxl_noise = torch.randn((2, 4, SIDE // 2, SIDE // 2), generator=generator)
    sdxl_latents = torch.randn((2, 4, SIDE // 2, SIDE // 2), generator=generator)
    return image, mask, noise, sdxl_noise, sdxl_latents


def run(pipe, output_types=("latent", "np"), **options):
    out = {}
    for output_type in output_types:
        with torch.no_grad():
            result = pipe(**options, guidance_scale=GUIDANCE, output_type=output_type,
                          generator=torch.Generator().manual_seed(0)).images
        out["latents" if output_type == "latent" else "images"] = np.asarray(result, np.float32)
    return out


def inpaint_unet(sd15_unet):
    config = dict(sd15_unet.config)
    config["in_channels"] = 9
    unet = diffusers.UNet2DConditionModel.from_config(config)
    base.randomize(unet, 11)
    return unet


def refiner(sdxl):
    unet = diffusers.UNet2DConditionModel(
        sample_size=SIDE // 2, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(16, 16),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 1), attention_head_dim=(2, 4), use_linear_projection=True,
        addition_embed_type="text_time", addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=5 * 8 + sdxl.text_encoder_2.config.projection_dim,
        cross_attention_dim=sdxl.text_encoder_2.config.hidden_size, norm_num_groups=8)
    base.randomize(unet, 12)
    return diffusers.StableDiffusionXLImg2ImgPipeline(
        vae=sdxl.vae, text_encoder=None, text_encoder_2=sdxl.text_encoder_2, tokenizer=None,
        tokenizer_2=sdxl.tokenizer_2, unet=unet, scheduler=sdxl.scheduler, requires_aesthetics_score=True,
        force_zeros_for_empty_prompt=False)


def main():
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    for module in (sd_img2img, sd_inpaint, sdxl_img2img):
        module.retrieve_latents = posterior_mean
    image, mask, noise, sdxl_noise, sdxl_latents = inputs()
    pixels = image.astype(np.float32) / 255.0
    arrays = dict(image=image, mask=mask, sd15_noise=noise.numpy(), sdxl_noise=sdxl_noise.numpy(),
                  sdxl_latents=sdxl_latents.numpy())

    sd15 = diffusers.StableDiffusionPipeline.from_pretrained(PIPELINES / "sd15", torch_dtype=torch.float32)
    scheduler = diffusers.DDIMScheduler.from_config(sd15.scheduler.config, clip_sample=False)
    with torch.no_grad():
        encoded = sd15.vae.encode(torch.from_numpy(pixels * 2 - 1).permute(0, 3, 1, 2)).latent_dist.mean
    arrays["sd15_image_latents"] = (encoded * sd15.vae.config.scaling_factor).numpy()

    img2img = diffusers.StableDiffusionImg2ImgPipeline(**{**sd15.components, "scheduler": scheduler})
    img2img.set_progress_bar_config(disable=True)
    sd_img2img.randn_tensor = fixed_noise(noise)
    common = dict(prompt=PROMPTS, image=pixels, strength=STRENGTH, num_inference_steps=SD_STEPS)
    for key, value in run(img2img, **common).items():
        arrays[f"sd15_img2img/{key}"] = value
    for key, value in run(img2img, ("latent",), **common, negative_prompt=[NEGATIVE] * 2).items():
        arrays[f"sd15_img2img_negative/{key}"] = value

    sd_inpaint.randn_tensor = fixed_noise(noise)
    unet9 = inpaint_unet(sd15.unet)
    unet9.save_pretrained(OUT / "inpaint_unet", safe_serialization=True)
    unet9 = diffusers.UNet2DConditionModel.from_pretrained(OUT / "inpaint_unet")
    for label, unet, strength in (("sd15_inpaint9", unet9, 1.0), ("sd15_inpaint4", sd15.unet, INPAINT_BLEND_STRENGTH)):
        inpaint = diffusers.StableDiffusionInpaintPipeline(**{**sd15.components, "unet": unet, "scheduler": scheduler})
        inpaint.set_progress_bar_config(disable=True)
        for key, value in run(inpaint, prompt=PROMPTS, image=pixels, mask_image=mask, strength=strength,
                              num_inference_steps=SD_STEPS, height=SIDE, width=SIDE).items():
            arrays[f"{label}/{key}"] = value

    sdxl = diffusers.StableDiffusionXLPipeline.from_pretrained(PIPELINES / "sdxl", torch_dtype=torch.float32)
    sdxl.set_progress_bar_config(disable=True)
    sdxl_img2img.randn_tensor = fixed_noise(sdxl_noise)
    img2img = diffusers.StableDiffusionXLImg2ImgPipeline(**sdxl.components)
    img2img.set_progress_bar_config(disable=True)
    for key, value in run(img2img, prompt=PROMPTS, image=pixels, strength=STRENGTH,
                          num_inference_steps=SDXL_STEPS).items():
        arrays[f"sdxl_img2img/{key}"] = value

    with torch.no_grad():
        handed = sdxl(prompt=PROMPTS, latents=sdxl_latents.clone(), num_inference_steps=SDXL_STEPS,
                      guidance_scale=GUIDANCE, height=SIDE, width=SIDE, denoising_end=HANDOFF,
                      output_type="latent").images
    arrays["sdxl_base/latents"] = handed.numpy()
    stage_two = refiner(sdxl)
    stage_two.save_pretrained(OUT / "refiner", safe_serialization=True)
    for shared in SHARED:  # the same files as sdxl's: linked, not copied
        shutil.rmtree(OUT / "refiner" / shared)
        (OUT / "refiner" / shared).symlink_to(pathlib.Path("../../sdxl") / shared, target_is_directory=True)
    stage_two = diffusers.StableDiffusionXLImg2ImgPipeline.from_pretrained(OUT / "refiner", torch_dtype=torch.float32)
    stage_two.set_progress_bar_config(disable=True)
    for key, value in run(stage_two, prompt=PROMPTS, image=handed, num_inference_steps=SDXL_STEPS,
                          denoising_start=HANDOFF).items():
        arrays[f"sdxl_refiner/{key}"] = value

    np.savez_compressed(OUT / "reference.npz", **arrays)
    size = sum(path.stat().st_size for path in OUT.rglob("*") if path.is_file())
    print(f"image_workflows: {size / 1024:.0f} KiB; " + ", ".join(f"{k} {v.shape}" for k, v in arrays.items()))


if __name__ == "__main__":
    main()
