"""Perplexity through dense, int8 and float8 KV caches on the demo's trained decoder.

`dew demo`'s decoder (byte-level, 4 layers of width 128, 4 query heads over 2 key/value heads of
32, context 64; `dew.cli.demo.train_decoder`) is trained on the text of Python's help topics, or
read from a run it saved before (--run). Its held-out split (the first 2% of the token stream,
never trained on) is cut into windows of --window tokens. Each window prefills its first half
and then decodes the second half one token per step through the cache, teacher-forced: every
scored token's log-probability comes from a query that attends to the keys and values the cache
holds, written in its format. Each row reports the perplexity of the scored halves and, against
the dense cache, the change in perplexity, the mean and largest |change| of a token's
log-probability, and how many greedy continuations (--greedy-tokens drawn after each window's
first half) are identical to the dense cache's.

Rows: dense (float32 cache); int8 (Hadamard-rotated keys); float8 (e4m3, unrotated); and two
checks: "no cache", the same halves scored by one forward pass over each whole window (equal to
dense up to rounding: the protocol scores what it should), and "int8, keys unrotated", an int8
cache whose keys are stored without the rotation (what the rotation buys). Prints one JSON line
per row.

    .venv/bin/python benchmarks/kv_cache_quality.py [--run DIR] [--steps 1500] [--window 128]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (beside this script)

import dew  # noqa: E402
from dew.data.tokens import TokenCorpus  # noqa: E402
from dew.nn.kv_cache import KVCache  # noqa: E402
from dew.sampling import Sampling  # noqa: E402

CACHES = {
    "dense": None,
    "int8": KVCache(quantized="int8"),
    "float8": KVCache(quantized="float8_e4m3fn"),
}


def held_out_windows(run: Path, window: int) -> np.ndarray:
    """Non-overlapping ``[count, window]`` windows of the run's held-out tokens."""
    val = np.asarray(TokenCorpus.read(run.parent / "tokens").val, np.int32)
    count = len(val) // window
    if count < 1:
        raise SystemExit(f"the held-out split has {len(val)} tokens, fewer than one window of {window}")
    return val[: count * window].reshape(count, window)


def unrotated_keys(cache: KVCache) -> KVCache:
    """An int8 cache whose key blocks store keys as they come (the ablation row)."""
    return cache.replace(k=tuple(k.replace(rotated=False) for k in cache.k))


def cached_log_probs(model, variables, windows, ablate_rotation=False):
    """Log-probabilities ``[count, window // 2]`` of each window's second half, decoded token by
    token through ``model``'s cache after its first half is prefilled."""
    count, width = windows.shape
    half = width // 2
    cache = model.init_cache(count, width)
    if ablate_rotation:
        cache = unrotated_keys(cache)
    logits, cache = model.apply(variables, windows[:, :half], cache=cache)

    def step(carry, token):  # score `token` with the logits before it, then feed it
        cache, last = carry
        logits, cache = model.apply(variables, token[:, None], cache=cache)
        scored = jnp.take_along_axis(jax.nn.log_softmax(last), token[:, None], axis=-1)[:, 0]
        return (cache, logits[:, 0]), scored

    _, log_probs = jax.lax.scan(step, (cache, logits[:, -1]), windows[:, half:].T)
    return log_probs.T


def full_pass_log_probs(model, variables, windows):
    """The same tokens' log-probabilities from one forward pass over each whole window, no cache."""
    half = windows.shape[1] // 2
    log_probs = jax.nn.log_softmax(model.apply(variables, windows)[:, half - 1:-1])
    return jnp.take_along_axis(log_probs, windows[:, half:, None], axis=-1)[..., 0]


def greedy(model, variables, windows, tokens):
    """Greedy continuations of each window's first half."""
    half = windows.shape[1] // 2
    task = dew.inference.TextGeneration(model, variables, sampling=Sampling(temperature=0.0))
    return task([row[:half].tolist() for row in windows], tokens, seed=0).host().tokens


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, default=None,
                        help="a run dew demo's train_decoder saved (its run/ folder, the tokens/ folder beside it)")
    parser.add_argument("--steps", type=int, default=1500, help="training steps when --run is not given")
    parser.add_argument("--window", type=int, default=128, help="tokens per held-out window (half prefilled)")
    parser.add_argument("--greedy-tokens", type=int, default=64)
    parser.add_argument("--greedy-rows", type=int, default=32)
    args = parser.parse_args(argv)
    print(json.dumps({"hardware": harness.hardware(), "jax": jax.__version__}), flush=True)

    run = args.run
    if run is None:
        from dew.cli.demo import train_decoder

        folder = Path(tempfile.mkdtemp(prefix="dew-kv-quality-"))
        began = time.perf_counter()
        run, _, _ = train_decoder(folder, steps=args.steps, log_every=max(args.steps // 5, 1))
        print(json.dumps({"trained": str(run), "steps": args.steps,
                          "seconds": round(time.perf_counter() - began, 1)}), flush=True)
    task = dew.pipeline(run, ema=False)
    model, variables = task.model, task.variables
    windows = held_out_windows(Path(run), args.window)
    print(json.dumps({"held_out_windows": int(windows.shape[0]), "window": args.window,
                      "scored_tokens": int(windows.size // 2)}), flush=True)
    windows = jnp.asarray(windows)

    score = jax.jit(cached_log_probs, static_argnums=(0, 3))
    dense = np.asarray(score(model, variables, windows))
    greedy_rows = windows[: args.greedy_rows]
    dense_greedy = greedy(model, variables, greedy_rows, args.greedy_tokens)
    rows = {
        "dense": (dense, dense_greedy),
        "no cache (one forward pass)": (np.asarray(jax.jit(full_pass_log_probs, static_argnums=0)(
            model, variables, windows)), None),
    }
    for name in ("int8", "float8"):
        quantized = model.clone(kv_cache=CACHES[name])
        rows[name] = (np.asarray(score(quantized, variables, windows)),
                      greedy(quantized, variables, greedy_rows, args.greedy_tokens))
    rows["int8, keys unrotated (ablation)"] = (
        np.asarray(score(model.clone(kv_cache=CACHES["int8"]), variables, windows, True)), None)

    dense_perplexity = math.exp(-dense.mean())
    for name, (log_probs, drawn) in rows.items():
        moved = np.abs(log_probs - dense)
        perplexity = math.exp(-log_probs.mean())
        report = {
            "cache": name,
            "perplexity": round(perplexity, 4),
            "delta_perplexity": round(perplexity - dense_perplexity, 4),
            "delta_percent": round(100 * (perplexity / dense_perplexity - 1), 3),
            "mean_abs_delta_log_p": float(f"{moved.mean():.3g}"),
            "max_abs_delta_log_p": float(f"{moved.max():.3g}"),
        }
        if drawn is not None:
            same = int(np.all(drawn == dense_greedy, axis=1).sum())
            report["greedy_identical"] = f"{same}/{len(drawn)}"
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
