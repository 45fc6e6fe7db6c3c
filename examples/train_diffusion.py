"""Text-to-image on scikit-learn's digits, in the latent space of an autoencoder trained here.

Each 8x8 digit is resized to 16x16 and given a caption ("a handwritten seven", "the digit 7", ...).
The program trains in three parts and then draws from the saved run:

1. a small AutoencoderKL on the digits with `VAEObjective` (16x16x1 images -> 8x8x4 latents);
   its latents are scaled to unit variance, as Stable Diffusion scales its VAE's;
2. a text encoder: a small CLIP text tower built from a config, with random frozen weights (each
   prompt still gets a distinct encoding) and a word-level tokenizer over the captions' words, or
   a pretrained transformers CLIP directory passed with --text-encoder;
3. a latent MMDiT conditioned on the encoded captions (`TextCondition`), trained as a
   `DiffusionRunConfig` run and saved with its encoder and autoencoder beside run.json.

`dew.pipeline(run)` then reloads the run alone and draws a grid of prompts x samples to
<out>/samples.png. A classifier fitted on the real digits reads each drawn digit, so the printout
says how often the image shows the digit its prompt names, with guidance and without.

    python examples/train_diffusion.py              # about 16 minutes on 2 shared CPU cores
    python examples/train_diffusion.py --smoke      # a tiny run, seconds
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import dew
from dew import Checkpoints, Dataset, Field, InputSpec, Trainer
from dew.config import ModelConfig, TrainerConfig
from dew.data import Digits
from dew.diffusion import presets
from dew.eval.image_metrics import image_grid
from dew.files import write_atomic
from dew.interop.autoencoders import PretrainedAutoencoder
from dew.interop.text_encoders import PretrainedTextEncoder
from dew.nn.backbones.mmdit import MMDiT
from dew.nn.text_encoders.clip import CLIPTextEncoder
from dew.nn.vae import AutoencoderKL
from dew.objectives.diffusion import DiffusionRunConfig
from dew.objectives.text_condition import TextCondition
from dew.objectives.vae import VAEObjective
from dew.pixels import png_bytes
from dew.sampling import CFG, Heun

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
TEMPLATES = ["a handwritten {word}", "the digit {digit}", "a drawing of the number {word}", "{word}"]
IMAGE_SIZE = 16
MAX_LENGTH = 8  # caption length in tokens: <start> + at most six words + <end>


def caption(label: int, index: int) -> str:
    """The caption of the `index`-th image, a digit `label`: the templates in turn."""
    return TEMPLATES[index % len(TEMPLATES)].format(word=WORDS[label], digit=label)


def digits():
    """All digits as uint8 [N, 16, 16, 1] and their labels."""
    return Digits(image_size=IMAGE_SIZE, channels=1).arrays()


# --- 1. the autoencoder -----------------------------------------------------------------------------


def train_autoencoder(images: np.ndarray, *, steps: int, width: int, batch: int, seed: int) -> PretrainedAutoencoder:
    """An AutoencoderKL trained on `images`, its latents scaled to unit variance."""
    model = AutoencoderKL(in_channels=1, out_channels=1, block_out_channels=(width, width), layers_per_block=1,
                          latent_channels=4, norm_num_groups=8, mid_block_add_attention=False, scaling_factor=1.0)
    objective = VAEObjective(model, InputSpec(Field("image", images.shape[1:])), kl_weight=1e-4)
    data = Dataset.from_records({"image": images}, batch=batch, seed=seed)
    state = Trainer(objective, optax.adam(2e-3), key=jax.random.key(seed)).fit(data, steps=steps, log_every=max(steps // 4, 1))
    trained = PretrainedAutoencoder.from_model(model, state.variables)
    scale = 1.0 / float(jnp.std(trained.encode(jnp.asarray(images[:512], jnp.float32) / 127.5 - 1.0)))
    return PretrainedAutoencoder.from_model(model.clone(scaling_factor=scale), state.variables)


# --- 2. the text encoder ----------------------------------------------------------------------------


def word_tokenizer(directory: Path) -> Path:
    """A CLIP-style word-level tokenizer over the captions' words, written as tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = sorted({word for label in range(10) for i in range(len(TEMPLATES)) for word in caption(label, i).split()})
    vocab = {"<|unknown|>": 0, **{word: i + 1 for i, word in enumerate(words)}}
    start, end = len(vocab), len(vocab) + 1
    vocab.update({"<|startoftext|>": start, "<|endoftext|>": end})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|unknown|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A <|endoftext|>", special_tokens=[("<|startoftext|>", start), ("<|endoftext|>", end)])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    settings = {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                "model_max_length": MAX_LENGTH}
    write_atomic(directory / "tokenizer_config.json", json.dumps(settings, indent=2) + "\n")
    return directory


def text_encoder(source: str | None, out: Path, *, width: int, seed: int) -> PretrainedTextEncoder:
    """A pretrained CLIP text directory, or a small CLIP text tower with random weights."""
    if source is not None:
        return PretrainedTextEncoder.load(source)
    from dew.data.caption_tokens import CaptionTokens

    tokens = CaptionTokens(word_tokenizer(out / "tokenizer"), MAX_LENGTH)
    model = CLIPTextEncoder(vocab_size=tokens.tokenizer.vocab_size, hidden_size=width, intermediate_size=2 * width,
                            num_layers=1, num_heads=2, max_position_embeddings=MAX_LENGTH,
                            eos_token_id=tokens.tokenizer.eos_id)
    variables = model.init(jax.random.key(seed), jnp.zeros((1, MAX_LENGTH), jnp.int32))
    return PretrainedTextEncoder(model=model, variables=variables, tokens=tokens)


# --- 3. the latent diffusion run --------------------------------------------------------------------


def digit_classifier(images: np.ndarray, labels: np.ndarray):
    from sklearn.linear_model import LogisticRegression

    return LogisticRegression(max_iter=2000).fit(images.reshape(len(images), -1) / 255.0, labels)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny models and a few steps")
    parser.add_argument("--out", default="runs/digits-text", help="where the run and samples.png go")
    parser.add_argument("--text-encoder", default=None, help="a transformers CLIP text directory (default: a small random one)")
    parser.add_argument("--vae-steps", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="diffusion training steps")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--samples", type=int, default=None, help="images drawn per prompt")
    parser.add_argument("--guidance", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    smoke = args.smoke
    vae_steps = args.vae_steps or (3 if smoke else 1500)
    steps = args.steps or (3 if smoke else 4000)
    samples = args.samples or (2 if smoke else 10)
    batch = 8 if smoke else args.batch
    out = Path(args.out)
    run = out / "run"

    images, labels = digits()
    autoencoder = train_autoencoder(images, steps=vae_steps, width=8 if smoke else 32, batch=batch, seed=args.seed)
    encoder = text_encoder(args.text_encoder, out, width=16 if smoke else 64, seed=args.seed)
    condition = TextCondition(encoder, pooled="pooled")
    width = encoder.model.hidden_size
    config = DiffusionRunConfig(
        model=ModelConfig.from_model(MMDiT(patch_size=2, emb_features=32 if smoke else 128, num_layers=1 if smoke else 4,
                                           num_heads=2 if smoke else 4, text_features=width, condition_features=width)),
        data=Digits(image_size=IMAGE_SIZE, channels=1),
        trainer=TrainerConfig(checkpoint_dir=str(run), batch_size=batch, steps=steps, keep=1, seed=args.seed),
        preset=presets.Flow(), text=condition, autoencoder=autoencoder, ema_decay=0.999 if not smoke else 0.5,
        solver=Heun(), steps=4 if smoke else 32, guidance=CFG(args.guidance),
    )
    objective = config.build()
    captions = [caption(int(label), index) for index, label in enumerate(labels)]
    data = Dataset.from_records({"image": images, **objective.inputs.tokenize(captions)}, batch=batch, seed=args.seed)
    checkpoints = Checkpoints(str(run), keep=1)
    state = Trainer(objective, optax.adamw(1e-3), key=jax.random.key(args.seed), checkpoints=checkpoints).fit(
        data, steps=steps, log_every=max(steps // 10, 1), checkpoint_every=steps)
    checkpoints.wait()
    config.save(run)

    # the run reloads alone: backbone, text encoder, autoencoder and sampling defaults
    task = dew.pipeline(run)
    prompts = [f"a handwritten {word}" for word in WORDS]
    rows = [prompt for prompt in prompts for _ in range(samples)]
    guided = task(rows, seed=args.seed + 1).host()
    unguided = task(rows, guidance=None, seed=args.seed + 1).host()
    write_atomic(out / "samples.png", png_bytes(image_grid(guided.images, rows=len(prompts))))

    # random frozen weights still tell the prompts apart: each gets its own encoding
    encoded = np.asarray(condition.encode_texts(prompts)["embedding"])
    distinct = len({row.tobytes() for row in np.round(encoded, 5)})

    classifier = digit_classifier(images, labels)
    wanted = np.repeat(np.arange(10), samples)
    scores = {name: float(np.mean(classifier.predict(drawn.uint8().reshape(len(rows), -1) / 255.0) == wanted))
              for name, drawn in (("guided", guided), ("unguided", unguided))}
    result = {"run": str(run), "samples": str(out / "samples.png"), "steps": int(state.updates),
              "prompts": prompts, "per_prompt": samples, "latent_shape": list(guided.latents.shape[1:]), "distinct_prompt_encodings": distinct,
              "prompted_digit_accuracy": scores}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
