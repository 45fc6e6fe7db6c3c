"""One Server decode step over a paged KV cache against the same step over the dense cache.

Both caches hold the same rows (random keys and values, row b holding `lengths[b]` tokens) of a
random CausalTransformer (width 256, 4 layers, 4 heads of 64 over 2 key/value heads, SwiGLU 1024,
vocabulary 8192, float32), and both run the Server's own compiled decode program
(`dew.inference.serving._decode_jit`, the cache and state donated) in one process: windows of
--steps calls, dense and paged alternating, each window restarting its rows at `lengths`. The
paged pool has pages of --page-size tokens, each row's pages in shuffled pool order (the step
attends over the bucket of pages the longest row needs, as in a Server). --lengths: rows
spread over the whole row ("mixed"), all near its end ("full"), or spread over its first fifth
("short", a batch early in its requests). --shared N adds a third side: the paged cache with every
row's first N pages the same pool pages (a prefix cache's shared prompt), which the step scores
against every row's queries.

Reports the median milliseconds per step of each, wall time and process CPU time (on a machine
shared with other work the CPU time moves less; run with
XLA_FLAGS=--xla_cpu_multi_thread_eigen=false so it counts one thread's work), and their ratios.
--hlo writes the compiled paged step, to check that the pools are updated in place (no copy of a
whole pool). Prints one JSON line.

    .venv/bin/python benchmarks/kv_pages_step.py [--rows 8] [--slots 512] [--lengths mixed|full|short]
        [--shared N] [--windows 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dew.inference import serving
from dew.nn.backbones.causal_transformer import CausalTransformer
from dew.nn.kv_cache import EMPTY, KVCache
from dew.sampling.rows import RowSampling


def build_model() -> CausalTransformer:
    return CausalTransformer(vocab_size=8192, emb_features=256, num_layers=4, num_heads=4, num_kv_heads=2,
                             mlp_features=1024, max_seq_len=1024, attention_impl="xla")


def row_lengths(kind: str, rows: int, slots: int, steps: int) -> np.ndarray:
    """Tokens each row holds when a window starts: spread over the row ("mixed"), near its end
    ("full"), or spread over its first fifth ("short", a batch early in its requests)."""
    room = slots - steps - 1
    if kind == "full":
        return np.full((rows,), room, np.int32)
    longest = room if kind == "mixed" else slots // 5
    return np.linspace(longest // 8, longest, rows).astype(np.int32)


def filled(cache: KVCache, lengths: np.ndarray, key: jax.Array) -> KVCache:
    """`cache` with random keys and values and row b holding positions 0 .. lengths[b] - 1."""
    leaves, tree = jax.tree.flatten((cache.k, cache.v))
    keys = jax.random.split(key, len(leaves))
    k, v = jax.tree.unflatten(tree, [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])
    return cache.replace(k=k, v=v, **restart(cache, lengths))


def restart(cache: KVCache, lengths: np.ndarray) -> dict:
    slots = np.arange(cache.max_len)[None]
    positions = np.where(slots < lengths[:, None], slots, EMPTY).astype(np.int32)
    return dict(positions=jnp.asarray(positions), lengths=jnp.asarray(lengths), index=jnp.asarray(lengths))


def decode_state(model: CausalTransformer, rows: int) -> dict:
    return dict(
        logits=jnp.zeros((rows, model.vocab_size), jnp.float32),
        keys=jax.random.split(jax.random.key(1), rows), drawn=jnp.zeros((rows,), jnp.int32),
        live=jnp.ones((rows,), bool), settings=RowSampling.empty(rows),
        allowed=jnp.ones((rows, model.vocab_size), bool),
    )


class Side:
    """One cache layout's rows and the decode program that steps them."""

    def __init__(self, model, variables, layout, rows, slots, lengths, rng, shared=0):
        cache = model.init_cache(rows, slots, layout=layout)
        if cache.paged:  # each row's pages somewhere in the pool, as a Server hands them out
            shuffled = rng.permutation(cache.pages).astype(np.int32)
            table = shuffled[np.asarray(cache.page_table)]
            table[:, :shared] = table[0, :shared]  # the first `shared` pages: one prefix every row reads
            cache = cache.replace(page_table=jnp.asarray(table))
        self.model, self.variables, self.lengths = model, variables, lengths
        self.cache = filled(cache, lengths, jax.random.key(2))
        self.state = decode_state(model, rows)

    def window(self, steps: int) -> float:
        self.cache = self.cache.replace(**restart(self.cache, self.lengths))
        self.state = dict(self.state, live=jnp.ones_like(self.state["live"]))
        jax.block_until_ready((self.cache, self.state))
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            self.cache, self.state, tokens, _ = serving._decode_jit(
                self.model, self.variables, self.cache, self.state, None, steps=1)
        jax.block_until_ready(tokens)
        return (time.perf_counter() - start) / steps * 1e3, (time.process_time() - cpu) / steps * 1e3

    def lowered_text(self) -> str:
        return serving._decode_jit.lower(self.model, self.variables, self.cache, self.state, None, steps=1).compile().as_text()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--slots", type=int, default=512)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--lengths", choices=("mixed", "full", "short"), default="mixed")
    parser.add_argument("--steps", type=int, default=20, help="decode calls per window")
    parser.add_argument("--windows", type=int, default=7, help="windows per side (the median is reported)")
    parser.add_argument("--shared", type=int, default=0, help="add a side whose rows share their first N pages")
    parser.add_argument("--hlo", help="write the compiled paged step's HLO text to this file")
    args = parser.parse_args()
    model = build_model()
    variables = nn.unbox(jax.jit(model.init)(jax.random.key(0), np.zeros((1, 8), np.int32)))
    lengths = row_lengths(args.lengths, args.rows, args.slots, args.steps)
    if args.shared * args.page_size > lengths.min():
        parser.error(f"--shared {args.shared} pages of {args.page_size} hold more than the shortest row's "
                     f"{lengths.min()} tokens; pass fewer pages or --lengths full")
    rng = np.random.default_rng(0)
    shape = (args.rows, args.slots, lengths, rng)
    pages = KVCache(page_size=args.page_size)
    sides = {"dense": Side(model, variables, None, *shape), "paged": Side(model, variables, pages, *shape)}
    if args.shared:
        sides["shared"] = Side(model, variables, pages, *shape, shared=args.shared)
    if args.hlo:
        with open(args.hlo, "w") as f:
            f.write(sides["paged"].lowered_text())
    for side in sides.values():
        side.window(2)  # compiles
    times = {name: [] for name in sides}
    cpu_times = {name: [] for name in sides}
    for _ in range(args.windows):  # alternating, so the machine's load falls on both alike
        for name, side in sides.items():
            wall, cpu = side.window(args.steps)
            times[name].append(wall)
            cpu_times[name].append(cpu)
    medians = {name: statistics.median(t) for name, t in times.items()}
    cpu = {name: statistics.median(t) for name, t in cpu_times.items()}
    print(json.dumps({
        "benchmark": "kv_pages_step", "rows": args.rows, "slots": args.slots, "page_size": args.page_size,
        "lengths": lengths.tolist(), "steps": args.steps,
        "windows": args.windows,
        "dense_ms": round(medians["dense"], 2), "paged_ms": round(medians["paged"], 2),
        "paged_over_dense": round(medians["paged"] / medians["dense"], 3),
        "dense_cpu_ms": round(cpu["dense"], 2), "paged_cpu_ms": round(cpu["paged"], 2),
        "cpu_paged_over_dense": round(cpu["paged"] / cpu["dense"], 3), "jax": jax.__version__,
        **({"shared": args.shared, "shared_ms": round(medians["shared"], 2),
            "shared_over_dense": round(medians["shared"] / medians["dense"], 3)} if args.shared else {}),
    }))


if __name__ == "__main__":
    main()
