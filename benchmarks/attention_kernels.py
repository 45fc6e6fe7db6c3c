"""Forward and backward time of causal self-attention per kernel and length, in one process.

Each kernel ("xla", "blockwise", or any `dew.nn.attention` names) takes the gradient of a sum of
its output for the same float32 queries, keys and values; compilation is excluded (one call
first) and the figure is the fastest of several timed calls, so machine noise hits each side
alike. Beside the times, XLA's temporary bytes of each compiled gradient. Prints one JSON line
per length.

    .venv/bin/python benchmarks/attention_kernels.py [--lengths 512 2048 8192] [--heads 4] [--kv-heads 2] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import jax
import jax.numpy as jnp

from dew.nn.attention import dot_product_attention


def measure(impl: str, q: jax.Array, k: jax.Array, v: jax.Array, repeats: int) -> tuple[float, int]:
    """The fastest of `repeats` timed forward-and-backward calls of kernel `impl`, and XLA's
    temporary bytes for that compiled gradient."""
    loss = lambda q, k, v: jnp.sum(dot_product_attention(q, k, v, impl=impl))  # noqa: E731
    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
    jax.block_until_ready(step(q, k, v))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(step(q, k, v))
        best = min(best, time.perf_counter() - start)
    return best, step.memory_analysis().temp_size_in_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--kernels", nargs="+", default=["xla", "blockwise"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a short sanity run: lengths 256 and 512, 2 repeats")
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.repeats = [256, 512], 2
    for length in args.lengths:
        keys = jax.random.split(jax.random.key(0), 3)
        q = jax.random.normal(keys[0], (args.batch, length, args.heads, args.head_dim))
        k, v = (jax.random.normal(key, (args.batch, length, args.kv_heads, args.head_dim)) for key in keys[1:])
        measured = {impl: measure(impl, q, k, v, args.repeats) for impl in args.kernels}
        print(json.dumps({
            "length": length, "batch": args.batch, "heads": args.heads, "kv_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "ms_forward_backward": {impl: round(t * 1000, 1) for impl, (t, _) in measured.items()},
            "temporaries_mib": {impl: round(b / 2**20, 1) for impl, (_, b) in measured.items()},
            "backend": jax.default_backend(), "machine": platform.machine(), "load_average": os.getloadavg()[0],
        }))


if __name__ == "__main__":
    main()
