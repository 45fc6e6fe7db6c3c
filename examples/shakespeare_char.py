"""Character-level Shakespeare with nanoGPT's CPU configuration, as a Llama-style decoder.

nanoGPT's `shakespeare_char` run on a CPU uses 4 layers, 4 heads, width 128, a context of 64,
batches of 12, AdamW at 1e-3 (beta2 0.99, 100 warm-up steps, cosine decay to 1e-4 over 2000 steps,
weight decay 0.1, gradient clipping at 1.0) and no dropout, and reports a validation loss of about
1.88. This program trains the same configuration on the same text and reports the loss over the
whole validation split (the first 10% of the characters).

    python examples/shakespeare_char.py --data ../shared/data/tinyshakespeare.txt
    python examples/shakespeare_char.py --data FILE --smoke     # a few steps, to check it runs
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

from dew import Trainer
from dew.data import ByteTokenizer, Loading, TokenWindows, tokenize
from dew.nn.backbones import CausalTransformer
from dew.objectives.lm import LMObjective, Perplexity
from dew.sampling import Sampling


def nanogpt_optimizer(steps: int, learning_rate: float = 1e-3, min_lr: float = 1e-4, warmup: int = 100):
    schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup, steps, end_value=min_lr)
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.99, weight_decay=0.1),
    )


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="../shared/data/tinyshakespeare.txt")
    parser.add_argument("--out", default="runs/shakespeare-char")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--smoke", action="store_true",
                        help="20 steps and 1%% of the text held out, to check the program runs")
    args = parser.parse_args(argv)
    steps = 20 if args.smoke else args.steps

    out = Path(args.out)
    tokenize(args.data, out / "tokens", "byte", val_fraction=0.01 if args.smoke else 0.1)
    data = TokenWindows(path=str(out / "tokens"), seq_len=64, loading=Loading(workers=0)).load(batch=12)
    model = CausalTransformer(vocab_size=256, emb_features=128, num_layers=4, num_heads=4,
                              max_seq_len=64, dtype=jnp.float32)
    objective = LMObjective(model, seq_len=64, tokenizer=ByteTokenizer())
    trainer = Trainer(objective, nanogpt_optimizer(steps, warmup=min(100, steps // 10)), key=jax.random.key(1337))
    began = time.perf_counter()
    state = trainer.fit(data, steps=steps, log_every=max(steps // 10, 1), eval_every=steps,
                        metrics=(Perplexity(),))
    seconds = time.perf_counter() - began
    perplexity = trainer.evaluations[-1].scores["val/perplexity"]
    task = objective.policy(state.variables, Sampling(temperature=0.8, top_k=40))
    sample = task.decode(task(["ROMEO:\n"], 56, key=jax.random.key(0)))[0]
    result = {
        "steps": steps,
        "val_loss": round(math.log(perplexity), 4),
        "train_loss_last_100": round(sum(h["loss"] for h in trainer.history[-100:]) / min(100, len(trainer.history)), 4),
        "seconds": round(seconds, 1),
    }
    print(json.dumps(result))
    print("ROMEO:\n" + sample)
    return result


if __name__ == "__main__":
    main()
