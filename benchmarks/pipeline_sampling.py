"""Text-to-image sampling of a Stable Diffusion pipeline directory: Dew's `dew.pipeline(dir)` against
diffusers' StableDiffusionPipeline on the same saved pipeline.

The work is an SD 1.x-shaped pipeline at reduced width, built by diffusers with seeded random weights
and saved with `save_pretrained` in the parent process (nothing is downloaded): a UNet2DConditionModel
(block_out_channels (64, 128, 192, 256), two resnets per block, cross-attention in the first three
levels, 8 heads; 28.0M parameters), a 2-layer CLIP text encoder (width 256, 77 positions) over a small
CLIP BPE tokenizer, an AutoencoderKL with SD's 8x downsampling at width 32, and SD 1.5's
PNDMScheduler (skip_prk_steps, leading spacing, steps_offset 1). Each call draws --batch images of
512 x 512 (64 x 64 x 4 latents) for --batch prompts in 20 steps with classifier-free guidance 7.5,
prompt encoding and VAE decoding included. Both sides start from the same unit Gaussian latents
(diffusers' ``latents=``; Dew's `SourceScheduler.initial`), so their images are compared.

Each side runs in its own process (benchmarks/harness.py): Dew, and diffusers at its library defaults,
at each smaller thread count, and with its UNet under `torch.compile` (defaults; compiled in the
warm-up call, outside the windows). The JSON line reports images/s per configuration (median of --repeats
alternating windows of --window calls), Dew's ratio against the fastest, and the largest difference
between the two sides' images.

Needs torch, diffusers and Dew:

    .venv-ref/bin/python benchmarks/pipeline_sampling.py --dew-python .venv/bin/python [--quick]
        [--batch 2] [--window 1] [--repeats 3] [--no-compile]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

import harness

TOKENIZER = Path(__file__).resolve().parents[1] / "tests/fixtures/pipelines/sd15/tokenizer"  # CLIP BPE files
PROMPTS = ["a photo of a cat", "a painting of a flower in the morning light"]
STEPS, GUIDANCE, LATENT_SIDE, CONTEXT = 20, 7.5, 64, 77
UNET = dict(sample_size=LATENT_SIDE, in_channels=4, out_channels=4, layers_per_block=2,
            block_out_channels=(64, 128, 192, 256), cross_attention_dim=256, attention_head_dim=8,
            norm_num_groups=32)
VAE = dict(in_channels=3, out_channels=3, latent_channels=4, layers_per_block=1, norm_num_groups=8,
           block_out_channels=(32, 32, 32, 32), down_block_types=("DownEncoderBlock2D",) * 4,
           up_block_types=("UpDecoderBlock2D",) * 4, scaling_factor=0.18215, sample_size=8 * LATENT_SIDE)
SCHEDULER = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                 steps_offset=1, prediction_type="epsilon", skip_prk_steps=True, set_alpha_to_one=False)


@dataclasses.dataclass(frozen=True)
class StartingLatents:
    """The pipeline's scheduler process, starting from given unit Gaussian latents (diffusers' ``latents=``)."""

    process: object
    latents: object

    def noise(self, key, shape, dtype=None, *, steps):
        return self.process.scheduler.initial(self.latents, self.process.sigmas(steps))

    def __getattr__(self, name):
        return getattr(self.process, name)


class DewSampling(harness.Runner):
    def __init__(self, workdir: Path, window: int):
        import jax
        import jax.numpy as jnp

        import dew

        latents = np.load(workdir / "latents.npy")  # [B, C, H, W], as diffusers takes them
        task = dew.pipeline(workdir / "pipeline")
        task = dataclasses.replace(task, steps=STEPS, guidance=GUIDANCE, process=StartingLatents(
            task.process, jnp.asarray(latents.transpose(0, 2, 3, 1))))
        prompts = PROMPTS[: latents.shape[0]]
        self.draw = lambda: jax.block_until_ready(task(prompts, seed=0).images)
        self.images = np.clip(np.asarray(self.draw()) / 2 + 0.5, 0.0, 1.0)  # compiles
        self.batch, self.window_calls, self.workdir = latents.shape[0], window, workdir
        self.info = {"jax": jax.__version__}

    def window(self):
        return harness.timed_calls(self.draw, self.window_calls), self.batch * self.window_calls

    def finish(self):
        np.save(self.workdir / "images_dew.npy", self.images)
        return {}


class DiffusersSampling(harness.Runner):
    def __init__(self, workdir: Path, window: int, save: bool, compile: bool):
        import diffusers
        import torch

        pipe = diffusers.StableDiffusionPipeline.from_pretrained(workdir / "pipeline", torch_dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        if compile:  # the UNet runs 2 x 20 times a call: diffusers' own recipe for a faster pipeline
            pipe.unet = torch.compile(pipe.unet)
        latents = torch.from_numpy(np.load(workdir / "latents.npy"))
        prompts = PROMPTS[: latents.shape[0]]

        def draw():
            with torch.inference_mode():
                return pipe(prompt=prompts, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                            latents=latents.clone(), output_type="np").images

        self.draw = draw
        self.images = draw()  # warm-up
        self.batch, self.window_calls, self.workdir, self.save = latents.shape[0], window, workdir, save
        self.info = {"threads": torch.get_num_threads(), "torch": torch.__version__, "diffusers": diffusers.__version__}

    def window(self):
        return harness.timed_calls(self.draw, self.window_calls), self.batch * self.window_calls

    def finish(self):
        if self.save:
            np.save(self.workdir / "images_torch.npy", self.images)
        return {}


def worker(config: dict) -> harness.Runner:
    workdir, window = Path(config["workdir"]), config["window"]
    if config["side"] == "dew":
        return DewSampling(workdir, window)
    harness.set_peer_threads(config)
    return DiffusersSampling(workdir, window, save=bool(config.get("loss_run")), compile=bool(config.get("compile")))


def save_pipeline(directory: Path) -> int:
    """The seeded random SD pipeline of this module, saved by diffusers; returns the UNet's parameter count."""
    import diffusers
    import torch
    import transformers

    shutil.copytree(TOKENIZER, directory / "tokenizer_files")
    settings = json.loads((directory / "tokenizer_files/tokenizer_config.json").read_text())
    settings["model_max_length"] = CONTEXT
    (directory / "tokenizer_files/tokenizer_config.json").write_text(json.dumps(settings))
    tokenizer = transformers.CLIPTokenizer.from_pretrained(directory / "tokenizer_files")
    torch.manual_seed(0)
    text_encoder = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=CONTEXT, hidden_act="quick_gelu", bos_token_id=0,
        eos_token_id=2, pad_token_id=tokenizer.pad_token_id))
    unet = diffusers.UNet2DConditionModel(**UNET)
    pipe = diffusers.StableDiffusionPipeline(
        vae=diffusers.AutoencoderKL(**VAE), text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
        scheduler=diffusers.PNDMScheduler(**SCHEDULER), safety_checker=None, feature_extractor=None,
        requires_safety_checker=False)
    pipe.save_pretrained(directory / "pipeline", safe_serialization=True)
    shutil.rmtree(directory / "pipeline/tokenizer")  # the CLIP BPE files, as the released repositories ship them
    shutil.copytree(directory / "tokenizer_files", directory / "pipeline/tokenizer")
    return sum(p.numel() for p in unet.parameters())


def main() -> None:
    if (config := harness.worker_config()) is not None:
        harness.serve(config, worker)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short sanity run (batch 1, few windows)")
    parser.add_argument("--batch", type=int, help="images per call (default 2; 1 with --quick)")
    parser.add_argument("--window", type=int, help="calls per timed window (default 1)")
    parser.add_argument("--repeats", type=int, help="timed windows per side (default 3; 2)")
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile configuration")
    parser.add_argument("--dew-python", default=sys.executable, help="interpreter of the Dew side")
    parser.add_argument("--peer-python", default=sys.executable, help="interpreter of the diffusers sides")
    args = parser.parse_args()
    for name, pair in dict(batch=(2, 1), window=(1, 1), repeats=(3, 2)).items():
        if getattr(args, name) is None:
            setattr(args, name, pair[args.quick])
    if not 1 <= args.batch <= len(PROMPTS):
        parser.error(f"--batch must be 1..{len(PROMPTS)} (one image per prompt), got {args.batch}")

    script = str(Path(__file__).resolve())
    with tempfile.TemporaryDirectory(prefix="dew-pipeline-") as directory:
        workdir = Path(directory)
        unet_params = save_pipeline(workdir)
        latents = np.random.default_rng(0).standard_normal((args.batch, 4, LATENT_SIDE, LATENT_SIDE))
        np.save(workdir / "latents.npy", latents.astype(np.float32))
        config = {"window": args.window}
        sides = [harness.side("dew", "dew", script, [], {**config, "side": "dew"}, python=args.dew_python)]
        sides += harness.torch_sides(script, [], {**config, "side": "torch"}, compile=not args.no_compile,
                                     python=args.peer_python, label="diffusers")
        result = harness.compare(sides, args.repeats, workdir=workdir)
        peer = next(o for o in result.outcomes if o.name == "diffusers defaults")
        images = [np.load(workdir / f"images_{s}.npy") for s in ("dew", "torch")]
        print(json.dumps({
            "benchmark": "pipeline_sampling",
            "work": (f"StableDiffusionPipeline, UNet {list(UNET['block_out_channels'])} x {UNET['layers_per_block']} "
                     f"resnets, {args.batch} image(s) 512x512 (latents {LATENT_SIDE}x{LATENT_SIDE}x4) per call, "
                     f"{STEPS} PNDM steps, CFG {GUIDANCE}, prompt encoding and VAE decoding included"),
            "peer": (f"diffusers {peer.info.get('diffusers')} StableDiffusionPipeline on the same saved directory "
                     "(eager, and with its UNet under torch.compile)"),
            "unet_params": unet_params,
            **result.report("images_per_s", 4),
            "images_max_abs_diff": float(np.max(np.abs(images[0] - images[1]))),
            "window_calls": args.window,
            "hardware": f"{platform.processor() or platform.machine()}, {harness.cores()} cores",
            "jax": result.dew.info.get("jax"),
            "torch": peer.info.get("torch"),
        }), flush=True)


if __name__ == "__main__":
    main()
