"""Training throughput of a Llama-style decoder: Dew's Trainer against transformers + torch.

Two sizes. `small` is nanoGPT's CPU shakespeare_char run (4 layers, 4 heads, width 128, context
64, batch 12, no dropout) in Llama form: a byte-level vocabulary of 256, RoPE, RMSNorm, a SwiGLU
MLP of 512 (the same 4x width as nanoGPT's GELU MLP), tied embeddings, no biases. `large` (width
512, 8 layers, 8 heads, SwiGLU 1536, context 256, batch 8) is where the matrix products dominate.
Dew trains `CausalTransformer` with `Trainer` + `LMObjective`; the peer is transformers'
`LlamaForCausalLM` of the identical configuration, trained by a plain eager torch loop (and, as a
further configuration, the same loop over `torch.compile(model)`). Both use AdamW at a constant lr
1e-3, betas (0.9, 0.99), eps 1e-8, weight decay 0.1 on the 2-D weights only (matrices and the
embedding, not the RMSNorm scales, as nanoGPT does), and no gradient clipping. Both read the same
batches: context + 1 byte windows of the corpus, drawn from a seeded generator by the parent
process and shared through a file. The corpus is tinyshakespeare when the shared data folder
holds it, else the text of Python's help topics (`dew.data.corpora`, as `dew demo` uses).

Each side runs in its own process (benchmarks/harness.py): Dew, and torch at its library
defaults, at each smaller thread count and under `torch.compile`, with no environment setting
that slows it. Per size:
  1. setup: Dew and torch (its one-thread configuration, which never collapses on a busy
     machine) each train --steps steps on the same batch sequence from the same seed (Dew's
     compile is part of it) and report the mean loss of the last 20 (or of all, when fewer);
     the other torch configurations warm up (and compile) on a few steps;
  2. --repeats rounds of alternating timed windows of --window steps per side; the median
     tokens/s of each configuration is reported, and Dew's ratio against the fastest;
  3. the machine's matmul ceiling: a jitted float32 1024^3 matmul in JAX (Dew's process) and
     torch.mm (torch's default process), so each side's achieved FLOP/s is a fraction of the
     faster, with nanoGPT's estimate_mfu count: flops/token = 6 N + 12 L H Q T.
Prints one JSON line per size.

    .venv-ref/bin/python benchmarks/lm_train.py [--sizes small large] [--quick]
        [--steps N] [--window N] [--repeats N] [--data PATH | --synthetic]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import harness

# read when present; otherwise the corpus every install has (dew.data.corpora)
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"

VOCAB, LR, BETAS, EPS, WEIGHT_DECAY, NORM_EPS, ROPE_THETA = 256, 1e-3, (0.9, 0.99), 1e-8, 0.1, 1e-6, 10000.0
LAST = 20  # losses averaged at the end of the loss run (all of them when it is shorter)
WARMUP = 3  # steps a configuration without a loss run takes before its windows (compiles here)


@dataclasses.dataclass(frozen=True)
class Size:
    width: int
    layers: int
    heads: int
    mlp: int
    context: int
    batch: int
    steps: int  # loss run
    window: int
    repeats: int
    quick: tuple[int, int, int]  # steps, window, repeats of --quick


SIZES = {
    "small": Size(128, 4, 4, 512, 64, 12, steps=200, window=20, repeats=4, quick=(LAST, 5, 2)),
    "large": Size(512, 8, 8, 1536, 256, 8, steps=6, window=2, repeats=3, quick=(4, 1, 2)),
}


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


def make_batches(corpus: np.ndarray, count: int, size: Size, seed: int = 0) -> np.ndarray:
    """[count, batch, context + 1] random windows of the corpus."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(corpus) - size.context - 1, (count, size.batch))
    return np.stack([np.stack([corpus[s : s + size.context + 1] for s in row]) for row in starts])


# --- Dew ----------------------------------------------------------------------------------------


class DewSide(harness.Runner):
    def __init__(self, size: Size, batches: np.ndarray, loss_steps: int, window: int):
        import jax
        import jax.numpy as jnp
        import optax

        from dew import Trainer
        from dew.nn.backbones import CausalTransformer
        from dew.objectives.lm import LMObjective

        self.size = size
        model = CausalTransformer(
            vocab_size=VOCAB, emb_features=size.width, num_layers=size.layers, num_heads=size.heads,
            num_kv_heads=size.heads, mlp_features=size.mlp, max_seq_len=size.context, rope_theta=ROPE_THETA,
            norm_eps=NORM_EPS, qk_norm=False, tie_embeddings=True, dtype=jnp.float32, param_dtype=jnp.float32,
        )
        decay_mask = lambda params: jax.tree_util.tree_map(lambda p: p.ndim >= 2, params)  # noqa: E731
        optimizer = optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY, mask=decay_mask)
        self.trainer = Trainer(LMObjective(model, size.context), optimizer, key=jax.random.key(0))
        self.fit(batches[:loss_steps], loss_steps)  # the loss run; compiles
        losses = [row["loss"] for row in self.trainer.history]
        params = sum(x.size for x in jax.tree_util.tree_leaves(self.trainer.init_state().variables["params"]))
        self.info = {"params": params, "loss_last": round(statistics.fmean(losses[-LAST:]), 4),
                     "loss_first": round(losses[0], 4), "jax": jax.__version__}
        self.timed, self.steps = batches[:window], window

    def fit(self, batches, steps: int) -> float:
        """Train `steps` steps from a fresh state, as a user's `fit` call does; the wall seconds."""
        return harness.timed_fit(self.trainer, batches, self.size.batch, steps)

    def window(self):
        return self.fit(self.timed, self.steps), self.steps * self.size.batch * self.size.context

    def finish(self):
        return {"matmul_gflops": matmul_gflops_jax()}


def flops_per_token(params: int, layers: int, heads: int, head_dim: int, context: int) -> int:
    """nanoGPT's estimate_mfu count for one trained token: 6 N + 12 L H Q T."""
    return 6 * params + 12 * layers * heads * head_dim * context


def matmul_ceiling(*outcomes) -> float:
    """The machine's matmul ceiling in FLOP/s: the fastest `matmul_gflops` the outcomes measured."""
    return max(o.finished.get("matmul_gflops", 0) for o in outcomes) * 1e9


def fraction_of_ceiling(rate: float | None, flops: int, ceiling: float) -> float | None:
    """Tokens/s `rate` at `flops` per token as a fraction of `ceiling` (None when either is unknown)."""
    return round(rate * flops / ceiling, 3) if ceiling and rate else None


def matmul_gflops_jax(n: int = 1024, calls: int = 20, repeats: int = 5) -> float:
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(2), (n, n), jnp.float32)
    mm = jax.jit(jnp.dot)
    mm(a, b).block_until_ready()
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = mm(a, b)
        out.block_until_ready()
        rates.append(2 * n**3 * calls / (time.perf_counter() - start) / 1e9)
    return round(statistics.median(rates), 1)


# --- transformers + torch -----------------------------------------------------------------------


class TorchSide(harness.Runner):
    def __init__(self, size: Size, batches: np.ndarray, loss_steps: int, window: int, compile: bool):
        import torch
        import transformers
        from transformers import LlamaConfig, LlamaForCausalLM

        self.torch, self.size = torch, size
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=VOCAB, hidden_size=size.width, intermediate_size=size.mlp, num_hidden_layers=size.layers,
            num_attention_heads=size.heads, num_key_value_heads=size.heads, max_position_embeddings=size.context,
            rms_norm_eps=NORM_EPS, rope_theta=ROPE_THETA, tie_word_embeddings=True, attention_bias=False,
            mlp_bias=False, attention_dropout=0.0, hidden_act="silu", use_cache=False,
        )
        model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        self.optimizer = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS)
        self.model = torch.compile(model) if compile else model
        self.batches = [torch.from_numpy(b.astype(np.int64)) for b in batches]
        losses = self.run(self.batches[:loss_steps])  # the loss run, or the warm-up (compiles)
        self.info = {"params": sum(p.numel() for p in model.parameters()), "threads": torch.get_num_threads(),
                     "torch": torch.__version__, "transformers": transformers.__version__}
        if loss_steps > WARMUP:
            self.info.update({"loss_last": round(statistics.fmean(losses[-LAST:]), 4),
                              "loss_first": round(losses[0], 4)})
        self.timed = self.batches[:window]

    def step(self, batch):
        torch = self.torch
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = self.model(input_ids=inputs, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def run(self, batches) -> list[float]:
        return [float(x) for x in [self.step(b) for b in batches]]  # losses read after the loop

    def window(self):
        start = time.perf_counter()
        self.run(self.timed)
        return time.perf_counter() - start, len(self.timed) * self.size.batch * self.size.context

    def finish(self):
        return {"matmul_gflops": matmul_gflops_torch()}


def matmul_gflops_torch(n: int = 1024, calls: int = 20, repeats: int = 5) -> float:
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    rates = []
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(calls):
                torch.mm(a, b)
            rates.append(2 * n**3 * calls / (time.perf_counter() - start) / 1e9)
    return round(statistics.median(rates), 1)


def worker(config: dict) -> harness.Runner:
    size = SIZES[config["size"]]
    batches = np.load(Path(config["workdir"]) / f"batches_{config['size']}.npy")
    if config["side"] == "dew":
        return DewSide(size, batches, config["loss_steps"], config["window"])
    harness.set_peer_threads(config)
    loss_steps = config["loss_steps"] if config.get("loss_run") else WARMUP
    return TorchSide(size, batches, loss_steps, config["window"], config.get("compile", False))


# --- the parent ---------------------------------------------------------------------------------


def main() -> None:
    if (config := harness.worker_config()) is not None:
        harness.serve(config, worker)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["small", "large"])
    parser.add_argument("--quick", action="store_true", help="a short sanity run (few steps and windows)")
    parser.add_argument("--steps", type=int, help="steps of the loss run (default: the size's)")
    parser.add_argument("--window", type=int, help="steps per timed window (default: the size's)")
    parser.add_argument("--repeats", type=int, help="timed windows per side (default: the size's)")
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile configuration")
    parser.add_argument("--dew-python", default=sys.executable, help="interpreter of the Dew side")
    parser.add_argument("--peer-python", default=sys.executable, help="interpreter of the torch sides")
    parser.add_argument("--data", default=None,
                        help="a text file read as bytes (default: the shared tinyshakespeare when present, "
                             "else Python's help topics)")
    parser.add_argument("--synthetic", action="store_true", help="a generated byte corpus instead of --data")
    args = parser.parse_args()
    corpus, corpus_name = load_corpus(args.data, args.synthetic)
    for name in args.sizes:
        run_size(name, SIZES[name], args, corpus, corpus_name)


def run_size(name: str, size: Size, args, corpus: np.ndarray, corpus_name: str) -> None:
    steps, window, repeats = size.quick if args.quick else (size.steps, size.window, size.repeats)
    steps, window, repeats = args.steps or steps, args.window or window, args.repeats or repeats
    if steps <= WARMUP:
        sys.exit(f"lm_train: --steps must be more than {WARMUP}, got {steps}")
    script = str(Path(__file__).resolve())
    config = {"size": name, "loss_steps": steps, "window": window}
    sides = [harness.side("dew", "dew", script, [], {**config, "side": "dew"}, python=args.dew_python)]
    sides += harness.torch_sides(script, [], {**config, "side": "torch"}, compile=not args.no_compile,
                                 python=args.peer_python)
    with tempfile.TemporaryDirectory(prefix="dew-lm-train-") as workdir:
        np.save(Path(workdir) / f"batches_{name}.npy", make_batches(corpus, max(steps, window), size))
        result = harness.compare(sides, repeats, workdir=workdir)
    dew, best = result.dew, result.best_peer
    torch_default = next(o for o in result.outcomes if o.name == "torch defaults")
    torch_loss = next(o for o in result.outcomes if o.config.get("loss_run"))
    params = dew.info["params"]
    flops = flops_per_token(params, size.layers, size.heads, size.width // size.heads, size.context)
    ceiling = matmul_ceiling(dew, torch_default)
    report = {
        "benchmark": "lm_train",
        "size": name,
        "work": (
            f"Llama-style decoder {size.layers}L x {size.heads}H x {size.width}, SwiGLU {size.mlp}, context "
            f"{size.context}, batch {size.batch}, byte vocab {VOCAB}, tied; AdamW lr {LR} betas {list(BETAS)} "
            f"wd {WEIGHT_DECAY} on 2-D weights, no clipping"
        ),
        "corpus": f"{corpus_name}, {len(corpus)} bytes",
        "params": {"dew": params, "torch": torch_default.info.get("params")},
        **result.report("tokens_per_s", 1),
        "goal": "dew_over_best_peer >= 1.2",
        "window_steps": window,
        "loss_steps": steps,
        f"dew_loss_last{min(LAST, steps)}": dew.info.get("loss_last"),
        f"torch_loss_last{min(LAST, steps)}": torch_loss.info.get("loss_last"),
        "dew_loss_first": dew.info.get("loss_first"),
        "torch_loss_first": torch_loss.info.get("loss_first"),
        "torch_loss_run_by": torch_loss.name,
        "flops_per_token": flops,
        "matmul_gflops": {"jax_f32_1024": dew.finished.get("matmul_gflops"),
                          "torch_f32_1024": torch_default.finished.get("matmul_gflops")},
        "dew_fraction_of_matmul": fraction_of_ceiling(dew.rate, flops, ceiling),
        "best_peer_fraction_of_matmul": fraction_of_ceiling(best.rate, flops, ceiling),
        "torch_default_threads": torch_default.info.get("threads"),
        "hardware": harness.hardware(),
        "jax": dew.info.get("jax"),
        "torch": torch_default.info.get("torch"),
        "transformers": torch_default.info.get("transformers"),
    }
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
