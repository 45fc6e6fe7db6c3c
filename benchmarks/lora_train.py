"""LoRA fine-tuning throughput: Dew's adapted bundle against transformers + peft + torch AdamW.

The base is the random Qwen3 of benchmarks/lm_decode.py (width 512, 8 layers, 8 query heads over 4
key/value heads of 64, SwiGLU 1536, vocabulary 8192, tied), written once as a Hugging Face
checkpoint that both sides load. The adapter is rank 8, alpha 16, on q_proj, k_proj, v_proj and
o_proj of every layer; both sides train it with AdamW (lr 1e-3, betas (0.9, 0.999), eps 1e-8, no
weight decay, no clipping) on the same batches: 8 rows of 256 + 1 token ids, byte windows of the
corpus lm_train.py reads. Dew trains `Pretrained.load(base).adapt(LoRA(...), key=0)` through
`LMObjective` and `Trainer`; the peer trains `peft.get_peft_model(Qwen3ForCausalLM, LoraConfig(...))`
with a plain eager loop, at its defaults, at each smaller thread count and under `torch.compile`
(benchmarks/harness.py). Reported besides the tokens/s and the ratio: the bytes of optimizer state
of each side, and Dew's full fine-tune of the same base (every weight trained, as a reference timed
in the same rounds), so the LoRA step can be read against it.

    .venv-ref/bin/python benchmarks/lora_train.py [--quick] [--steps N] [--window N] [--repeats N]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import harness
from lm_decode import build_checkpoint
from lm_train import load_corpus

RANK, ALPHA, MODULES = 8, 16, ("q_proj", "k_proj", "v_proj", "o_proj")
LR, BETAS, EPS = 1e-3, (0.9, 0.999), 1e-8
CONTEXT, BATCH = 256, 8
WARMUP = 2  # steps a configuration takes before its windows (compiles here)


def make_batches(corpus: np.ndarray, count: int, seed: int = 0) -> np.ndarray:
    """[count, batch, context + 1] random windows of the corpus (byte ids, inside the vocabulary)."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(corpus) - CONTEXT - 1, (count, BATCH))
    return np.stack([np.stack([corpus[s: s + CONTEXT + 1] for s in row]) for row in starts])


def tree_bytes(tree) -> int:
    import jax

    return int(sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(tree) if hasattr(leaf, "nbytes")))


# --- Dew ----------------------------------------------------------------------------------------


class DewSide(harness.Runner):
    def __init__(self, workdir: Path, batches: np.ndarray, loss_steps: int, window: int, full: bool):
        import jax
        import jax.numpy as jnp
        import optax

        from dew import Trainer
        from dew.interop import Pretrained
        from dew.nn.adapters import LoRA
        from dew.objectives.lm import LMObjective

        pretrained = Pretrained.load(workdir / "checkpoint", dtype=jnp.float32, max_seq_len=CONTEXT)
        bundle = pretrained if full else pretrained.adapt(LoRA(rank=RANK, alpha=ALPHA, modules=MODULES), key=0)
        optimizer = optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=0.0)
        self.trainer = Trainer(LMObjective(bundle, CONTEXT), optimizer, key=jax.random.key(0))
        self.fit(batches[:loss_steps], loss_steps)  # compiles
        losses = [row["loss"] for row in self.trainer.history]
        state = self.trainer.init_state()
        self.info = {"trained_params": int(sum(x.size for x in jax.tree_util.tree_leaves(state.variables["params"]))),
                     "optimizer_state_bytes": tree_bytes(state.opt_state),
                     "loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4), "jax": jax.__version__}
        self.timed, self.steps = batches[:window], window

    def fit(self, batches, steps: int) -> float:
        """Train `steps` steps from a fresh state, as a user's `fit` call does; the wall seconds."""
        return harness.timed_fit(self.trainer, batches, BATCH, steps)

    def window(self):
        return self.fit(self.timed, self.steps), self.steps * BATCH * CONTEXT


# --- transformers + peft + torch ----------------------------------------------------------------


class TorchSide(harness.Runner):
    def __init__(self, workdir: Path, batches: np.ndarray, loss_steps: int, window: int, compile: bool):
        import peft
        import torch
        import transformers

        self.torch = torch
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(workdir / "checkpoint"), dtype=torch.float32, attn_implementation="sdpa")
        config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=list(MODULES),
                                 task_type="CAUSAL_LM")
        adapted = peft.get_peft_model(model, config)
        adapted.train()
        trained = [p for p in adapted.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trained, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
        self.model = torch.compile(adapted) if compile else adapted
        self.batches = [torch.from_numpy(b.astype(np.int64)) for b in batches]
        losses = self.run(self.batches[:loss_steps])  # the loss run, or the warm-up (compiles)
        state_bytes = sum(t.numel() * t.element_size() for s in self.optimizer.state.values()
                          for t in s.values() if torch.is_tensor(t))
        self.info = {"trained_params": sum(p.numel() for p in trained), "optimizer_state_bytes": int(state_bytes),
                     "loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4),
                     "threads": torch.get_num_threads(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "peft": peft.__version__}
        self.timed = self.batches[:window]

    def step(self, batch):
        torch = self.torch
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = self.model(input_ids=inputs, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def run(self, batches) -> list[float]:
        return [float(x) for x in [self.step(b) for b in batches]]

    def window(self):
        start = time.perf_counter()
        self.run(self.timed)
        return time.perf_counter() - start, len(self.timed) * BATCH * CONTEXT


def worker(config: dict) -> harness.Runner:
    workdir = Path(config["workdir"])
    batches = np.load(workdir / "batches.npy")
    loss_steps = config["loss_steps"] if config.get("loss_run", config["side"] != "torch") else WARMUP
    if config["side"] in ("dew", "dew-full"):
        return DewSide(workdir, batches, loss_steps, config["window"], full=config["side"] == "dew-full")
    harness.set_peer_threads(config)
    return TorchSide(workdir, batches, loss_steps, config["window"], config.get("compile", False))


# --- the parent ---------------------------------------------------------------------------------


def main() -> None:
    if (config := harness.worker_config()) is not None:
        harness.serve(config, worker)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short sanity run")
    parser.add_argument("--steps", type=int, help="steps of the loss run (default 6, --quick 3)")
    parser.add_argument("--window", type=int, help="steps per timed window (default 2, --quick 1)")
    parser.add_argument("--repeats", type=int, help="timed windows per side (default 3, --quick 2)")
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile configuration")
    parser.add_argument("--dew-python", default=sys.executable, help="interpreter of the Dew sides")
    parser.add_argument("--peer-python", default=sys.executable, help="interpreter of the torch sides")
    args = parser.parse_args()
    steps, window, repeats = (3, 1, 2) if args.quick else (6, 2, 3)
    steps, window, repeats = args.steps or steps, args.window or window, args.repeats or repeats
    if steps <= WARMUP:
        sys.exit(f"lora_train: --steps must be more than {WARMUP}, got {steps}")
    corpus, corpus_name = load_corpus(None, False)
    script = str(Path(__file__).resolve())
    config = {"loss_steps": steps, "window": window}
    sides = [harness.side("dew", "dew", script, [], {**config, "side": "dew"}, python=args.dew_python),
             harness.side("dew full fine-tune", "reference", script, [], {**config, "side": "dew-full"},
                          python=args.dew_python, env=harness.dew_environment())]
    sides += harness.torch_sides(script, [], {**config, "side": "torch"}, compile=not args.no_compile,
                                 python=args.peer_python, label="peft")
    with tempfile.TemporaryDirectory(prefix="dew-lora-train-") as workdir:
        build_checkpoint(str(Path(workdir) / "checkpoint"))
        np.save(Path(workdir) / "batches.npy", make_batches(corpus, max(steps, window)))
        result = harness.compare(sides, repeats, workdir=workdir)
    dew = result.dew
    full = next(o for o in result.outcomes if o.role == "reference")
    peer_loss = next(o for o in result.outcomes if o.config.get("loss_run"))
    report = {
        "benchmark": "lora_train",
        "work": (f"LoRA rank {RANK} alpha {ALPHA} on {'/'.join(MODULES)} of a random Qwen3 (width 512, 8 layers, "
                 f"8/4 heads of 64, SwiGLU 1536, vocab 8192, tied); context {CONTEXT}, batch {BATCH}; AdamW lr {LR}"),
        "corpus": f"{corpus_name}, {len(corpus)} bytes",
        **result.report("tokens_per_s", 1),
        "goal": "dew_over_best_peer >= 1.5",
        "dew_lora_over_dew_full": round(dew.rate / full.rate, 3) if full.rate else None,
        "trained_params": {"dew": dew.info.get("trained_params"), "peft": peer_loss.info.get("trained_params"),
                           "dew_full": full.info.get("trained_params")},
        "optimizer_state_bytes": {"dew": dew.info.get("optimizer_state_bytes"),
                                  "peft": peer_loss.info.get("optimizer_state_bytes"),
                                  "dew_full": full.info.get("optimizer_state_bytes")},
        "loss_first_last": {"dew": [dew.info.get("loss_first"), dew.info.get("loss_last")],
                            "peft": [peer_loss.info.get("loss_first"), peer_loss.info.get("loss_last")]},
        "loss_steps": steps,
        "window_steps": window,
        "hardware": harness.hardware(),
        "jax": dew.info.get("jax"),
        "torch": peer_loss.info.get("torch"),
        "peft": peer_loss.info.get("peft"),
    }
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
