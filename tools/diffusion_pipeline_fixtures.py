"""Build tiny random diffusers pipelines with the released component structure and record what
diffusers computes with them.

Writes one pipeline directory per family under tests/fixtures/pipelines/, read by
tests/test_diffusion_pipelines.py:

    sd15/   StableDiffusionPipeline: CLIPTextModel + UNet2DConditionModel + AutoencoderKL + PNDMScheduler
    sdxl/   StableDiffusionXLPipeline: CLIPTextModel + CLIPTextModelWithProjection + UNet (text_time
            added conditions) + AutoencoderKL + EulerDiscreteScheduler, force_zeros_for_empty_prompt
    sd3/    StableDiffusion3Pipeline: 2 x CLIPTextModelWithProjection + T5EncoderModel +
            SD3Transformer2DModel + AutoencoderKL (16 latent channels, shift_factor) + FlowMatchEuler
    flux/   FluxPipeline: CLIPTextModel + T5EncoderModel + FluxTransformer2DModel (guidance embeds) +
            AutoencoderKL (16 channels) + FlowMatchEuler with dynamic shifting

Each holds what `save_pretrained` writes (model_index.json, one folder per component; the CLIP
tokenizers as vocab.json + merges.txt, as the released repositories ship them, the T5 tokenizers as
tokenizer.json) and a reference.npz recorded from the pipeline read back with `from_pretrained`:

    prompt_embeds, negative_prompt_embeds   encode_prompt on PROMPTS (two captions and "") with
                                            classifier-free guidance on and no negative prompt; the
                                            negative (unconditional) rows are all alike, one is kept
    pooled_prompt_embeds, negative_pooled_prompt_embeds   (SDXL, SD3, Flux: pooled only)
    time_ids                               (SDXL) the added time ids of the default image size
    latents                                the fixed starting latents, in the pipeline's own layout
                                           (Flux: packed [B, (H/2)(W/2), 4C])
    <label>/latents, <label>/images        the pipeline's output for the two captions, guidance
                                           GUIDANCE, STEPS steps, seed SEED: output_type="latent"
                                           (Flux: unpacked to [B, C, H, W]) and decoded "np"
                                           [B, H, W, 3] in [0, 1], for the shipped scheduler (label: its class
                                           name) and one more (DDIM, DPM++ multistep, FlowMatchHeun,
                                           FlowMatchEuler with Karras sigmas)

Run with the reference environment (torch CPU + diffusers + transformers), not Dew's:

    .venv-ref/bin/python tools/diffusion_pipeline_fixtures.py
"""

from __future__ import annotations

import json
import pathlib
import shutil

import diffusers
import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests/fixtures/pipelines"
CLIP_LENGTH = 16  # CLIP's context (77 in the releases)
PROMPTS = ["a photo of a cat", "A red flower!", ""]
CORPUS = PROMPTS + [
    "a handwritten zero", "a handwritten seven", "the digit 7, drawn in ink", "a photo of a dog",
    "a painting of a flower", "a drawing of a house", "red green blue yellow white black grey",
    "in the morning light, beside the river", "a small grey stone with long petals",
]
GUIDANCE = 5.0
STEPS = 4
SEED = 0
SIDE = 16  # image side in pixels; the VAE halves it once
WEIGHT_STD = 0.1


# --- tokenizers -----------------------------------------------------------------------------------


def clip_tokenizer(pad_token):
    """A CLIP BPE tokenizer over CORPUS: byte-level symbols with </w>, special tokens last (as CLIP,
    whose legacy eos_token_id 2 pools at the highest id: <|endoftext|>)."""
    trainer_tokenizer = Tokenizer(models.BPE(end_of_word_suffix="</w>"))
    probe = transformers.CLIPTokenizer()
    trainer_tokenizer.normalizer = probe.backend_tokenizer.normalizer
    trainer_tokenizer.pre_tokenizer = probe.backend_tokenizer.pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=300, end_of_word_suffix="</w>", show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    trainer_tokenizer.train_from_iterator(CORPUS, trainer)
    learned = json.loads(trainer_tokenizer.to_str())["model"]
    vocab = dict(learned["vocab"])
    for token in ("<|startoftext|>", "<|endoftext|>", pad_token):  # end of text the highest id, as in CLIP
        if token not in vocab:
            vocab[token] = len(vocab)
    merges = [tuple(pair) if isinstance(pair, list) else tuple(pair.split(" ")) for pair in learned["merges"]]
    tokenizer = transformers.CLIPTokenizer(vocab=vocab, merges=merges, pad_token=pad_token,
                                           model_max_length=CLIP_LENGTH)
    return tokenizer, vocab, merges


def t5_tokenizer(max_length):
    """A T5 Unigram tokenizer over CORPUS: <pad> 0, </s> 1, <unk> 2, as T5's."""
    trainer_tokenizer = Tokenizer(models.Unigram())
    trainer_tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=100, special_tokens=["<pad>", "</s>", "<unk>"],
                                      unk_token="<unk>", show_progress=False)
    trainer_tokenizer.train_from_iterator(CORPUS, trainer)
    vocab = [(piece, float(score)) for piece, score in json.loads(trainer_tokenizer.to_str())["model"]["vocab"]]
    return transformers.T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=max_length)


def write_clip_tokenizer_as_released(directory, tokenizer, vocab, merges):
    """Replace what save_pretrained wrote with the released layout: vocab.json + merges.txt + config."""
    for path in directory.iterdir():
        path.unlink()
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (directory / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(pair) for pair in merges) + "\n")
    config = {"tokenizer_class": "CLIPTokenizer", "model_max_length": CLIP_LENGTH,
              "bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
              "pad_token": tokenizer.pad_token, "do_lower_case": True, "errors": "replace",
              "add_prefix_space": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    special = {key: config[key] for key in ("bos_token", "eos_token", "unk_token", "pad_token")}
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2))


# --- components -----------------------------------------------------------------------------------


def clip_encoder(tokenizer, *, hidden_act, projection, hidden_size=32, projection_dim=32):
    """A CLIP text tower as the releases configure it (legacy eos_token_id 2: pooled at the highest id)."""
    config = transformers.CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=CLIP_LENGTH,
        projection_dim=projection_dim, hidden_act=hidden_act, bos_token_id=0, eos_token_id=2,
        pad_token_id=tokenizer.pad_token_id)
    cls = transformers.CLIPTextModelWithProjection if projection else transformers.CLIPTextModel
    return cls(config)


def t5_encoder(tokenizer, d_model):
    """T5 v1.1 XXL's structure: gated-gelu, untied, relative position buckets."""
    config = transformers.T5Config(vocab_size=len(tokenizer), d_model=d_model, d_kv=8, num_heads=2, d_ff=2 * d_model,
                                   num_layers=2, relative_attention_num_buckets=8,
                                   relative_attention_max_distance=16, feed_forward_proj="gated-gelu",
                                   tie_word_embeddings=False, dropout_rate=0.0)
    return transformers.T5EncoderModel(config)


def autoencoder(latent_channels, scaling_factor, shift_factor=None, quant_convs=True):
    return diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 16), layers_per_block=1,
        latent_channels=latent_channels, norm_num_groups=8, sample_size=SIDE,
        scaling_factor=scaling_factor, shift_factor=shift_factor,
        use_quant_conv=quant_convs, use_post_quant_conv=quant_convs)


SD_SCHEDULER = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                    steps_offset=1, prediction_type="epsilon")


def sd15():
    tokenizer, vocab, merges = clip_tokenizer("<|endoftext|>")
    unet = diffusers.UNet2DConditionModel(
        sample_size=SIDE // 2, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(16, 16),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=2, norm_num_groups=8)
    scheduler = diffusers.PNDMScheduler(skip_prk_steps=True, set_alpha_to_one=False, **SD_SCHEDULER)
    pipe = diffusers.StableDiffusionPipeline(
        vae=autoencoder(4, 0.18215), text_encoder=clip_encoder(tokenizer, hidden_act="quick_gelu", projection=False),
        tokenizer=tokenizer, unet=unet, scheduler=scheduler, safety_checker=None, feature_extractor=None,
        requires_safety_checker=False)
    extra = diffusers.DDIMScheduler.from_config(scheduler.config, clip_sample=False)
    return pipe, {"tokenizer": (vocab, merges)}, ("DDIMScheduler", extra)


def sdxl():
    tokenizer, vocab, merges = clip_tokenizer("<|endoftext|>")
    tokenizer_2, vocab_2, merges_2 = clip_tokenizer("!")
    text_encoder = clip_encoder(tokenizer, hidden_act="quick_gelu", projection=False)
    text_encoder_2 = clip_encoder(tokenizer_2, hidden_act="gelu", projection=True, projection_dim=24)
    unet = diffusers.UNet2DConditionModel(
        sample_size=SIDE // 2, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(16, 16),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 2), attention_head_dim=(2, 4), use_linear_projection=True,
        addition_embed_type="text_time", addition_time_embed_dim=8, projection_class_embeddings_input_dim=6 * 8 + 24,
        cross_attention_dim=64, norm_num_groups=8)
    scheduler = diffusers.EulerDiscreteScheduler(timestep_spacing="leading", interpolation_type="linear",
                                                 use_karras_sigmas=False, **SD_SCHEDULER)
    pipe = diffusers.StableDiffusionXLPipeline(
        vae=autoencoder(4, 0.13025), text_encoder=text_encoder, text_encoder_2=text_encoder_2, tokenizer=tokenizer,
        tokenizer_2=tokenizer_2, unet=unet, scheduler=scheduler, force_zeros_for_empty_prompt=True)
    extra = diffusers.DPMSolverMultistepScheduler.from_config(scheduler.config)
    return pipe, {"tokenizer": (vocab, merges), "tokenizer_2": (vocab_2, merges_2)}, ("DPMSolverMultistepScheduler", extra)


def sd3():
    tokenizer, vocab, merges = clip_tokenizer("<|endoftext|>")
    tokenizer_2, vocab_2, merges_2 = clip_tokenizer("!")
    tokenizer_3 = t5_tokenizer(256)
    transformer = diffusers.SD3Transformer2DModel(
        sample_size=SIDE // 2, patch_size=2, in_channels=16, num_layers=2, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=64, caption_projection_dim=16, pooled_projection_dim=32 + 24,
        out_channels=16, pos_embed_max_size=8)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    pipe = diffusers.StableDiffusion3Pipeline(
        transformer=transformer, scheduler=scheduler, vae=autoencoder(16, 1.5305, 0.0609, quant_convs=False),
        text_encoder=clip_encoder(tokenizer, hidden_act="quick_gelu", projection=True),
        tokenizer=tokenizer,
        text_encoder_2=clip_encoder(tokenizer_2, hidden_act="gelu", projection=True, hidden_size=24, projection_dim=24),
        tokenizer_2=tokenizer_2, text_encoder_3=t5_encoder(tokenizer_3, 64), tokenizer_3=tokenizer_3)
    extra = diffusers.FlowMatchHeunDiscreteScheduler.from_config(scheduler.config)
    return pipe, {"tokenizer": (vocab, merges), "tokenizer_2": (vocab_2, merges_2)}, ("FlowMatchHeunDiscreteScheduler", extra)


def flux():
    tokenizer, vocab, merges = clip_tokenizer("<|endoftext|>")
    tokenizer_2 = t5_tokenizer(512)
    transformer = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
        axes_dims_rope=(4, 6, 6))
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096)
    pipe = diffusers.FluxPipeline(
        scheduler=scheduler, vae=autoencoder(16, 0.3611, 0.1159, quant_convs=False),
        text_encoder=clip_encoder(tokenizer, hidden_act="quick_gelu", projection=False), tokenizer=tokenizer,
        text_encoder_2=t5_encoder(tokenizer_2, 32), tokenizer_2=tokenizer_2, transformer=transformer)
    extra = diffusers.FlowMatchEulerDiscreteScheduler.from_config(scheduler.config, use_karras_sigmas=True)
    return pipe, {"tokenizer": (vocab, merges)}, ("FlowMatchEulerDiscreteScheduler-karras", extra)


FAMILIES = {"sd15": sd15, "sdxl": sdxl, "sd3": sd3, "flux": flux}


# --- recording ------------------------------------------------------------------------------------


def randomize(module, seed):
    """Weights wider than the initializers (zero-initialized output layers included) so that a wrong
    layer, pooling rule or padding changes the outputs far beyond the tolerance."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in module.named_parameters():
            if "norm" in name and name.endswith("weight"):
                tensor.copy_(1.0 + 0.1 * torch.randn(tensor.shape, generator=generator))
            elif "relative_attention_bias" in name:
                tensor.copy_(torch.randn(tensor.shape, generator=generator))
            else:
                tensor.copy_(WEIGHT_STD * torch.randn(tensor.shape, generator=generator))


def first_row(negative):
    """Every row of the unconditional encoding is the same; one is kept (the fixtures stay small)."""
    assert torch.equal(negative, negative[:1].expand_as(negative))
    return negative[:1]


def encoded(name, pipe):
    """encode_prompt on PROMPTS with guidance on, as each pipeline's __call__ runs it."""
    with torch.no_grad():
        if name == "sd15":
            embeds, negative = pipe.encode_prompt(PROMPTS, "cpu", 1, True)
            return dict(prompt_embeds=embeds, negative_prompt_embeds=first_row(negative))
        if name == "flux":
            embeds, pooled, _ = pipe.encode_prompt(PROMPTS, None, device="cpu")
            return dict(prompt_embeds=embeds, pooled_prompt_embeds=pooled)
        embeds, negative, pooled, negative_pooled = pipe.encode_prompt(
            PROMPTS, None, *([None] if name == "sd3" else []), device="cpu", num_images_per_prompt=1,
            do_classifier_free_guidance=True)
        out = dict(prompt_embeds=embeds, negative_prompt_embeds=first_row(negative), pooled_prompt_embeds=pooled,
                   negative_pooled_prompt_embeds=first_row(negative_pooled))
        if name == "sdxl":
            out["time_ids"] = pipe._get_add_time_ids((SIDE, SIDE), (0, 0), (SIDE, SIDE), torch.float32,
                                                     text_encoder_projection_dim=pipe.text_encoder_2.config.projection_dim)
        return out


def starting_latents(name, pipe):
    generator = torch.Generator().manual_seed(1234)
    channels = pipe.vae.config.latent_channels
    side = SIDE // pipe.vae_scale_factor
    latents = torch.randn((2, channels, side, side), generator=generator)
    if name == "flux":
        latents = pipe._pack_latents(latents, 2, channels, side, side)
    return latents


def generated(name, pipe, latents):
    """Latents and decoded images for the first two prompts."""
    options = dict(prompt=PROMPTS[:2], num_inference_steps=STEPS, guidance_scale=GUIDANCE, height=SIDE, width=SIDE)
    results = {}
    for output_type in ("latent", "np"):
        generator = torch.Generator().manual_seed(SEED)
        with torch.no_grad():
            out = pipe(**options, latents=latents.clone(), generator=generator, output_type=output_type).images
        if output_type == "latent" and name == "flux":
            out = pipe._unpack_latents(out, SIDE, SIDE, pipe.vae_scale_factor)
        results["latents" if output_type == "latent" else "images"] = out
    return results


def record(name, seed):
    torch.manual_seed(seed)
    pipe, clip_tokenizers, extra = FAMILIES[name]()
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            randomize(component, seed)
    directory = OUT / name
    shutil.rmtree(directory, ignore_errors=True)
    pipe.save_pretrained(directory, safe_serialization=True)
    for folder, (vocab, merges) in clip_tokenizers.items():
        write_clip_tokenizer_as_released(directory / folder, getattr(pipe, folder), vocab, merges)

    pipe = type(pipe).from_pretrained(directory, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    arrays = encoded(name, pipe)
    latents = starting_latents(name, pipe)
    arrays["latents"] = latents
    for label, scheduler in ((type(pipe.scheduler).__name__, pipe.scheduler), extra):
        pipe.scheduler = scheduler
        for key, value in generated(name, pipe, latents).items():
            arrays[f"{label}/{key}"] = value
    arrays = {key: np.asarray(value, dtype=np.float32) for key, value in arrays.items()}
    np.savez_compressed(directory / "reference.npz", **arrays)
    size = sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())
    print(f"{name}: {size / 1024:.0f} KiB; " + ", ".join(f"{k} {tuple(v.shape)}" for k, v in arrays.items()))


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    for seed, name in enumerate(FAMILIES):
        record(name, seed)


if __name__ == "__main__":
    main()
