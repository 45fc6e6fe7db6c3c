"""Latent decoding: Dew's AutoencoderKL against diffusers' on the same weights.

The work is the decoder of an SD-shaped AutoencoderKL at reduced width (block_out_channels
(64, 128, 128, 128), two resnets per block, 32 groups, 4 latent channels, the mid-block attention,
post_quant_conv, scaling factor 0.18215) turning --batch latents of 32 x 32 x 4 into 256 x 256 RGB
images. The parent builds the diffusers model from its config with a fixed seed and saves it; Dew
reads the same directory (`PretrainedAutoencoder.load`) and decodes scaled latents
(`decode(latents)`, jitted); diffusers decodes the same latents divided by the scaling factor, as
its pipelines do (`vae.decode(latents / scaling_factor).sample`, under `torch.inference_mode`),
channels first.

Each side runs in its own process (benchmarks/harness.py): Dew, and diffusers at its library
defaults, at each smaller thread count, and with its decoder under `torch.compile` (defaults;
compiled in the warm-up decode, outside the windows). The JSON line reports images/s per configuration (median
of --repeats alternating windows of --window decodes), Dew's ratio against the fastest, and the
largest difference between the two sides' images.

Needs torch, diffusers and Dew:

    .venv-ref/bin/python benchmarks/vae_decode.py --dew-python .venv/bin/python [--quick]
        [--batch 4] [--window 2] [--repeats 5] [--no-compile]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np

import harness

CONFIG = dict(in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2, norm_num_groups=32,
              block_out_channels=(64, 128, 128, 128), down_block_types=("DownEncoderBlock2D",) * 4,
              up_block_types=("UpDecoderBlock2D",) * 4, scaling_factor=0.18215, sample_size=256)
LATENT = (32, 32, 4)  # 256 x 256 images through the three 2x upsamplings


class DewDecoding(harness.Runner):
    def __init__(self, workdir: Path, window: int):
        import jax
        import jax.numpy as jnp

        from dew.interop.autoencoders import PretrainedAutoencoder

        autoencoder = PretrainedAutoencoder.load(workdir / "vae")
        latents = jnp.asarray(np.load(workdir / "latents.npy"))
        self.decode = lambda: jax.block_until_ready(autoencoder.decode(latents))
        self.images = np.asarray(self.decode())  # compiles
        self.batch, self.window_calls, self.workdir = latents.shape[0], window, workdir
        self.info = {"jax": jax.__version__}

    def window(self):
        return harness.timed_calls(self.decode, self.window_calls), self.batch * self.window_calls

    def finish(self):
        np.save(self.workdir / "images_dew.npy", self.images)
        return {}


class DiffusersDecoding(harness.Runner):
    def __init__(self, workdir: Path, window: int, save: bool, compile: bool):
        import diffusers
        import torch

        vae = diffusers.AutoencoderKL.from_pretrained(workdir / "vae").eval()
        if compile:
            vae.decoder = torch.compile(vae.decoder)
        latents = torch.from_numpy(np.load(workdir / "latents.npy")).permute(0, 3, 1, 2).contiguous()

        def decode():
            with torch.inference_mode():
                return vae.decode(latents / vae.config.scaling_factor).sample

        self.decode = decode
        self.images = decode().permute(0, 2, 3, 1).numpy()  # warm-up
        self.batch, self.window_calls, self.workdir, self.save = latents.shape[0], window, workdir, save
        self.info = {"threads": torch.get_num_threads(), "torch": torch.__version__, "diffusers": diffusers.__version__}

    def window(self):
        return harness.timed_calls(self.decode, self.window_calls), self.batch * self.window_calls

    def finish(self):
        if self.save:
            np.save(self.workdir / "images_torch.npy", self.images)
        return {}


def worker(config: dict) -> harness.Runner:
    workdir, window = Path(config["workdir"]), config["window"]
    if config["side"] == "dew":
        return DewDecoding(workdir, window)
    harness.set_peer_threads(config)
    return DiffusersDecoding(workdir, window, save=bool(config.get("loss_run")), compile=bool(config.get("compile")))


def save_vae(directory: Path) -> int:
    """A diffusers AutoencoderKL of CONFIG with seeded weights, saved; returns its parameter count."""
    import diffusers
    import torch

    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(**CONFIG)
    vae.save_pretrained(directory, safe_serialization=True)
    return sum(p.numel() for p in vae.decoder.parameters()) + sum(p.numel() for p in vae.post_quant_conv.parameters())


def main() -> None:
    if (config := harness.worker_config()) is not None:
        harness.serve(config, worker)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short sanity run (batch 2, few windows)")
    parser.add_argument("--batch", type=int, help="latents per decode (default 4; 2 with --quick)")
    parser.add_argument("--window", type=int, help="decodes per timed window (default 2; 1)")
    parser.add_argument("--repeats", type=int, help="timed windows per side (default 5; 2)")
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile configuration")
    parser.add_argument("--dew-python", default=sys.executable, help="interpreter of the Dew side")
    parser.add_argument("--peer-python", default=sys.executable, help="interpreter of the diffusers sides")
    args = parser.parse_args()
    for name, pair in dict(batch=(4, 2), window=(2, 1), repeats=(5, 2)).items():
        if getattr(args, name) is None:
            setattr(args, name, pair[args.quick])

    script = str(Path(__file__).resolve())
    with tempfile.TemporaryDirectory(prefix="dew-vae-") as directory:
        workdir = Path(directory)
        decoder_params = save_vae(workdir / "vae")
        latents = np.random.default_rng(0).standard_normal((args.batch, *LATENT)).astype(np.float32)
        np.save(workdir / "latents.npy", latents)
        config = {"window": args.window}
        sides = [harness.side("dew", "dew", script, [], {**config, "side": "dew"}, python=args.dew_python)]
        sides += harness.torch_sides(script, [], {**config, "side": "torch"}, compile=not args.no_compile,
                                     python=args.peer_python, label="diffusers")
        result = harness.compare(sides, args.repeats, workdir=workdir)
        peer = next(o for o in result.outcomes if o.name == "diffusers defaults")
        images = [np.load(workdir / f"images_{s}.npy") for s in ("dew", "torch")]
        print(json.dumps({
            "benchmark": "vae_decode",
            "work": (f"AutoencoderKL decoder, block_out_channels {list(CONFIG['block_out_channels'])}, "
                     f"{CONFIG['layers_per_block']} resnets per block, mid-block attention; {args.batch} latents "
                     f"{'x'.join(map(str, LATENT))} -> {args.batch} images 256x256x3 per decode"),
            "peer": (f"diffusers {peer.info.get('diffusers')} AutoencoderKL.decode on the same weights "
                     "(eager, and with its decoder under torch.compile)"),
            "decoder_params": decoder_params,
            **result.report("images_per_s", 3),
            "images_max_abs_diff": float(np.max(np.abs(images[0] - images[1]))),
            "window_decodes": args.window,
            "hardware": f"{platform.processor() or platform.machine()}, {harness.cores()} cores",
            "jax": result.dew.info.get("jax"),
            "torch": peer.info.get("torch"),
        }), flush=True)


if __name__ == "__main__":
    main()
