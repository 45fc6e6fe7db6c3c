"""Training throughput of a small Llama-style decoder: Dew's Trainer against transformers + torch.

The work is nanoGPT's CPU shakespeare_char run (4 layers, 4 heads, width 128, context 64, batch 12,
no dropout) in Llama form: a byte-level vocabulary of 256, RoPE, RMSNorm, a SwiGLU MLP of 512 (the
same 4x width as nanoGPT's GELU MLP), tied embeddings, no biases. Dew trains `CausalTransformer`
with `Trainer` + `LMObjective`; the peer is transformers' `LlamaForCausalLM` of the identical
configuration, trained by a plain eager torch loop. Both use AdamW at a constant lr 1e-3, betas
(0.9, 0.99), eps 1e-8, weight decay 0.1 on the 2-D weights only (matrices and the embedding, not
the RMSNorm scales, as nanoGPT does), and no gradient clipping. Both read the same batches: 65-byte
windows of the corpus (64 inputs, 64 next-byte targets), drawn from a seeded generator. The corpus is
tinyshakespeare when the shared data folder holds it, else the text of Python's help topics
(`dew.data.corpora`, in every install, as `dew demo` uses); the JSON line names the one used.

One process runs both, so machine noise hits both:
  1. a loss run of --steps steps each on the same batch sequence (the first, compiling, call of
     Dew is part of it), reporting the mean loss of the last 20 steps of each;
  2. --repeats interleaved timed windows of --window steps each (after both are warm), reporting
     the median tokens/s of each and their ratio; torch runs at the core count and at one thread
     (on a shared, oversubscribed machine one thread can win), and the ratio is taken against the
     faster (dew_over_torch_at_core_count is beside it);
  3. the machine's matmul ceiling: a jitted float32 1024x1024 @ 1024x1024 in JAX (and torch.mm
     beside it), so each side's achieved FLOP/s is reported as a fraction of the faster of the two,
     with nanoGPT's estimate_mfu count: flops/token = 6 N + 12 L H Q T (N parameters, L layers,
     H heads, Q head width, T context).
Prints one JSON line.

Needs torch, transformers and Dew in one environment:

    .venv-ref/bin/python benchmarks/lm_train.py [--steps 200] [--window 40] [--repeats 5]
        [--data PATH | --synthetic]
"""

from __future__ import annotations

import os

# GNU OpenMP's default spin-wait collapses torch's multi-threaded speed (0.2-0.5 steps/s instead of
# ~3.5) when the machine runs more busy threads than it has cores; passive waiting avoids that. Set
# before torch loads libgomp; an explicit OMP_WAIT_POLICY in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import contextlib
import itertools
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dew import Dataset, Trainer
from dew.nn.backbones import CausalTransformer
from dew.objectives.lm import LMObjective
from common import EagerLoop, cores

# read when present; otherwise the corpus every install has (dew.data.corpora)
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"

# nanoGPT's CPU shakespeare_char settings, in Llama form
VOCAB, WIDTH, LAYERS, HEADS, MLP, CONTEXT, BATCH = 256, 128, 4, 4, 512, 64, 12
LR, BETAS, EPS, WEIGHT_DECAY, NORM_EPS, ROPE_THETA = 1e-3, (0.9, 0.99), 1e-8, 0.1, 1e-6, 10000.0
LAST = 20  # losses averaged at the end of the loss run


def load_corpus(path: str | None, synthetic: bool) -> tuple[np.ndarray, str]:
    """The corpus as byte ids, and its name for the JSON line: `path` when given, else the shared
    tinyshakespeare when present, else Python's help topics; or generated words with `synthetic`."""
    if synthetic:
        rng = np.random.default_rng(1)
        # a learnable byte stream: random words over a 40-letter alphabet, so the loss falls
        words = ["".join(chr(97 + c % 26) for c in rng.integers(0, 40, rng.integers(2, 8))) for _ in range(2000)]
        text = " ".join(words[i] for i in rng.integers(0, len(words), 200_000))
        return as_bytes(text.encode()), "synthetic words"
    if path is None and not SHARED_DATA.is_file():
        from dew.data.corpora import HELP_TOPICS, help_topics_text

        return as_bytes(help_topics_text().encode("utf-8")), HELP_TOPICS
    file = Path(path) if path is not None else SHARED_DATA
    if not file.is_file():
        sys.exit(f"lm_train: no corpus at {file}; pass --data PATH to a text file, or --synthetic")
    return as_bytes(file.read_bytes()), file.name


def as_bytes(data: bytes) -> np.ndarray:
    return np.frombuffer(data, np.uint8).astype(np.int32)


def make_batches(corpus: np.ndarray, count: int, seed: int = 0) -> list[np.ndarray]:
    """`count` batches of BATCH random windows of CONTEXT + 1 bytes."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(corpus) - CONTEXT - 1, (count, BATCH))
    return [np.stack([corpus[s : s + CONTEXT + 1] for s in row]) for row in starts]


# --- Dew ----------------------------------------------------------------------------------------


def dew_trainer() -> Trainer:
    model = CausalTransformer(
        vocab_size=VOCAB, emb_features=WIDTH, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=HEADS,
        mlp_features=MLP, max_seq_len=CONTEXT, rope_theta=ROPE_THETA, norm_eps=NORM_EPS,
        qk_norm=False, tie_embeddings=True, dtype=jnp.float32, param_dtype=jnp.float32,
    )
    decay_mask = lambda params: jax.tree_util.tree_map(lambda p: p.ndim >= 2, params)  # noqa: E731
    optimizer = optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY, mask=decay_mask)
    return Trainer(LMObjective(model, CONTEXT), optimizer, key=jax.random.key(0))


def dew_fit(trainer: Trainer, batches, steps: int) -> float:
    """Train `steps` steps from a fresh state; returns the wall seconds (progress lines go to stderr)."""
    rows = [{"text": b} for b in batches]
    data = Dataset(train=lambda partition: itertools.cycle(rows), records=len(rows), batch=BATCH)
    start = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):
        state = trainer.fit(data, steps=steps, log_every=steps)
    jax.block_until_ready(state)
    return time.perf_counter() - start


# --- transformers + torch -----------------------------------------------------------------------


class TorchSide(EagerLoop):
    def __init__(self, torch_batches):
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        self.torch = torch
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=MLP, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=CONTEXT,
            rms_norm_eps=NORM_EPS, rope_theta=ROPE_THETA, tie_word_embeddings=True,
            attention_bias=False, mlp_bias=False, attention_dropout=0.0, hidden_act="silu",
            use_cache=False,
        )
        self.model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
        self.model.train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        self.optimizer = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS)
        self.batches = torch_batches

    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def step(self, batch):
        torch = self.torch
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = self.model(input_ids=inputs, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return loss.detach()


# --- the machine's matmul ceiling ---------------------------------------------------------------


def matmul_flops(size: int = 1024, calls: int = 20, repeats: int = 5) -> tuple[float, float]:
    """Median float32 FLOP/s of a size^3 matmul: (jitted jnp.dot, torch.mm)."""
    import torch

    a = jax.random.normal(jax.random.key(1), (size, size), jnp.float32)
    b = jax.random.normal(jax.random.key(2), (size, size), jnp.float32)
    mm = jax.jit(jnp.dot)
    mm(a, b).block_until_ready()
    ta, tb = torch.randn(size, size), torch.randn(size, size)
    torch.mm(ta, tb)
    jax_rates, torch_rates = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = mm(a, b)
        out.block_until_ready()
        jax_rates.append(2 * size**3 * calls / (time.perf_counter() - start))
        with torch.inference_mode():
            start = time.perf_counter()
            for _ in range(calls):
                torch.mm(ta, tb)
            torch_rates.append(2 * size**3 * calls / (time.perf_counter() - start))
    return statistics.median(jax_rates), statistics.median(torch_rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="steps of the loss run (each side)")
    parser.add_argument("--window", type=int, default=40, help="steps per timed window")
    parser.add_argument("--repeats", type=int, default=5, help="timed windows per side")
    parser.add_argument("--data", default=None,
                        help="a text file read as bytes (default: the shared tinyshakespeare when present, "
                             "else Python's help topics)")
    parser.add_argument("--synthetic", action="store_true", help="a generated byte corpus instead of --data")
    args = parser.parse_args()
    if args.steps < LAST:
        parser.error(f"--steps must be at least {LAST}")

    import torch

    threads = cores()
    torch.set_num_threads(threads)
    corpus, corpus_name = load_corpus(args.data, args.synthetic)
    batches = make_batches(corpus, max(args.steps, args.window))
    torch_batches = [torch.from_numpy(b.astype(np.int64)) for b in batches]

    trainer = dew_trainer()
    peer = TorchSide(torch_batches)

    # 1. loss run on the same batch sequence (Dew's compile happens here and is not timed below)
    dew_fit(trainer, batches[: args.steps], args.steps)
    dew_losses = [row["loss"] for row in trainer.history]
    _, torch_losses = peer.run(args.steps)

    # 2. interleaved timed windows, both warm; torch at the core count and at one thread (on a
    # shared machine one thread can be faster), and the ratio is taken against the faster
    timed = batches[: args.window]
    peer.batches = torch_batches[: args.window]
    thread_counts = sorted({threads, 1}, reverse=True)
    dew_rates, torch_rates = [], {n: [] for n in thread_counts}
    tokens = args.window * BATCH * CONTEXT
    for _ in range(args.repeats):
        for n in thread_counts:
            torch.set_num_threads(n)
            seconds, _ = peer.run(args.window)
            torch_rates[n].append(tokens / seconds)
        dew_rates.append(tokens / dew_fit(trainer, timed, args.window))
    torch.set_num_threads(threads)
    dew = statistics.median(dew_rates)
    torch_by_threads = {n: statistics.median(r) for n, r in torch_rates.items()}
    best_threads = max(torch_by_threads, key=torch_by_threads.get)
    peer_rate = torch_by_threads[best_threads]

    # 3. FLOPs, nanoGPT's estimate_mfu: 6N per token for the weights, 12 L H Q T for attention
    params = sum(x.size for x in jax.tree_util.tree_leaves(trainer.init_state().variables["params"]))
    torch_params = peer.num_params()
    head_dim = WIDTH // HEADS
    flops_per_token = 6 * params + 12 * LAYERS * HEADS * head_dim * CONTEXT
    jax_mm, torch_mm = matmul_flops()
    ceiling = max(jax_mm, torch_mm)

    print(
        json.dumps(
            {
                "benchmark": "lm_train",
                "work": (
                    f"Llama-style decoder {LAYERS}L x {HEADS}H x {WIDTH}, SwiGLU {MLP}, context {CONTEXT}, "
                    f"batch {BATCH}, byte vocab {VOCAB}, tied; AdamW lr {LR} betas {list(BETAS)} "
                    f"wd {WEIGHT_DECAY} on 2-D weights, no clipping; {corpus_name}"
                ),
                "corpus": f"{corpus_name}, {len(corpus)} bytes",
                "params": {"dew": params, "torch": torch_params},
                "dew_tokens_per_s": round(dew, 1),
                "torch_tokens_per_s": round(peer_rate, 1),
                "torch_tokens_per_s_by_threads": {str(n): round(r, 1) for n, r in torch_by_threads.items()},
                "dew_over_torch": round(dew / peer_rate, 3),
                "dew_over_torch_at_core_count": round(dew / torch_by_threads[threads], 3),
                "goal": "dew_over_torch >= 1.2",
                "timing": f"median of {args.repeats} interleaved windows of {args.window} steps, compile excluded",
                "loss_steps": args.steps,
                f"dew_loss_last{LAST}": round(statistics.fmean(dew_losses[-LAST:]), 4),
                f"torch_loss_last{LAST}": round(statistics.fmean(torch_losses[-LAST:]), 4),
                "dew_loss_first": round(dew_losses[0], 4),
                "torch_loss_first": round(torch_losses[0], 4),
                "flops_per_token": flops_per_token,
                "flops_formula": (
                    f"6*{params} + 12*L{LAYERS}*H{HEADS}*Q{head_dim}*T{CONTEXT} (nanoGPT estimate_mfu)"
                ),
                "matmul_gflops": {"jax_f32_1024": round(jax_mm / 1e9, 1), "torch_f32_1024": round(torch_mm / 1e9, 1)},
                "dew_gflops": round(dew * flops_per_token / 1e9, 2),
                "torch_gflops": round(peer_rate * flops_per_token / 1e9, 2),
                "dew_fraction_of_matmul": round(dew * flops_per_token / ceiling, 3),
                "torch_fraction_of_matmul": round(peer_rate * flops_per_token / ceiling, 3),
                "threads": {
                    "torch": best_threads, "torch_loss_run": threads,
                    "jax_xla_cpu": f"default pool ({threads} cores)",
                    "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
                },
                "hardware": f"{jax.devices()[0].device_kind} x{jax.device_count()}, "
                f"{platform.processor() or platform.machine()}, {threads} cores",
                "load_average_1m": round(os.getloadavg()[0], 2),
                "jax": jax.__version__,
                "torch": torch.__version__,
                "transformers": __import__("transformers").__version__,
            }
        )
    )


if __name__ == "__main__":
    main()
