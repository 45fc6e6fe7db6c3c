"""Text-conditioned latent diffusion training: Dew's MMDiT against diffusers' SD3 transformer.

The work is SD3-style rectified-flow training (Esser et al. 2024) of a small joint-attention DiT
on precomputed VAE latents, conditioned on captions that a small frozen CLIP text encoder encodes
inside every step:

- latents: 64 x 64 synthetic images (colored discs on gradients, 2x nearest-upsampled from
  `diffusion_train.py`'s generator) encoded once by the committed tiny SD-layout AutoencoderKL
  (tests/fixtures/vae/sd, diffusers' layout) to 16 x 16 x 4 posterior means times its scaling
  factor, in the parent, so both sides read the same latents;
- captions: a short synthetic caption per image, 32 token ids from the committed tiny CLIP
  tokenizer (tokenized once by Dew's `TextCondition.tokenize`; both sides read the same ids);
  a caption is dropped to the empty caption's ids with probability 0.1 (classifier-free guidance);
- the text encoder: a random `CLIPTextModel` (4 layers, width 128, 4 heads, MLP 512, 32
  positions), built by transformers with a fixed seed and saved once; Dew reads the same directory
  (`PretrainedTextEncoder.load`). Frozen: its last hidden states [B, 32, 128] are the text tokens
  and its pooled (end-of-text) state the pooled vector;
- the transformer: patch 2 (64 image tokens), width 128, 4 joint blocks of 4 heads, MLP x4, the last
  block's text stream stopping after its keys and values (SD3); t ~ logit-normal(0, 1),
  x_t = (1 - t) x0 + t eps, the loss is the mean squared error of the velocity eps - x0;
- AdamW (lr 1e-4, betas (0.9, 0.999), eps 1e-8, weight decay 0.01, no clipping) and a parameter
  EMA of 0.999 updated every step, on both sides.

Dew trains `MMDiT(text_features=128, condition_features=128)` with `Trainer` +
`DiffusionObjective(Flow(times="logit_normal"))` and `TextCondition(encoder, pooled="pooled")`,
which encodes the caption ids with the frozen encoder inside the compiled step. The peer is
diffusers' `SD3Transformer2DModel` of the same shape (its pooled-projection MLP takes CLIP's
pooled state; Dew's MMDiT adds a mean of the text tokens through a two-layer MLP and a linear map
of the pooled state), with transformers' `CLIPTextModel` under `torch.no_grad`, trained by an eager
loop with `torch.optim.AdamW` (and, as a further configuration, over
`torch.compile(transformer)`). The noise draws differ; the batches, captions and dropped rows'
rate do not.

Each side runs in its own process (benchmarks/harness.py): Dew, and torch at its library defaults,
at each smaller thread count and under `torch.compile`, with no environment setting that slows it.
Dew and torch's one-thread configuration each train --steps steps on the same batch sequence in
their setup (Dew's compile is part of it) and report the mean loss of the last --last; the other
configurations warm up (and compile) on a few steps. Then --repeats rounds of alternating timed
windows of --window steps per side; the JSON line reports the median steps/s of each configuration
and Dew's ratio against the fastest.

Needs torch, transformers, diffusers and Dew:

    .venv-ref/bin/python benchmarks/latent_diffusion_train.py --dew-python .venv/bin/python [--quick]
        [--batch 16] [--steps 100] [--last 20] [--window 10] [--repeats 4]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import harness
from diffusion_train import make_images

ROOT = Path(__file__).resolve().parents[1]
VAE = ROOT / "tests" / "fixtures" / "vae" / "sd"  # diffusers' AutoencoderKL layout: 4x downsampling, 4 channels
TOKENIZER = ROOT / "tests" / "fixtures" / "text_encoders" / "clip"  # a tiny CLIP BPE tokenizer (362 tokens)

IMAGE, LATENT = 64, (16, 16, 4)
PATCH, WIDTH, LAYERS, HEADS = 2, 128, 4, 4
TEXT = dict(vocab_size=362, hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
            max_position_embeddings=32, bos_token_id=361, eos_token_id=360, pad_token_id=360)
UNCONDITIONAL_PROB = 0.1
LR, BETAS, EPS, WEIGHT_DECAY, EMA = 1e-4, (0.9, 0.999), 1e-8, 0.01, 0.999
WARMUP = 3  # steps a configuration without a loss run takes before its windows (compiles here)

COLORS = ["red", "blue", "green", "yellow", "white", "dark", "pale", "bright"]
SHAPES = ["disc", "circle", "dot", "spot"]


def captions(count: int, seed: int = 0) -> list[str]:
    """Synthetic captions, one per image (the words are drawn, not read from the image)."""
    rng = np.random.default_rng(seed)
    return [f"a {rng.choice(COLORS)} {rng.choice(SHAPES)} on a {rng.choice(COLORS)} background"
            for _ in range(count)]


# --- the parent: the shared data and weights ------------------------------------------------------


def save_text_encoder(directory: Path) -> int:
    """A random CLIPTextModel of the benchmark's size, saved with the tiny CLIP tokenizer; its parameters."""
    import torch
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(0)
    model = CLIPTextModel(CLIPTextConfig(**TEXT, hidden_act="quick_gelu"))
    model.save_pretrained(directory)
    shutil.copy(TOKENIZER / "tokenizer.json", directory / "tokenizer.json")
    settings = json.loads((TOKENIZER / "tokenizer_config.json").read_text())
    settings["model_max_length"] = TEXT["max_position_embeddings"]
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
    return sum(p.numel() for p in model.parameters())


def encode_latents(images: np.ndarray) -> np.ndarray:
    """uint8 images [N, 64, 64, 3] -> scaled posterior means [N, 16, 16, 4] (diffusers' AutoencoderKL)."""
    import torch
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(VAE).eval()
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    with torch.inference_mode():
        mean = torch.cat([vae.encode(chunk).latent_dist.mean for chunk in x.split(64)])
    return (mean * vae.config.scaling_factor).permute(0, 2, 3, 1).numpy().astype(np.float32)


def tokenize(workdir: Path) -> None:
    """(Run with Dew's interpreter.) The captions' ids, and the empty caption's, as Dew's condition makes them."""
    from dew.interop.text_encoders import PretrainedTextEncoder
    from dew.objectives.text_condition import TextCondition

    condition = TextCondition(PretrainedTextEncoder.load(workdir / "clip"), pooled="pooled")
    texts = json.loads((workdir / "captions.json").read_text())
    np.save(workdir / "ids.npy", condition.tokenize(texts))
    np.save(workdir / "empty.npy", condition.tokenize([""])[0])


# --- Dew ------------------------------------------------------------------------------------------


class DewTraining(harness.Runner):
    def __init__(self, workdir: Path, loss_steps: int, last: int, window: int):
        import jax
        import optax

        from dew import Dataset, Field, InputSpec, Trainer
        from dew.diffusion.presets import Flow
        from dew.interop.text_encoders import PretrainedTextEncoder
        from dew.nn.backbones.mmdit import MMDiT
        from dew.objectives.diffusion import DiffusionObjective
        from dew.objectives.text_condition import TextCondition

        self.jax, self.Dataset = jax, Dataset
        condition = TextCondition(PretrainedTextEncoder.load(workdir / "clip"), pooled="pooled")
        model = MMDiT(patch_size=PATCH, emb_features=WIDTH, num_layers=LAYERS, num_heads=HEADS,
                      text_features=TEXT["hidden_size"], condition_features=TEXT["hidden_size"])
        inputs = InputSpec(Field("latent", LATENT, np.float32), conditions={"caption": condition})
        objective = DiffusionObjective(model, Flow(times="logit_normal"), inputs, ema_decay=EMA,
                                       unconditional_prob=UNCONDITIONAL_PROB)
        optimizer = optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY)
        self.trainer = Trainer(objective, optimizer, key=jax.random.key(0))
        self.batches = batches(workdir)
        self.batch = self.batches[0]["latent"].shape[0]
        _, state = self.fit(self.batches[:loss_steps], loss_steps)  # the loss run; compiles
        losses = [row["loss"] for row in self.trainer.history]
        self.info = {"params": sum(x.size for x in jax.tree_util.tree_leaves(state.variables["params"])),
                     f"loss_last{last}": round(statistics.fmean(losses[-last:]), 4),
                     "loss_first10": round(statistics.fmean(losses[:10]), 4), "jax": jax.__version__}
        self.timed, self.steps = self.batches[:window], window

    def fit(self, rows, steps: int):
        """Train `steps` steps from a fresh state, as a user's `fit` call does: (seconds, state)."""
        data = self.Dataset(train=lambda partition: itertools.cycle(rows), records=len(rows) * self.batch,
                            batch=self.batch)
        start = time.perf_counter()
        with contextlib.redirect_stdout(sys.stderr):
            state = self.trainer.fit(data, steps=steps, log_every=steps)
        self.jax.block_until_ready(state)
        return time.perf_counter() - start, state

    def window(self):
        return self.fit(self.timed, self.steps)[0], self.steps


def batches(workdir: Path) -> list[dict[str, np.ndarray]]:
    """The shared batches: {"latent": [B, 16, 16, 4] float32, "caption": [B, 32] int32}."""
    latents, ids = np.load(workdir / "latents.npy"), np.load(workdir / "ids.npy")
    return [{"latent": a, "caption": b} for a, b in zip(latents, ids)]


# --- diffusers and transformers -------------------------------------------------------------------


class TorchTraining(harness.Runner):
    def __init__(self, workdir: Path, loss_steps: int, last: int, window: int, compile: bool):
        import diffusers
        import torch
        from diffusers import SD3Transformer2DModel
        from transformers import CLIPTextModel

        self.torch = torch
        torch.manual_seed(0)
        self.text_encoder = CLIPTextModel.from_pretrained(workdir / "clip").eval().requires_grad_(False)
        model = SD3Transformer2DModel(
            sample_size=LATENT[0], patch_size=PATCH, in_channels=LATENT[2], num_layers=LAYERS,
            attention_head_dim=WIDTH // HEADS, num_attention_heads=HEADS, joint_attention_dim=TEXT["hidden_size"],
            caption_projection_dim=WIDTH, pooled_projection_dim=TEXT["hidden_size"], out_channels=LATENT[2],
            pos_embed_max_size=LATENT[0] // PATCH,
        )
        model.train()
        self.parameters = list(model.parameters())
        self.optimizer = torch.optim.AdamW(self.parameters, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
        self.ema = [p.detach().clone() for p in self.parameters]
        self.model = torch.compile(model) if compile else model
        self.generator = torch.Generator().manual_seed(1)
        self.empty = torch.from_numpy(np.load(workdir / "empty.npy")).long()
        self.batches = [(torch.from_numpy(b["latent"]).permute(0, 3, 1, 2).contiguous(),
                         torch.from_numpy(b["caption"]).long()) for b in batches(workdir)]
        losses = self.run(self.batches[:loss_steps])  # the loss run, or the warm-up (compiles)
        self.info = {"params": sum(p.numel() for p in self.parameters), "threads": torch.get_num_threads(),
                     "torch": torch.__version__, "diffusers": diffusers.__version__}
        if loss_steps >= last:
            self.info.update({f"loss_last{last}": round(statistics.fmean(losses[-last:]), 4),
                              "loss_first10": round(statistics.fmean(losses[:10]), 4)})
        self.timed = self.batches[:window]

    def step(self, x0, ids):
        torch = self.torch
        batch = x0.shape[0]
        drop = torch.rand(batch, generator=self.generator) < UNCONDITIONAL_PROB
        ids = torch.where(drop[:, None], self.empty[None], ids)
        with torch.no_grad():
            encoded = self.text_encoder(input_ids=ids)
        t = torch.sigmoid(torch.randn(batch, generator=self.generator))
        eps = torch.randn(x0.shape, generator=self.generator)
        s = t[:, None, None, None]
        x_t = (1 - s) * x0 + s * eps
        output = self.model(hidden_states=x_t, encoder_hidden_states=encoded.last_hidden_state,
                            pooled_projections=encoded.pooler_output, timestep=t * 1000).sample
        loss = torch.mean((output - (eps - x0)) ** 2)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        with torch.no_grad():
            torch._foreach_lerp_(self.ema, self.parameters, 1.0 - EMA)
        return loss.detach()

    def run(self, batches) -> list[float]:
        return [float(x) for x in [self.step(*b) for b in batches]]  # losses read after the loop

    def window(self):
        start = time.perf_counter()
        self.run(self.timed)
        return time.perf_counter() - start, len(self.timed)


def worker(config: dict) -> harness.Runner:
    workdir = Path(config["workdir"])
    if config["side"] == "dew":
        return DewTraining(workdir, config["loss_steps"], config["last"], config["window"])
    harness.set_peer_threads(config)
    loss_steps = config["loss_steps"] if config.get("loss_run") else WARMUP
    return TorchTraining(workdir, loss_steps, config["last"], config["window"], config.get("compile", False))


def main() -> None:
    if (config := harness.worker_config()) is not None:
        harness.serve(config, worker)
        return
    if sys.argv[1:2] == ["--tokenize"]:
        tokenize(Path(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short sanity run (few steps and windows)")
    parser.add_argument("--batch", type=int, default=16, help="training batch")
    parser.add_argument("--steps", type=int, help="steps of the loss run (default 100; 20 with --quick)")
    parser.add_argument("--last", type=int, help="losses averaged at the end of the loss run (default 20; 10)")
    parser.add_argument("--window", type=int, help="steps per timed window (default 10; 4)")
    parser.add_argument("--repeats", type=int, help="timed windows per side (default 4; 2)")
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile configuration")
    parser.add_argument("--dew-python", default=sys.executable, help="interpreter of the Dew side")
    parser.add_argument("--peer-python", default=sys.executable, help="interpreter of the torch sides")
    args = parser.parse_args()
    for name, pair in dict(steps=(100, 20), last=(20, 10), window=(10, 4), repeats=(4, 2)).items():
        if getattr(args, name) is None:
            setattr(args, name, pair[args.quick])
    if args.steps < args.last:
        parser.error("--steps must be at least --last")

    script = str(Path(__file__).resolve())
    with tempfile.TemporaryDirectory(prefix="dew-latent-diffusion-") as directory:
        workdir = Path(directory)
        count = max(args.steps, args.window)
        images = make_images(count * args.batch).repeat(2, axis=1).repeat(2, axis=2)  # 32 -> 64 pixels
        np.save(workdir / "latents.npy", encode_latents(images).reshape(count, args.batch, *LATENT))
        encoder_params = save_text_encoder(workdir / "clip")
        (workdir / "captions.json").write_text(json.dumps(captions(count * args.batch)))
        subprocess.run([args.dew_python, script, "--tokenize", str(workdir)], check=True, env=harness.dew_environment())
        ids = np.load(workdir / "ids.npy")
        np.save(workdir / "ids.npy", ids.reshape(count, args.batch, ids.shape[-1]))

        config = {"loss_steps": args.steps, "last": args.last, "window": args.window}
        sides = [harness.side("dew", "dew", script, [], {**config, "side": "dew"}, python=args.dew_python)]
        sides += harness.torch_sides(script, [], {**config, "side": "torch"}, compile=not args.no_compile,
                                     python=args.peer_python)
        result = harness.compare(sides, args.repeats, workdir=workdir)
        dew = result.dew
        torch_default = next(o for o in result.outcomes if o.name == "torch defaults")
        torch_loss = next(o for o in result.outcomes if o.config.get("loss_run"))
        print(json.dumps({
            "benchmark": "latent_diffusion_train",
            "work": (
                f"text-conditioned latent DiT: latents {'x'.join(map(str, LATENT))} ({IMAGE}px images through the "
                f"tiny SD-layout VAE, precomputed), patch {PATCH}, {LAYERS} joint blocks x {HEADS}H x {WIDTH}, MLP x4, "
                f"batch {args.batch}; frozen CLIP text encoder ({TEXT['num_hidden_layers']}L x {TEXT['hidden_size']}, "
                f"{TEXT['max_position_embeddings']} tokens) run in every step, captions dropped with p "
                f"{UNCONDITIONAL_PROB}; rectified flow, logit-normal t; AdamW lr {LR} wd {WEIGHT_DECAY}, EMA {EMA}"
            ),
            "peer": ("diffusers SD3Transformer2DModel of the same shape + transformers CLIPTextModel (no_grad) + "
                     "torch.optim.AdamW (eager, and over torch.compile of the transformer)"),
            "params": {"dew": dew.info["params"], "torch": torch_default.info.get("params"),
                       "text_encoder": encoder_params},
            **result.report("steps_per_s", 3),
            "dew_images_per_s": round(dew.rate * args.batch, 1),
            "goal": "dew_over_best_peer >= 1.2",
            "window_steps": args.window,
            "loss_steps": args.steps,
            f"dew_loss_last{args.last}": dew.info[f"loss_last{args.last}"],
            f"torch_loss_last{args.last}": torch_loss.info.get(f"loss_last{args.last}"),
            "dew_loss_first10": dew.info["loss_first10"],
            "torch_loss_first10": torch_loss.info.get("loss_first10"),
            "torch_loss_run_by": torch_loss.name,
            "torch_default_threads": torch_default.info.get("threads"),
            "hardware": harness.hardware(),
            "jax": dew.info["jax"],
            "torch": torch_default.info.get("torch"),
            "diffusers": torch_default.info.get("diffusers"),
        }), flush=True)


if __name__ == "__main__":
    main()
