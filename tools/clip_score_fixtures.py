"""Build a tiny CLIPModel with its tokenizer and record what transformers computes for CLIPScore.

Writes tests/fixtures/clip/, read by tests/test_clip_score.py:

    config.json, model.safetensors          (CLIPModel.save_pretrained, float32: both towers,
                                             both projections and logit_scale)
    tokenizer.json, tokenizer_config.json   (the CLIP BPE tokenizer of tools/text_encoder_fixtures.py)
    reference.npz
        images_a [4, 40, 48, 3], images_b [2, 24, 24, 3]   smooth random images, float32 in Dew's
                 [-1, 1] range, two batches of one pass: the first shrinks to the tower's 32 pixels,
                 the second grows
        prompts  the 6 captions, one per image
        pixels_a, pixels_b   CLIP's preprocessing of each batch (`preprocess`), as transformers'
                 CLIPImageProcessor does it with its torchvision backend on the images scaled to
                 0..255 floats: the shorter side resized to 32 (bicubic, antialiased), the centre
                 32 x 32 cropped, rescaled by 1/255 and normalized with CLIP's mean and std
        input_ids [6, 16]    the prompts through the tokenizer (padding="max_length")
        image_embeds, text_embeds [6, 24]   CLIPModel.get_image_features / get_text_features
                 (projected, not normalized)
        pooled_image [6, 32]  the vision tower's pooler_output (post-layernorm class token)
        logits_per_image [6, 6]   CLIPModel's forward: logit_scale.exp() * cosines
        scores [6]   100 * max(cos(image_embeds, text_embeds), 0) per pair, computed here from the
                 CLIPModel outputs (torchmetrics is not installed in the reference environment)
        clip_score   their mean: the pass's CLIPScore

The structure is CLIPModel's released one (OpenAI ViT-B/16 and ViT-L/14: quick_gelu, class token,
pre- and post-layernorm) at small widths. Weights are drawn wider than the initializers and norm
weights moved off 1, so a wrong normalization or pooling changes the scores far beyond the tolerance.

Run with the reference environment (torch CPU + transformers), not Dew's:

    .venv-ref/bin/python tools/clip_score_fixtures.py
"""

from __future__ import annotations

import pathlib
import shutil

import numpy as np
import torch
import transformers
from text_encoder_fixtures import MAX_LENGTH, WEIGHT_STD, clip_tokenizer

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests/fixtures/clip"
IMAGE_SIZE = 32
PROMPTS = [
    "a handwritten seven",
    "a photo of a cat",
    "a painting of a flower",
    "the digit 3",
    "a drawing of a house",
    "a photo of a dog",
]


def clip_model(tokenizer):
    text = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=MAX_LENGTH, hidden_act="quick_gelu",
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  image_size=IMAGE_SIZE, patch_size=8, hidden_act="quick_gelu")
    config = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=24)
    return transformers.CLIPModel(config)


def randomize(model, generator):
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name == "logit_scale":
                continue
            if ("norm" in name or "layrnorm" in name) and name.endswith("weight"):
                tensor.copy_(1.0 + 0.2 * torch.randn(tensor.shape, generator=generator))
            else:
                tensor.copy_(WEIGHT_STD * torch.randn(tensor.shape, generator=generator))


def preprocess(images):
    """Dew's [-1, 1] images [B, H, W, 3] -> CLIP pixels [B, 3, S, S], as transformers'
    CLIPImageProcessor does it with its torchvision backend on float images: the shorter side to
    IMAGE_SIZE (the longer one int(IMAGE_SIZE * long / short)), bicubic with antialiasing and no
    clamping, torchvision's centre crop, values / 255, then CLIP's mean and std."""
    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    x = torch.from_numpy((images + 1.0) * 127.5).permute(0, 3, 1, 2)
    height, width = x.shape[-2:]
    short, long = min(height, width), max(height, width)
    resized_long = int(IMAGE_SIZE * long / short)
    size = (IMAGE_SIZE, resized_long) if height <= width else (resized_long, IMAGE_SIZE)
    x = torch.nn.functional.interpolate(x, size=size, mode="bicubic", antialias=True, align_corners=False)
    top = int(round((size[0] - IMAGE_SIZE) / 2.0))
    left = int(round((size[1] - IMAGE_SIZE) / 2.0))
    x = x[..., top:top + IMAGE_SIZE, left:left + IMAGE_SIZE] / 255.0
    mean = torch.tensor(OPENAI_CLIP_MEAN).reshape(1, 3, 1, 1)
    std = torch.tensor(OPENAI_CLIP_STD).reshape(1, 3, 1, 1)
    return ((x - mean) / std).to(torch.float32)


def pil_processor_gap(images, pixels):
    """The largest gap to CLIPImageProcessor's PIL backend on the images rounded to uint8: small
    (rounding to whole levels only), so the geometry and constants above are CLIP's."""
    processor = transformers.CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                                crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    as_uint8 = np.round((images + 1.0) * 127.5).astype(np.uint8)
    reference = processor(images=list(as_uint8), return_tensors="pt")["pixel_values"]
    return float((reference - pixels).abs().max())


def smooth_images(rng, shape):
    """Images [B, H, W, 3] in [-1, 1]: random 4 x 4 colour fields, bilinearly enlarged (smooth as photos
    are, so the bicubic resize stays near the PIL processor's, which clamps the overshoot of noise)."""
    low = torch.from_numpy(rng.uniform(-1, 1, (shape[0], 3, 4, 4)).astype(np.float32))
    smooth = torch.nn.functional.interpolate(low, size=shape[1:3], mode="bilinear", align_corners=False)
    return smooth.permute(0, 2, 3, 1).numpy()


def build(seed):
    """The model, images and everything recorded for one seed."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    tokenizer = clip_tokenizer("<|endoftext|>")
    model = clip_model(tokenizer).to(torch.float32).eval()
    randomize(model, generator)
    rng = np.random.default_rng(seed)
    images_a, images_b = smooth_images(rng, (4, 40, 48, 3)), smooth_images(rng, (2, 24, 24, 3))
    pixels_a, pixels_b = preprocess(images_a), preprocess(images_b)
    pixels = torch.cat([pixels_a, pixels_b])
    ids = tokenizer(PROMPTS, padding="max_length", max_length=MAX_LENGTH, truncation=True, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        image_embeds = model.get_image_features(pixel_values=pixels).pooler_output
        pooled_image = model.vision_model(pixel_values=pixels).pooler_output
        text_embeds = model.get_text_features(input_ids=ids).pooler_output
        logits_per_image = model(input_ids=ids, pixel_values=pixels).logits_per_image
    image_unit = image_embeds / image_embeds.norm(dim=-1, keepdim=True)
    text_unit = text_embeds / text_embeds.norm(dim=-1, keepdim=True)
    cosines = (image_unit * text_unit).sum(-1)
    scores = 100.0 * torch.clamp(cosines, min=0.0)
    arrays = dict(images_a=images_a, images_b=images_b, prompts=np.asarray(PROMPTS),
                  pixels_a=pixels_a.permute(0, 2, 3, 1).numpy(), pixels_b=pixels_b.permute(0, 2, 3, 1).numpy(),
                  input_ids=ids.numpy().astype(np.int32), image_embeds=image_embeds.numpy(),
                  text_embeds=text_embeds.numpy(), pooled_image=pooled_image.numpy(),
                  logits_per_image=logits_per_image.numpy(), scores=scores.numpy(),
                  clip_score=np.float32(scores.mean()))
    gaps = [pil_processor_gap(images, pixels) for images, pixels in ((images_a, pixels_a), (images_b, pixels_b))]
    return tokenizer, model, arrays, cosines.numpy(), max(gaps)


def main():
    # the first seed whose pairs have cosines of both signs, so the clamp at 0 is exercised
    for seed in range(100):
        tokenizer, model, arrays, cosines, gap = build(seed)
        if (cosines > 0.05).sum() >= 2 and (cosines < -0.05).sum() >= 2:
            break
    shutil.rmtree(OUT, ignore_errors=True)
    model.save_pretrained(OUT, safe_serialization=True)
    tokenizer.save_pretrained(OUT)
    np.savez_compressed(OUT / "reference.npz", **arrays)
    size = sum(path.stat().st_size for path in OUT.iterdir())
    print(f"clip (seed {seed}): {size / 1024:.0f} KiB, cosines {np.round(cosines, 3).tolist()}, "
          f"CLIPScore {float(arrays['clip_score']):.4f}, largest gap to the PIL processor {gap:.3f}")


if __name__ == "__main__":
    main()
