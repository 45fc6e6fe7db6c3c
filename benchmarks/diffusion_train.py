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
initializers), trained by an eager loop with `torch.optim.AdamW`. Parameter counts of both are
reported, and Dew's trained weights are copied into the torch network to check that the two
networks compute the same function. Both read the same pre-generated batches of synthetic images
(seeded: colored discs on a two-color gradient, so the loss falls); the noise draws differ.

Part 1 (training), one process, so machine noise hits both:
  1. a loss run of --steps steps each on the same batch sequence (Dew's compile is part of it),
     reporting the mean loss of the last --last steps of each;
  2. --repeats interleaved timed windows of --window steps each (both warm), reporting the median
     steps/s of each; torch runs at the core count and at one thread and the ratio is taken
     against the faster (dew_over_torch_at_core_count is beside it).
Part 2 (sampling): --sample-steps Heun steps (2 * steps - 1 network calls; the last step, to
sigma 0, is Euler) of --sample-batch images on the Karras rho = 7 grid from 80 to 0.002.
Dew: `dew.sample(process.denoiser(model, variables), x_T, solver=Heun())` over the trained Dew
model. Peer: diffusers' `HeunDiscreteScheduler` in the usual pipeline loop (scale_model_input,
network, step) around the torch DiT holding the same weights, wrapped as an EDM denoiser
(prediction_type="sample"). The scheduler is configured for EDM's range: `trained_betas` whose
sigma table runs log-uniformly from 0.002 to 80 and `use_karras_sigmas=True`, which yields the
same rho = 7 grid; float32 betas put its ends off by up to ~1%, so its sigmas are then replaced by
Dew's grid exactly (the mismatch is reported), and both samplers start from the same x_T. The
JSON line reports images/s of each (median of --sample-repeats interleaved runs, torch at the
core count and at one thread) and the largest difference between the two sets of samples.

Prints one JSON line per part. Needs torch, diffusers and Dew in one environment:

    .venv-ref/bin/python benchmarks/diffusion_train.py [--batch 32] [--steps 200] [--window 20]
        [--repeats 5] [--sample-batch 16] [--sample-steps 40] [--sample-repeats 3]
"""

from __future__ import annotations

import os

# GNU OpenMP's default spin-wait collapses torch's multi-threaded speed when the machine runs more
# busy threads than it has cores; passive waiting avoids that. Set before torch loads libgomp; an
# explicit OMP_WAIT_POLICY in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import contextlib
import itertools
import json
import math
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dew import Dataset, Field, InputSpec, Trainer
from dew.diffusion.presets import EDM
from dew.nn.backbones import SimpleDiT
from dew.objectives.diffusion import DiffusionObjective
from dew.sampling import Heun, sample
from common import EagerLoop, cores

SIZE, CHANNELS, PATCH, WIDTH, LAYERS, HEADS, MLP_RATIO = 32, 3, 4, 128, 4, 4, 4.0
LR, BETAS, EPS, WEIGHT_DECAY, EMA = 3e-4, (0.9, 0.999), 1e-8, 0.01, 0.999
P_MEAN, P_STD, SIGMA_DATA, SIGMA_MIN, SIGMA_MAX = -1.2, 1.2, 0.5, 0.002, 80.0
FREQ_FEATURES, NOISE_SCALE, LN_EPS = 256, 1000.0, 1e-6


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


def dew_model() -> SimpleDiT:
    return SimpleDiT(patch_size=PATCH, emb_features=WIDTH, num_layers=LAYERS, num_heads=HEADS, mlp_ratio=MLP_RATIO)


def dew_trainer() -> Trainer:
    objective = DiffusionObjective(
        dew_model(), EDM(), InputSpec(Field("image", (SIZE, SIZE, CHANNELS))), ema_decay=EMA
    )
    optimizer = optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY)
    return Trainer(objective, optimizer, key=jax.random.key(0))


def dew_fit(trainer: Trainer, batches, steps: int, batch: int):
    """Train `steps` steps from a fresh state; returns (wall seconds, final state)."""
    rows = [{"image": b} for b in batches]
    data = Dataset(train=lambda partition: itertools.cycle(rows), records=len(rows) * batch, batch=batch)
    start = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):
        state = trainer.fit(data, steps=steps, log_every=steps)
    jax.block_until_ready(state)
    return time.perf_counter() - start, state


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


class TorchSide(EagerLoop):
    def __init__(self, torch_batches):
        import torch

        self.torch = torch
        torch.manual_seed(0)
        self.model = build_torch_dit()
        self.model.train()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY
        )
        self.ema = [p.detach().clone() for p in self.model.parameters()]
        self.batches = torch_batches
        self.generator = torch.Generator().manual_seed(1)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

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
            torch._foreach_lerp_(self.ema, list(self.model.parameters()), 1.0 - EMA)
        return loss.detach()


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32, help="training batch")
    parser.add_argument("--steps", type=int, default=200, help="steps of the loss run (each side)")
    parser.add_argument("--last", type=int, default=50, help="losses averaged at the end of the loss run")
    parser.add_argument("--window", type=int, default=20, help="steps per timed window")
    parser.add_argument("--repeats", type=int, default=5, help="timed windows per side")
    parser.add_argument("--sample-batch", type=int, default=16, help="images per sampling run")
    parser.add_argument("--sample-steps", type=int, default=40, help="Heun steps")
    parser.add_argument("--sample-repeats", type=int, default=3, help="timed sampling runs per side")
    parser.add_argument("--skip-sampling", action="store_true")
    args = parser.parse_args()
    if args.steps < args.last:
        parser.error("--steps must be at least --last")

    import torch

    threads = cores()
    torch.set_num_threads(threads)
    load_start = os.getloadavg()[0]
    batches = make_batches(max(args.steps, args.window), args.batch)
    torch_batches = [torch.from_numpy(b) for b in batches]
    hardware = (f"{jax.devices()[0].device_kind} x{jax.device_count()}, "
                f"{platform.processor() or platform.machine()}, {threads} cores")
    thread_counts = sorted({threads, 1}, reverse=True)
    thread_info = {"torch_loss_run": threads, "jax_xla_cpu": f"default pool ({threads} cores)",
                   "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY")}

    trainer = dew_trainer()
    peer = TorchSide(torch_batches)

    # 1. loss run on the same batch sequence (Dew's compile happens here and is not timed below)
    _, state = dew_fit(trainer, batches[: args.steps], args.steps, args.batch)
    dew_losses = [row["loss"] for row in trainer.history]
    _, torch_losses = peer.run(args.steps)

    # 2. interleaved timed windows, both warm; torch at the core count and at one thread
    timed = batches[: args.window]
    peer.batches = torch_batches[: args.window]
    dew_rates, torch_rates = [], {n: [] for n in thread_counts}
    for _ in range(args.repeats):
        for n in thread_counts:
            torch.set_num_threads(n)
            seconds, _ = peer.run(args.window)
            torch_rates[n].append(args.window / seconds)
        dew_rates.append(args.window / dew_fit(trainer, timed, args.window, args.batch)[0])
    torch.set_num_threads(threads)
    dew = statistics.median(dew_rates)
    torch_by_threads = {n: statistics.median(r) for n, r in torch_rates.items()}
    best_threads = max(torch_by_threads, key=torch_by_threads.get)
    peer_rate = torch_by_threads[best_threads]

    # the two networks compute the same function: Dew's trained weights in the torch DiT
    params = state.variables["params"]
    dew_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    net = build_torch_dit().eval()
    load_dew_params(net, params)
    probe = np.random.default_rng(2).standard_normal((4, SIZE, SIZE, CHANNELS)).astype(np.float32)
    probe_noise = np.array([-1.5, -0.5, 0.3, 1.1], np.float32)
    dew_out = np.asarray(trainer.objective.model.apply(state.variables, jnp.asarray(probe), jnp.asarray(probe_noise)))
    with torch.inference_mode():
        torch_out = net(torch.from_numpy(probe), torch.from_numpy(probe_noise)).numpy()
    forward_diff = float(np.max(np.abs(dew_out - torch_out)))

    print(json.dumps({
        "benchmark": "diffusion_train",
        "work": (
            f"SimpleDiT {SIZE}x{SIZE}x{CHANNELS} patch {PATCH}, {LAYERS}L x {HEADS}H x {WIDTH}, MLP x{MLP_RATIO:g}, "
            f"batch {args.batch}, unconditional; EDM (ln sigma ~ N({P_MEAN}, {P_STD}^2), Karras "
            f"preconditioning, sigma_data {SIGMA_DATA}); AdamW lr {LR} betas {list(BETAS)} wd {WEIGHT_DECAY}, "
            f"EMA {EMA}; synthetic disc images"
        ),
        "peer": "plain-torch DiT mirroring SimpleDiT + torch.optim.AdamW, eager",
        "params": {"dew": dew_params, "torch": peer.num_params()},
        "forward_max_abs_diff_same_weights": forward_diff,
        "dew_steps_per_s": round(dew, 3),
        "torch_steps_per_s": round(peer_rate, 3),
        "torch_steps_per_s_by_threads": {str(n): round(r, 3) for n, r in torch_by_threads.items()},
        "dew_images_per_s": round(dew * args.batch, 1),
        "torch_images_per_s": round(peer_rate * args.batch, 1),
        "dew_over_torch": round(dew / peer_rate, 3),
        "dew_over_torch_at_core_count": round(dew / torch_by_threads[threads], 3),
        "goal": "dew_over_torch >= 1.2",
        "timing": f"median of {args.repeats} interleaved windows of {args.window} steps, compile excluded",
        "loss_steps": args.steps,
        f"dew_loss_last{args.last}": round(statistics.fmean(dew_losses[-args.last:]), 4),
        f"torch_loss_last{args.last}": round(statistics.fmean(torch_losses[-args.last:]), 4),
        "dew_loss_first10": round(statistics.fmean(dew_losses[:10]), 4),
        "torch_loss_first10": round(statistics.fmean(torch_losses[:10]), 4),
        "threads": {"torch": best_threads, **thread_info},
        "hardware": hardware,
        "load_average_1m": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        "jax": jax.__version__,
        "torch": torch.__version__,
    }), flush=True)
    if args.skip_sampling:
        return

    # Part 2: sampling with the trained Dew weights, on both sides
    import diffusers

    process = trainer.objective.process
    denoise = process.denoiser(trainer.objective.model, state.variables)
    x_T = process.noise(jax.random.key(3), (args.sample_batch, SIZE, SIZE, CHANNELS))
    grid = np.asarray(process.sigmas(args.sample_steps))
    scheduler, exact_sigmas, grid_mismatch = edm_scheduler(args.sample_steps, grid)
    torch_x_T = torch.from_numpy(np.array(x_T))

    def dew_draw():
        return jax.block_until_ready(sample(denoise, x_T, solver=Heun(), steps=args.sample_steps))

    dew_images = np.asarray(dew_draw())  # compiles
    torch_images = diffusers_sample(torch, scheduler, exact_sigmas, net, torch_x_T, args.sample_steps).numpy()
    sample_rates, diffusers_rates = [], {n: [] for n in thread_counts}
    for _ in range(args.sample_repeats):
        for n in thread_counts:
            torch.set_num_threads(n)
            start = time.perf_counter()
            diffusers_sample(torch, scheduler, exact_sigmas, net, torch_x_T, args.sample_steps)
            diffusers_rates[n].append(args.sample_batch / (time.perf_counter() - start))
        start = time.perf_counter()
        dew_draw()
        sample_rates.append(args.sample_batch / (time.perf_counter() - start))
    torch.set_num_threads(threads)
    dew_sampling = statistics.median(sample_rates)
    diffusers_by_threads = {n: statistics.median(r) for n, r in diffusers_rates.items()}
    best_sampling_threads = max(diffusers_by_threads, key=diffusers_by_threads.get)
    diffusers_rate = diffusers_by_threads[best_sampling_threads]

    print(json.dumps({
        "benchmark": "diffusion_sample",
        "work": (
            f"{args.sample_steps} Heun steps ({2 * args.sample_steps - 1} network calls), batch "
            f"{args.sample_batch}, Karras rho 7 grid {SIGMA_MAX} -> {SIGMA_MIN}, over the trained "
            f"SimpleDiT of diffusion_train (same weights in the torch DiT)"
        ),
        "peer": (
            f"diffusers {diffusers.__version__} HeunDiscreteScheduler(trained_betas = a log-uniform "
            f"{SIGMA_MIN}..{SIGMA_MAX} sigma table, use_karras_sigmas=True, prediction_type='sample') "
            "loop around the torch DiT as an EDM denoiser; its sigmas replaced by Dew's grid"
        ),
        "scheduler_own_grid_max_rel_diff": round(grid_mismatch, 5),
        "samples_max_abs_diff": float(np.max(np.abs(dew_images - torch_images))),
        "dew_images_per_s": round(dew_sampling, 3),
        "diffusers_images_per_s": round(diffusers_rate, 3),
        "diffusers_images_per_s_by_threads": {str(n): round(r, 3) for n, r in diffusers_by_threads.items()},
        "dew_over_diffusers": round(dew_sampling / diffusers_rate, 3),
        "dew_over_diffusers_at_core_count": round(dew_sampling / diffusers_by_threads[threads], 3),
        "goal": "dew_over_diffusers >= 1.2",
        "timing": f"median of {args.sample_repeats} interleaved runs, compile excluded",
        "threads": {"torch": best_sampling_threads, "jax_xla_cpu": thread_info["jax_xla_cpu"],
                    "OMP_WAIT_POLICY": thread_info["OMP_WAIT_POLICY"]},
        "hardware": hardware,
        "load_average_1m": round(os.getloadavg()[0], 2),
        "jax": jax.__version__,
        "torch": torch.__version__,
    }), flush=True)


if __name__ == "__main__":
    main()
