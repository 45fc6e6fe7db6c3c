"""Greedy decoding speed: Dew's `generate` against transformers' `generate` on the same weights.

A random Qwen3 (width 512, 8 layers, 8 query heads over 4 key/value heads of 64, SwiGLU 1536,
vocab 8192, tied embeddings, float32; about 29M parameters) is built with transformers from a fixed
seed, written with `save_pretrained` to a temporary directory and read back by Dew with
`PretrainedDecoder.load`, so both decode the very same weights. Each side continues 16-token random
prompts by 128 greedy tokens, with no end-of-sequence token, at batch 1 and batch 8: Dew with
`generate(..., sampling=Sampling(temperature=0.0))` on the model and weights that
`dew.inference.decode_layout.DecodeWeights.get(rows)` gives for the batch, as `TextGeneration` does
(the CPU decode layout for one row, converted once, in the compiling call; the weights as loaded
for several), transformers with
`model.generate(do_sample=False, use_cache=True)` under `torch.inference_mode()`.

For each batch size it reports tokens/s of each (new tokens over the wall time of one whole call,
prefill included; median of --repeats calls after a warm-up call, interleaved), their ratio, how many
rows agree token for token and, for each row that does not, the first position where it parts (random
weights leave near-ties in the logits, so a late parting is rounding; an early one is a bug).
torch runs at the core count and at one thread (on a shared, oversubscribed machine one thread can
win), and the ratio is taken against the faster.

It also measures the machine's memory bandwidth (jitted float32 sums over a --bandwidth-mb array:
to one scalar, and per row of a [1024, -1] view, which XLA spreads over the cores; the larger counts)
and the batch-1 bound: bandwidth / bytes of all weights, as every weight is read once per token.
It also times the model's matrix products alone (`matmul_floor`: every weight matrix once per
token in one jitted loop, nothing else, interleaved with the other calls), the ceiling XLA:CPU's
matrix products set for a decoder on this backend, and reports Dew's rate over it. Dew's prefill is timed apart (a call with max_new_tokens=1), so the per-token cost of the decode
loop is reported beside the whole-call figure. Prints one JSON line per batch size.

Needs torch, transformers and Dew in one environment:

    .venv-ref/bin/python benchmarks/lm_decode.py [--repeats 5] [--new-tokens 128] [--batches 1 8]
"""

from __future__ import annotations

import os

# GNU OpenMP's default spin-wait collapses torch's multi-threaded speed when the machine runs more
# busy threads than it has cores; set before torch loads libgomp (an explicit setting wins).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import platform
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from dew.inference.decode_layout import DecodeWeights, transposed_product
from dew.interop import PretrainedDecoder
from dew.sampling import Sampling, generate
from common import cores

CONFIG = dict(
    vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=512,
    rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True, use_sliding_window=False,
    bos_token_id=None, eos_token_id=None, pad_token_id=None,
)
PROMPT_LEN = 16


def build_checkpoint(directory: str):
    """A seeded random Qwen3 saved to `directory`; returns the torch model."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**CONFIG)).to(torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(directory)
    return model


def memory_bandwidth(megabytes: int, repeats: int = 7) -> tuple[float, float]:
    """Bytes/s of jitted float32 sums over an array of `megabytes` MB (median of `repeats`).

    Returns (flat, rows): a sum to one scalar, which XLA:CPU runs on one thread, and per-row sums
    of the same array viewed as [1024, -1], which it splits over the cores. The larger is the
    machine's figure.
    """
    size = megabytes * 2**20 // 4
    x = jnp.ones((size,), jnp.float32)
    rates = []
    for reduce in (jnp.sum, lambda a: jnp.sum(a.reshape(1024, -1), axis=1)):
        total = jax.jit(reduce)
        total(x).block_until_ready()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            total(x).block_until_ready()
            times.append(time.perf_counter() - start)
        rates.append(size * 4 / statistics.median(times))
    del x
    return rates[0], rates[1]


def matmul_floor(params, batch: int, new: int):
    """A timed call of the model's matrix products alone: XLA:CPU's own ceiling for this decode.

    One jitted loop of `new` steps over `batch` rows, each step multiplying the activations by
    every weight matrix of the model once (per layer the attention's q/k/v and o products and the
    MLP's gate/up and down products, then the tied output head, all on [batch, 1, width] rows as
    the decoder has them), fed through the scale-free RMS norms the decoder puts before the
    q/k/v, gate/up and head products (XLA fuses them into those products), with no attention or
    sampling. `params` are in the layout Dew
    decodes this batch from (`DecodeWeights.get(batch)`: fused q/k/v and gate/up and [out, in]
    kernels for one row, the training layout otherwise), in the same forms, so the floor counts the
    same products. Returns a function that runs it once (compiled and warm) and returns the seconds.
    """
    layers = sorted((k for k in params if k.startswith("layers_")), key=lambda k: int(k.split("_")[1]))
    blocks = [{"attn": params[layer]["self_attn"], "mlp": params[layer]["mlp"]} for layer in layers]
    embedding = params["embed_tokens"]["embedding"]
    width = embedding.shape[1]

    def product(x, p):  # a projection in either layout, in the form the model computes it
        return transposed_product(x, p["kernel_t"]) if "kernel_t" in p else x @ p["kernel"]

    def norm(x):
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)

    @jax.jit
    def run(x, blocks, embedding):
        def step(_, x):
            for b in blocks:
                attn, mlp = b["attn"], b["mlp"]
                h = norm(x)
                if "qkv_proj" in attn:
                    o = attn["o_proj"]
                    q_features = o["kernel_t"].shape[1] if "kernel_t" in o else o["kernel"].shape[0]
                    qkv = product(h, attn["qkv_proj"])
                    q, kv = qkv[..., :q_features], qkv[..., q_features:]
                else:
                    q = product(h, attn["q_proj"])
                    kv = jnp.concatenate([product(h, attn["k_proj"]), product(h, attn["v_proj"])], -1)
                attended = q + jnp.tile(kv, q.shape[-1] // kv.shape[-1])  # stands in for attention
                x = x + product(attended, attn["o_proj"])
                h = norm(x)
                if "gate_up_proj" in mlp:
                    gate, up = jnp.split(product(h, mlp["gate_up_proj"]), 2, axis=-1)
                else:
                    gate, up = product(h, mlp["gate_proj"]), product(h, mlp["up_proj"])
                x = x + product(jax.nn.silu(gate) * up, mlp["down_proj"])
            logits = norm(x) @ embedding.T
            return x + 1e-3 * logits[..., :width]  # the next step depends on this one's head
        return jax.lax.fori_loop(0, new, step, x)

    x = jnp.ones((batch, 1, width), jnp.float32)
    run(x, blocks, embedding).block_until_ready()

    def call() -> float:
        start = time.perf_counter()
        run(x, blocks, embedding).block_until_ready()
        return time.perf_counter() - start

    return call


def first_parting(a: np.ndarray, b: np.ndarray) -> int | None:
    differ = np.nonzero(a != b)[0]
    return None if differ.size == 0 else int(differ[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--bandwidth-mb", type=int, default=512)
    args = parser.parse_args()

    import torch
    import transformers

    threads = cores()
    torch.set_num_threads(threads)
    thread_counts = sorted({threads, 1}, reverse=True)
    flat_bandwidth, row_bandwidth = memory_bandwidth(args.bandwidth_mb)
    bandwidth = max(flat_bandwidth, row_bandwidth)
    new = args.new_tokens

    with tempfile.TemporaryDirectory() as directory:
        hf_model = build_checkpoint(directory)
        bundle = PretrainedDecoder.load(directory, dtype=jnp.float32)
    model, variables = bundle.model, bundle.variables
    weights = DecodeWeights(model, variables)  # what TextGeneration holds for its weights
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(variables["params"]))
    hf_bytes = sum(p.numel() * p.element_size() for p in hf_model.parameters())
    bound = bandwidth / weight_bytes  # batch-1 tokens/s if every weight is read once per token
    greedy = Sampling(temperature=0.0)
    key = jax.random.key(0)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, CONFIG["vocab_size"], (max(args.batches), PROMPT_LEN), dtype=np.int32)

    def dew_call(rows, tokens):
        start = time.perf_counter()
        decoder, decoder_variables = weights.get(len(rows))
        out = generate(decoder, decoder_variables, rows, tokens, key=key, sampling=greedy)
        jax.block_until_ready(out.tokens)
        return time.perf_counter() - start, np.asarray(out.tokens)

    def hf_call(rows):
        ids = torch.from_numpy(rows.astype(np.int64))
        with torch.inference_mode():
            start = time.perf_counter()
            out = hf_model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                min_new_tokens=new, do_sample=False, use_cache=True, eos_token_id=None, pad_token_id=0,
            )
            seconds = time.perf_counter() - start
        return seconds, out[:, PROMPT_LEN:].numpy()

    for batch in args.batches:
        rows = prompts[:batch]
        _, dew_tokens = dew_call(rows, new)  # compile
        dew_call(rows, 1)  # compile the prefill-only call
        _, hf_tokens = hf_call(rows)  # warm-up
        floor_call = matmul_floor(weights.get(batch)[1]["params"], batch, new)
        dew_times, prefill_times, floor_times, hf_times = [], [], [], {n: [] for n in thread_counts}
        for _ in range(args.repeats):  # interleaved, so drifts in machine load hit both
            for n in thread_counts:
                torch.set_num_threads(n)
                hf_times[n].append(hf_call(rows)[0])
            torch.set_num_threads(threads)
            dew_times.append(dew_call(rows, new)[0])
            prefill_times.append(dew_call(rows, 1)[0])
            floor_times.append(floor_call())
        dew_s, prefill_s = statistics.median(dew_times), statistics.median(prefill_times)
        floor = batch * new / statistics.median(floor_times)
        hf_rate = {n: batch * new / statistics.median(t) for n, t in hf_times.items()}
        best = max(hf_rate, key=hf_rate.get)
        dew_rate = batch * new / dew_s
        loop_rate = batch * (new - 1) / max(dew_s - prefill_s, 1e-9)  # the decode loop alone

        partings = [first_parting(d, h) for d, h in zip(dew_tokens, hf_tokens)]
        parted = [p for p in partings if p is not None]
        record = {
            "benchmark": "lm_decode",
            "work": (
                f"random Qwen3 {CONFIG['num_hidden_layers']}L x {CONFIG['hidden_size']}, "
                f"{CONFIG['num_attention_heads']}H/{CONFIG['num_key_value_heads']}KV x {CONFIG['head_dim']}, "
                f"SwiGLU {CONFIG['intermediate_size']}, vocab {CONFIG['vocab_size']}, tied, float32; "
                f"greedy, prompt {PROMPT_LEN} + {new} new tokens, batch {batch}, no EOS"
            ),
            "batch": batch,
            "dew_model": type(weights.get(batch)[0]).__name__,  # DecodeTransformer: the decode layout
            "dew_tokens_per_s": round(dew_rate, 1),
            "transformers_tokens_per_s": round(hf_rate[best], 1),
            "transformers_tokens_per_s_by_threads": {str(n): round(r, 1) for n, r in hf_rate.items()},
            "dew_over_transformers": round(dew_rate / hf_rate[best], 3),
            "dew_over_transformers_at_core_count": round(dew_rate / hf_rate[threads], 3),
            "xla_matmul_floor_tokens_per_s": round(floor, 1),
            "dew_over_xla_matmul_floor": round(dew_rate / floor, 3),
            "dew_prefill_ms": round(prefill_s * 1e3, 1),
            "dew_decode_loop_tokens_per_s": round(loop_rate, 1),
            "rows_identical": f"{len(partings) - len(parted)}/{len(partings)}",
            "first_parting_positions": partings,
            "earliest_parting": min(parted) if parted else None,
            "weight_bytes": weight_bytes,
            "transformers_weight_bytes": hf_bytes,
            "memory_bandwidth_gb_s": round(bandwidth / 1e9, 2),
            "bandwidth": (
                f"jitted float32 sums over {args.bandwidth_mb} MB, median of 7: to a scalar "
                f"{flat_bandwidth / 1e9:.2f} GB/s, per row of [1024, -1] {row_bandwidth / 1e9:.2f} GB/s; the larger"
            ),
        }
        if batch == 1:
            record["bandwidth_bound_tokens_per_s"] = round(bound, 1)
            record["dew_fraction_of_bound"] = round(dew_rate / bound, 3)
            record["dew_decode_loop_fraction_of_bound"] = round(loop_rate / bound, 3)
            record["goal"] = "dew_over_transformers >= 3 and dew_fraction_of_bound >= 0.75"
        else:
            record["goal"] = "dew_over_transformers >= 3"
        record.update({
            "timing": f"whole generate call, median of {args.repeats} interleaved calls, compile excluded",
            "threads": {
                "torch": best, "jax_xla_cpu": f"default pool ({threads} cores)",
                "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
            },
            "hardware": f"{jax.devices()[0].device_kind} x{jax.device_count()}, "
            f"{platform.processor() or platform.machine()}, {threads} cores",
            "load_average_1m": round(os.getloadavg()[0], 2),
            "jax": jax.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        })
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
