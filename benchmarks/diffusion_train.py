"""EDM training and Heun sampling of a small DiT: Dew against a PyTorch reference and diffusers.

The work is a pixel-space DiT (Peebles & Xie 2023) on 32x32x3 uint8 images, patch 4 (64 tokens),
width 128, 4 layers, 4 heads, MLP ratio 4, unconditional, trained with EDM (Karras et al. 2022):
ln sigma ~ N(-1.2, 1.2^2), Karras preconditioning (sigma_data 0.5; c_in, c_skip, c_out,
c_noise = ln(sigma) / 4) and EDM's weighting, i.e. a plain mean squared error on the
preconditioned target. Both sides use AdamW (lr 3e-4, betas (0.9, 0.999), eps 1e-8, weight decay
0.01 on every parameter, no clipping) and a parameter EMA of 0.999 updated every step.

Dew trains `SimpleDiT` with `Trainer` + `DiffusionObjective(EDM())`; the peer is a DiT written
below in plain torch that mirrors `SimpleDiT` layer for layer (patchify conv, fixed 2-D sin/cos
positions, sinusoidal noise embedding -> MLP, adaLN-zero blocks, adaLN final layer, the same
initializers), trained by an eager loop with `torch.optim.AdamW` (and, as a further
configuration, the same loop over `torch.compile(model)`). Both read the same pre-generated
batches of synthetic images (seeded: colored discs on a two-color gradient, so the loss falls);
the noise draws differ.

Each side runs in its own process (benchmarks/harness.py): Dew, and torch at its library
defaults, at each smaller thread count and under `torch.compile`, with no environment setting
that slows it.

Part 1 (training): Dew and torch (its one-thread configuration, which never collapses on a busy
machine) each train --steps steps on the same batch sequence in their setup (Dew's compile is part of it) and report the mean loss of the last
--last; the other configurations warm up (and compile) on a few steps. Then --repeats rounds of
alternating timed windows of --window steps per side; the median steps/s of each configuration
is reported, and Dew's ratio against the fastest.

Part 2 (sampling): --sample-steps Heun steps (2 * steps - 1 network calls; the last step, to
sigma 0, is Euler) of --sample-batch images on the Karras rho = 7 grid from 80 to 0.002, over the
weights Dew trained in part 1 (the torch DiT holds the same weights; both start from the same
x_T). Dew: `dew.sample(process.denoiser(model, variables), x_T, solver=Heun())`. Peer: diffusers'
`HeunDiscreteScheduler` in the usual pipeline loop (scale_model_input, network, step) around the
torch DiT as an EDM denoiser (prediction_type="sample"), at its defaults and each smaller thread
count. The scheduler is configured for EDM's range: `trained_betas` whose sigma table runs
log-uniformly from 0.002 to 80 and `use_karras_sigmas=True`, which yields the same rho = 7 grid;
float32 betas put its ends off by up to ~1%, so its sigmas are then replaced by Dew's grid exactly
(the mismatch is reported). The JSON line reports images/s per configuration (median of
--sample-repeats alternating runs), the largest difference between the two sets of samples and
between the two networks' outputs on one probe.

Prints one JSON line per part. Needs torch, diffusers and Dew:

    .venv-ref/bin/python benchmarks/diffusion_train.py [--quick] [--batch 32] [--steps 200]
        [--window 20] [--repeats 5] [--sample-batch 16] [--sample-steps 40] [--sample-repeats 3]
"""

from __future__ import annotations

import argparse
import json
import math
import pickle
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

import harness

SIZE, CHANNELS, PATCH, WIDTH, LAYERS, HEADS, MLP_RATIO = 32, 3, 4, 128, 4, 4, 4.0
LR, BETAS, EPS, WEIGHT_DECAY, EMA = 3e-4, (0.9, 0.999), 1e-8, 0.01, 0.999
P_MEAN, P_STD, SIGMA_DATA, SIGMA_MIN, SIGMA_MAX = -1.2, 1.2, 0.5, 0.002, 80.0
FREQ_FEATURES, NOISE_SCALE, LN_EPS = 256, 1000.0, 1e-6
WARMUP = 3  # steps a configuration without a loss run takes before its windows (compiles here)


def make_images(count: int, seed: int = 0) -> np.ndarray:
    """`count` uint8 [SIZE, SIZE, 3] images: 1-3 colored discs on a random two-color gradient."""
    rng = np.random.default_rng(seed)
    yy, xx = np.meshgrid(np.arange(SIZE) + 0.5, np.arange(SIZE) + 0.5, indexing="ij")
    angle = rng.uniform(0, 2 * np.pi, (count, 1, 1))
    ramp = ((xx - SIZE / 2) * np.cos(angle) + (yy - SIZE / 2) * np.sin(angle)) / SIZE + 0.5
    a, b = rng.uniform(0, 1, (2, count, 1, 1, 3))
    images = a + (b - a) * np.clip(ramp, 0, 1)[..., None]
    for disc in range(3):
        present = (rng.uniform(0, 1, (count, 1, 1)) < (1.0 if disc == 0 else 0.5))
        cy, cx = rng.uniform(4, SIZE - 4, (2, count, 1, 1))
        radius = rng.uniform(3, 9, (count, 1, 1))
        inside = present & ((yy - cy) ** 2 + (xx - cx) ** 2 < radius**2)
        color = rng.uniform(0, 1, (count, 1, 1, 3))
        images = np.where(inside[..., None], color, images)
    return np.round(images * 255).astype(np.uint8)


def make_batches(count: int, batch: int) -> list[np.ndarray]:
    images = make_images(count * batch)
    return [images[i * batch : (i + 1) * batch] for i in range(count)]


# --- Dew ----------------------------------------------------------------------------------------


def dew_objective():
    from dew import Field, InputSpec
    from dew.diffusion.presets import EDM
    from dew.nn.backbones import SimpleDiT
    from dew.objectives.diffusion import DiffusionObjective

    model = SimpleDiT(patch_size=PATCH, emb_features=WIDTH, num_layers=LAYERS, num_heads=HEADS, mlp_ratio=MLP_RATIO)
    return DiffusionObjective(model, EDM(), InputSpec(Field("image", (SIZE, SIZE, CHANNELS))), ema_decay=EMA)


class DewTraining(harness.Runner):
    def __init__(self, batches: np.ndarray, loss_steps: int, last: int, window: int, workdir: Path,
                 sample_steps: int):
        import jax
        import optax

        from dew import Trainer

        self.jax, self.workdir, self.sample_steps = jax, workdir, sample_steps
        optimizer = optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY)
        self.trainer = Trainer(dew_objective(), optimizer, key=jax.random.key(0))
        self.batch = batches.shape[1]
        _, self.state = self.fit(batches[:loss_steps], loss_steps)  # the loss run; compiles
        losses = [row["loss"] for row in self.trainer.history]
        params = self.state.variables["params"]
        self.info = {"params": sum(x.size for x in jax.tree_util.tree_leaves(params)),
                     f"loss_last{last}": round(statistics.fmean(losses[-last:]), 4),
                     "loss_first10": round(statistics.fmean(losses[:10]), 4), "jax": jax.__version__}
        self.timed, self.steps = batches[:window], window

    def fit(self, batches, steps: int):
        """Train `steps` steps from a fresh state, as a user's `fit` call does: (seconds, state)."""
        return harness.fit_window(self.trainer, batches, self.batch, steps, column="image",
                                  records=len(batches) * self.batch)

    def window(self):
        return self.fit(self.timed, self.steps)[0], self.steps

    def finish(self):
        """Leave the trained variables (from the loss run) and the sampling grid for part 2."""
        variables = plain(self.jax.device_get(self.state.variables))
        (self.workdir / "variables.pkl").write_bytes(pickle.dumps(variables))
        grid = np.asarray(self.trainer.objective.process.sigmas(self.sample_steps))
        np.save(self.workdir / "grid.npy", grid)
        return {}


def plain(tree):
    """Nested dicts of NumPy arrays (what the torch side unpickles without JAX or Flax)."""
    if hasattr(tree, "items"):
        return {key: plain(value) for key, value in tree.items()}
    return np.asarray(tree)


class DewSampling(harness.Runner):
    def __init__(self, workdir: Path, sample_steps: int):
        import jax
        import jax.numpy as jnp

        from dew.sampling import Heun, sample

        objective = dew_objective()
        variables = pickle.loads((workdir / "variables.pkl").read_bytes())
        denoise = objective.process.denoiser(objective.model, variables)
        x_T = jnp.asarray(np.load(workdir / "x_T.npy"))
        self.batch, self.workdir = x_T.shape[0], workdir
        self.draw = lambda: jax.block_until_ready(sample(denoise, x_T, solver=Heun(), steps=sample_steps))
        self.samples = np.asarray(self.draw())  # compiles
        probe, probe_noise = probe_inputs()
        self.probe = np.asarray(objective.model.apply(variables, jnp.asarray(probe), jnp.asarray(probe_noise)))
        self.info = {}

    def window(self):
        return harness.timed_calls(self.draw, 1), self.batch

    def finish(self):
        np.save(self.workdir / "samples_dew.npy", self.samples)
        np.save(self.workdir / "probe_dew.npy", self.probe)
        return {}


def probe_inputs() -> tuple[np.ndarray, np.ndarray]:
    """Four fixed images and noise inputs on which both networks' outputs are compared."""
    probe = np.random.default_rng(2).standard_normal((4, SIZE, SIZE, CHANNELS)).astype(np.float32)
    return probe, np.array([-1.5, -0.5, 0.3, 1.1], np.float32)


# --- the PyTorch reference DiT ------------------------------------------------------------------


def sincos_positions(features: int, grid: tuple[int, int]) -> np.ndarray:
    """[gh * gw, features]: rows' sin/cos in the first half, columns' in the second (as SimpleDiT)."""
    share = features // 2
    omega = 1.0 / 10000.0 ** (np.arange(share // 2, dtype=np.float64) / (share // 2))
    parts = []
    for coord in np.meshgrid(np.arange(grid[0], dtype=np.float64), np.arange(grid[1], dtype=np.float64), indexing="ij"):
        angles = coord.reshape(-1)[:, None] * omega[None, :]
        parts += [np.sin(angles), np.cos(angles)]
    return np.concatenate(parts, axis=1).astype(np.float32)


def build_torch_dit():
    """The reference DiT as a torch module, with module names that mirror SimpleDiT's params."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    def linear(fan_in, fan_out, init):
        layer = nn.Linear(fan_in, fan_out)
        if init == "zero":
            nn.init.zeros_(layer.weight)
        elif init == "normal":
            nn.init.normal_(layer.weight, std=0.02)
        else:
            nn.init.xavier_uniform_(layer.weight)
        nn.init.zeros_(layer.bias)
        return layer

    def modulate(x, shift, scale):
        return x * (1 + scale[:, None]) + shift[:, None]

    class Modulation(nn.Module):
        def __init__(self, chunks):
            super().__init__()
            self.chunks = chunks
            self.proj = linear(WIDTH, chunks * WIDTH, "zero")

        def forward(self, c):
            return self.proj(F.silu(c)).chunk(self.chunks, dim=-1)

    class NoiseEmbed(nn.Module):
        def __init__(self):
            super().__init__()
            self.dense_0 = linear(FREQ_FEATURES, WIDTH, "normal")
            self.dense_1 = linear(WIDTH, WIDTH, "normal")
            half = FREQ_FEATURES // 2
            freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
            self.register_buffer("freqs", freqs)

        def forward(self, noise_input):
            args = (NOISE_SCALE * noise_input)[:, None] * self.freqs[None]
            return self.dense_1(F.silu(self.dense_0(torch.cat([torch.cos(args), torch.sin(args)], dim=-1))))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.modulation = Modulation(6)
            self.attn = nn.ModuleDict({"qkv": nn.ModuleDict({"proj": linear(WIDTH, 3 * WIDTH, "xavier")}),
                                       "out": linear(WIDTH, WIDTH, "xavier")})
            hidden = int(WIDTH * MLP_RATIO)
            self.mlp = nn.ModuleDict({"fc1": linear(WIDTH, hidden, "xavier"), "fc2": linear(hidden, WIDTH, "xavier")})

        def forward(self, x, c):
            shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = self.modulation(c)
            batch, length, _ = x.shape
            h = modulate(F.layer_norm(x, (WIDTH,), eps=LN_EPS), shift_a, scale_a)
            qkv = self.attn["qkv"]["proj"](h).reshape(batch, length, 3, HEADS, WIDTH // HEADS)
            q, k, v = qkv.permute(2, 0, 3, 1, 4)
            h = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, length, WIDTH)
            x = x + gate_a[:, None] * self.attn["out"](h)
            h = modulate(F.layer_norm(x, (WIDTH,), eps=LN_EPS), shift_m, scale_m)
            h = self.mlp["fc2"](F.gelu(self.mlp["fc1"](h), approximate="tanh"))
            return x + gate_m[:, None] * h

    class FinalLayer(nn.Module):
        def __init__(self):
            super().__init__()
            self.modulation = Modulation(2)
            self.linear = linear(WIDTH, PATCH * PATCH * CHANNELS, "zero")

        def forward(self, x, c):
            shift, scale = self.modulation(c)
            return self.linear(modulate(F.layer_norm(x, (WIDTH,), eps=LN_EPS), shift, scale))

    class DiT(nn.Module):
        """x [B, H, W, C] (channels last, as Dew), c_noise [B] -> [B, H, W, C]."""

        def __init__(self):
            super().__init__()
            self.conditioning = nn.ModuleDict({"noise_embed": NoiseEmbed()})
            self.patch_embed = nn.ModuleDict({"proj": nn.Conv2d(CHANNELS, WIDTH, PATCH, stride=PATCH)})
            conv = self.patch_embed["proj"]
            nn.init.xavier_uniform_(conv.weight.data.view(WIDTH, -1))  # as a dense map of the patch (DiT)
            nn.init.zeros_(conv.bias)
            self.grid = (SIZE // PATCH, SIZE // PATCH)
            self.register_buffer("positions", torch.from_numpy(sincos_positions(WIDTH, self.grid))[None])
            self.blocks = [f"dit_block_{i}" for i in range(LAYERS)]
            for name in self.blocks:
                self.add_module(name, Block())
            self.final_layer = FinalLayer()

        def forward(self, x, c_noise):
            batch = x.shape[0]
            c = self.conditioning["noise_embed"](c_noise)
            tokens = self.patch_embed["proj"](x.permute(0, 3, 1, 2)).flatten(2).transpose(1, 2)
            tokens = tokens + self.positions
            for name in self.blocks:
                tokens = getattr(self, name)(tokens, c)
            out = self.final_layer(tokens, c)
            gh, gw = self.grid
            out = out.reshape(batch, gh, gw, PATCH, PATCH, CHANNELS).permute(0, 1, 3, 2, 4, 5)
            return out.reshape(batch, SIZE, SIZE, CHANNELS)

    return DiT()


def load_dew_params(module, params) -> None:
    """Copy SimpleDiT params into the torch DiT (Dense [in, out] -> [out, in], conv HWIO -> OIHW)."""
    import torch

    with torch.no_grad():
        for name, tensor in module.named_parameters():
            *path, leaf = name.split(".")
            value = params
            for key in path:
                value = value[key]
            value = np.asarray(value["kernel" if leaf == "weight" else "bias"])
            value = value.T if value.ndim == 2 else value.transpose(3, 2, 0, 1) if value.ndim == 4 else value
            if value.shape != tuple(tensor.shape):
                raise ValueError(f"{name}: Dew {value.shape} against torch {tuple(tensor.shape)}")
            tensor.copy_(torch.from_numpy(np.array(value, np.float32)))


def edm_scalings(sigma):
    """(c_in, c_skip, c_out, c_noise) of Karras et al. (2022), Table 1."""
    total = sigma**2 + SIGMA_DATA**2
    return total.rsqrt(), SIGMA_DATA**2 / total, sigma * SIGMA_DATA * total.rsqrt(), sigma.log() / 4


class TorchTraining(harness.Runner):
    def __init__(self, batches: np.ndarray, loss_steps: int, last: int, window: int, compile: bool):
        import torch

        self.torch = torch
        torch.manual_seed(0)
        model = build_torch_dit()
        model.train()
        self.parameters = list(model.parameters())
        self.optimizer = torch.optim.AdamW(self.parameters, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
        self.ema = [p.detach().clone() for p in self.parameters]
        self.model = torch.compile(model) if compile else model
        self.generator = torch.Generator().manual_seed(1)
        self.batches = [torch.from_numpy(b) for b in batches]
        losses = self.run(self.batches[:loss_steps])  # the loss run, or the warm-up (compiles)
        self.info = {"params": sum(p.numel() for p in self.parameters), "threads": torch.get_num_threads(),
                     "torch": torch.__version__}
        if loss_steps >= last:
            self.info.update({f"loss_last{last}": round(statistics.fmean(losses[-last:]), 4),
                              "loss_first10": round(statistics.fmean(losses[:10]), 4)})
        self.timed = self.batches[:window]

    def step(self, images):
        torch = self.torch
        x0 = images.float() / 127.5 - 1.0
        batch = x0.shape[0]
        sigma = torch.exp(P_MEAN + P_STD * torch.randn(batch, generator=self.generator))
        eps = torch.randn(x0.shape, generator=self.generator)
        s = sigma[:, None, None, None]
        x_t = x0 + s * eps
        c_in, c_skip, c_out, _ = edm_scalings(s)
        target = (x0 - c_skip * x_t) / c_out
        output = self.model(c_in * x_t, sigma.log() / 4)
        loss = torch.mean((output - target) ** 2)  # EDM's weighting = 1 on the preconditioned target
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        with torch.no_grad():
            torch._foreach_lerp_(self.ema, self.parameters, 1.0 - EMA)
        return loss.detach()

    def run(self, batches) -> list[float]:
        return [float(x) for x in [self.step(b) for b in batches]]  # losses read after the loop

    def window(self):
        return harness.timed_calls(lambda: self.run(self.timed), 1), len(self.timed)


class DiffusersSampling(harness.Runner):
    def __init__(self, workdir: Path, sample_steps: int, save: bool):
        import diffusers
        import torch

        self.torch, self.steps, self.workdir, self.save = torch, sample_steps, workdir, save
        self.net = build_torch_dit().eval()
        load_dew_params(self.net, pickle.loads((workdir / "variables.pkl").read_bytes())["params"])
        grid = np.load(workdir / "grid.npy")
        self.scheduler, self.exact_sigmas, mismatch = edm_scheduler(sample_steps, grid)
        self.x_T = torch.from_numpy(np.load(workdir / "x_T.npy"))
        self.samples = self.draw().numpy()  # warm-up
        probe, probe_noise = probe_inputs()
        with torch.inference_mode():
            self.probe = self.net(torch.from_numpy(probe), torch.from_numpy(probe_noise)).numpy()
        self.info = {"scheduler_own_grid_max_rel_diff": round(mismatch, 5), "threads": torch.get_num_threads(),
                     "diffusers": diffusers.__version__, "torch": torch.__version__}

    def draw(self):
        return diffusers_sample(self.torch, self.scheduler, self.exact_sigmas, self.net, self.x_T, self.steps)

    def window(self):
        return harness.timed_calls(self.draw, 1), self.x_T.shape[0]

    def finish(self):
        if self.save:
            np.save(self.workdir / "samples_torch.npy", self.samples)
            np.save(self.workdir / "probe_torch.npy", self.probe)
        return {}


# --- sampling -----------------------------------------------------------------------------------


def edm_scheduler(steps: int, grid: np.ndarray):
    """diffusers' HeunDiscreteScheduler set up for EDM's sigma range, with Dew's exact grid.

    Returns (scheduler, largest relative difference between its own Karras grid and Dew's)."""
    import torch
    from diffusers import HeunDiscreteScheduler

    train_steps = 1000
    sigmas = np.exp(np.linspace(math.log(SIGMA_MIN), math.log(SIGMA_MAX), train_steps))
    alphas_cumprod = 1.0 / (1.0 + sigmas**2)
    betas = 1.0 - alphas_cumprod / np.concatenate([[1.0], alphas_cumprod[:-1]])
    scheduler = HeunDiscreteScheduler(
        num_train_timesteps=train_steps, trained_betas=betas.tolist(), prediction_type="sample",
        use_karras_sigmas=True, timestep_spacing="linspace",
    )
    scheduler.set_timesteps(steps)
    own = scheduler.sigmas.numpy()
    exact = torch.from_numpy(grid.astype(np.float32))
    exact = torch.cat([exact[:1], exact[1:-1].repeat_interleave(2), exact[-1:]])
    mismatch = float(np.max(np.abs(own[:-1] - exact.numpy()[:-1]) / exact.numpy()[:-1]))
    return scheduler, exact, mismatch


def diffusers_sample(torch, scheduler, exact_sigmas, net, x_T, steps: int):
    """The usual diffusers denoising loop with an EDM denoiser over the torch DiT."""
    scheduler.set_timesteps(steps)
    scheduler.sigmas = exact_sigmas
    x = x_T * (scheduler.init_noise_sigma / SIGMA_MAX)  # x_T is already sigma_max * eps
    with torch.inference_mode():
        for t in scheduler.timesteps:
            scaled = scheduler.scale_model_input(x, t)
            sigma = scheduler.sigmas[scheduler.step_index].expand(x.shape[0])[:, None, None, None]
            x_sigma = scaled * (sigma**2 + 1).sqrt()  # undo the VP scaling: the network is EDM's
            c_in, c_skip, c_out, c_noise = edm_scalings(sigma)
            denoised = c_skip * x_sigma + c_out * net(c_in * x_sigma, c_noise.reshape(-1))
            x = scheduler.step(denoised, t, x).prev_sample
    return x


def worker(config: dict) -> harness.Runner:
    workdir = Path(config["workdir"])
    if config["side"] == "dew":
        if config["part"] == "train":
            return DewTraining(np.load(workdir / "batches.npy"), config["loss_steps"], config["last"],
                               config["window"], workdir, config["sample_steps"])
        return DewSampling(workdir, config["sample_steps"])
    harness.set_peer_threads(config)
    defaults = config["threads"] is None and not config.get("compile")
    if config["part"] == "train":
        loss_steps = config["loss_steps"] if config.get("loss_run") else WARMUP
        return TorchTraining(np.load(workdir / "batches.npy"), loss_steps, config["last"], config["window"],
                             config.get("compile", False))
    return DiffusersSampling(workdir, config["sample_steps"], save=defaults)


def main() -> None:
    if (config := harness.worker_config()) is not None:
        harness.serve(config, worker)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short sanity run (few steps and windows)")
    parser.add_argument("--batch", type=int, default=32, help="training batch")
    parser.add_argument("--steps", type=int, help="steps of the loss run (default 200; 20 with --quick)")
    parser.add_argument("--last", type=int, help="losses averaged at the end of the loss run (default 50; 10)")
    parser.add_argument("--window", type=int, help="steps per timed window (default 10; 4)")
    parser.add_argument("--repeats", type=int, help="timed windows per side (default 4; 2)")
    parser.add_argument("--sample-batch", type=int, default=16, help="images per sampling run")
    parser.add_argument("--sample-steps", type=int, help="Heun steps (default 40; 10)")
    parser.add_argument("--sample-repeats", type=int, help="timed sampling runs per side (default 3; 2)")
    parser.add_argument("--skip-sampling", action="store_true")
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile configuration")
    parser.add_argument("--dew-python", default=sys.executable, help="interpreter of the Dew side")
    parser.add_argument("--peer-python", default=sys.executable, help="interpreter of the torch sides")
    args = parser.parse_args()
    defaults = dict(steps=(200, 20), last=(50, 10), window=(10, 4), repeats=(4, 2), sample_steps=(40, 10),
                    sample_repeats=(3, 2))
    for name, pair in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, pair[args.quick])
    if args.steps < args.last:
        parser.error("--steps must be at least --last")

    script = str(Path(__file__).resolve())
    hardware = f"{platform.processor() or platform.machine()}, {harness.cores()} cores"
    config = {"loss_steps": args.steps, "last": args.last, "window": args.window,
              "sample_steps": args.sample_steps}
    with tempfile.TemporaryDirectory(prefix="dew-diffusion-") as directory:
        workdir = Path(directory)
        np.save(workdir / "batches.npy", np.stack(make_batches(max(args.steps, args.window), args.batch)))
        train = {**config, "part": "train"}
        sides = [harness.side("dew", "dew", script, [], {**train, "side": "dew"}, python=args.dew_python)]
        sides += harness.torch_sides(script, [], {**train, "side": "torch"}, compile=not args.no_compile,
                                     python=args.peer_python)
        result = harness.compare(sides, args.repeats, workdir=workdir)
        dew = result.dew
        torch_default = next(o for o in result.outcomes if o.name == "torch defaults")
        torch_loss = next(o for o in result.outcomes if o.config.get("loss_run"))
        print(json.dumps({
            "benchmark": "diffusion_train",
            "work": (
                f"SimpleDiT {SIZE}x{SIZE}x{CHANNELS} patch {PATCH}, {LAYERS}L x {HEADS}H x {WIDTH}, "
                f"MLP x{MLP_RATIO:g}, batch {args.batch}, unconditional; EDM (ln sigma ~ N({P_MEAN}, {P_STD}^2), "
                f"Karras preconditioning, sigma_data {SIGMA_DATA}); AdamW lr {LR} betas {list(BETAS)} "
                f"wd {WEIGHT_DECAY}, EMA {EMA}; synthetic disc images"
            ),
            "peer": "plain-torch DiT mirroring SimpleDiT + torch.optim.AdamW (eager, and over torch.compile)",
            "params": {"dew": dew.info["params"], "torch": torch_default.info.get("params")},
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
            "hardware": hardware,
            "jax": dew.info["jax"],
            "torch": torch_default.info.get("torch"),
        }), flush=True)
        if args.skip_sampling:
            return

        x_T = SIGMA_MAX * np.random.default_rng(3).standard_normal((args.sample_batch, SIZE, SIZE, CHANNELS))
        np.save(workdir / "x_T.npy", x_T.astype(np.float32))
        sample_config = {**config, "part": "sample"}
        sides = [harness.side("dew", "dew", script, [], {**sample_config, "side": "dew"}, python=args.dew_python)]
        sides += harness.torch_sides(script, [], {**sample_config, "side": "torch"}, compile=False,
                                     python=args.peer_python, label="diffusers")
        result = harness.compare(sides, args.sample_repeats, workdir=workdir)
        peer = next(o for o in result.outcomes if o.name == "diffusers defaults")
        samples = [np.load(workdir / f"samples_{s}.npy") for s in ("dew", "torch")]
        probes = [np.load(workdir / f"probe_{s}.npy") for s in ("dew", "torch")]
        print(json.dumps({
            "benchmark": "diffusion_sample",
            "work": (
                f"{args.sample_steps} Heun steps ({2 * args.sample_steps - 1} network calls), batch "
                f"{args.sample_batch}, Karras rho 7 grid {SIGMA_MAX} -> {SIGMA_MIN}, over the SimpleDiT trained "
                f"in part 1 (same weights in the torch DiT)"
            ),
            "peer": (
                f"diffusers {peer.info.get('diffusers')} HeunDiscreteScheduler(trained_betas = a log-uniform "
                f"{SIGMA_MIN}..{SIGMA_MAX} sigma table, use_karras_sigmas=True, prediction_type='sample') "
                "loop around the torch DiT as an EDM denoiser; its sigmas replaced by Dew's grid"
            ),
            "scheduler_own_grid_max_rel_diff": peer.info.get("scheduler_own_grid_max_rel_diff"),
            "samples_max_abs_diff": float(np.max(np.abs(samples[0] - samples[1]))),
            "forward_max_abs_diff_same_weights": float(np.max(np.abs(probes[0] - probes[1]))),
            **result.report("images_per_s", 3),
            "goal": "dew_over_best_peer >= 1.2",
            "hardware": hardware,
        }), flush=True)


if __name__ == "__main__":
    main()
