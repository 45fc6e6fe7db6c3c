"""Greedy decoding speed: Dew's `generate` against transformers' `generate` on the same weights.

A random Qwen3 (width 512, 8 layers, 8 query heads over 4 key/value heads of 64, SwiGLU 1536,
vocab 8192, tied embeddings, float32; about 29M parameters) is built with transformers from a fixed
seed, written with `save_pretrained` to a temporary directory and read back by Dew with
`PretrainedDecoder.load`, so both decode the very same weights. Each side continues 16-token random
prompts by 128 greedy tokens, with no end-of-sequence token, at batch 1 and batch 8: Dew with
`generate(..., sampling=Sampling(temperature=0.0))` on the model and weights that
`dew.inference.decode_layout.DecodeWeights.get(rows)` gives for the batch, as `TextGeneration` does
(the CPU decode layout for one row and for 3 to 48 rows, converted once, in the compiling call),
transformers with `model.generate(do_sample=False, use_cache=True)` under
`torch.inference_mode()`.

Each side runs in its own process (benchmarks/harness.py): Dew, transformers at torch's library
defaults and at each smaller thread count (with no environment setting that slows it), and
`matmul_floor`, the model's matrix products alone (every weight matrix once per token in one
jitted loop, nothing else), the ceiling XLA:CPU's products set for any decoder on this backend.
For each batch size it reports tokens/s of each (new tokens over the wall time of one whole call,
prefill included; median of --repeats alternating calls after a warm-up call), Dew's ratio
against the fastest transformers configuration and against the floor, how many rows agree token
for token and, for each row that does not, the first position where it parts (random weights
leave near-ties in the logits, so a late parting is rounding; an early one is a bug). Dew's
prefill is timed apart (a call with max_new_tokens=1, after each timed call), so the per-token
cost of the decode loop is reported beside the whole-call figure.

The floor's process also measures the machine's memory bandwidth (jitted float32 sums over a
--bandwidth-mb array: to one scalar, and per row of a [1024, -1] view, which XLA spreads over the
cores; the larger counts), giving the batch-1 bound: bandwidth / bytes of all weights, as every
weight is read once per token. Prints one JSON line per batch size.

    .venv-ref/bin/python benchmarks/lm_decode.py [--quick] [--repeats 5] [--new-tokens 128] [--batches 1 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import harness

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
    import jax
    import jax.numpy as jnp

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
    sampling. `params` are in the layout Dew decodes this batch from (`DecodeWeights.get(batch)`:
    fused q/k/v and gate/up and [out, in] kernels for the row counts in `LAYOUT_ROWS`, the training
    layout otherwise), in the same forms, so the floor counts the same products. Returns a function
    that runs it once (compiled and warm) and returns the seconds.
    """
    import jax
    import jax.numpy as jnp

    from dew.inference.decode_layout import transposed_product

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


class DewDecoding(harness.Runner):
    def __init__(self, workdir: Path, batch: int, new: int):
        import jax
        import jax.numpy as jnp

        from dew.inference.decode_layout import DecodeWeights
        from dew.interop import PretrainedDecoder
        from dew.sampling import Sampling, generate

        bundle = PretrainedDecoder.load(str(workdir / "checkpoint"), dtype=jnp.float32)
        weights = DecodeWeights(bundle.model, bundle.variables)  # what TextGeneration holds
        self.rows, self.new, self.workdir = np.load(workdir / "prompts.npy")[:batch], new, workdir
        greedy, key = Sampling(temperature=0.0), jax.random.key(0)

        def call(tokens):
            start = time.perf_counter()
            decoder, decoder_variables = weights.get(batch)
            out = generate(decoder, decoder_variables, self.rows, tokens, key=key, sampling=greedy)
            jax.block_until_ready(out.tokens)
            return time.perf_counter() - start, np.asarray(out.tokens)

        self.call = call
        _, self.tokens = call(new)  # compiles
        call(1)  # compiles the prefill-only call
        self.prefill_times = []
        self.info = {"dew_model": type(weights.get(batch)[0]).__name__,  # DecodeTransformer: the decode layout
                     "weight_bytes": sum(x.size * x.dtype.itemsize
                                         for x in jax.tree_util.tree_leaves(bundle.variables["params"])),
                     "jax": jax.__version__}

    def window(self):
        seconds, _ = self.call(self.new)
        self.prefill_times.append(self.call(1)[0])
        return seconds, self.rows.shape[0] * self.new

    def finish(self):
        np.save(self.workdir / "tokens_dew.npy", self.tokens)
        return {"prefill_s": statistics.median(self.prefill_times)}


class MatmulFloor(harness.Runner):
    def __init__(self, workdir: Path, batch: int, new: int, bandwidth_mb: int):
        import jax.numpy as jnp

        from dew.inference.decode_layout import DecodeWeights
        from dew.interop import PretrainedDecoder

        flat, rows = memory_bandwidth(bandwidth_mb)
        bundle = PretrainedDecoder.load(str(workdir / "checkpoint"), dtype=jnp.float32)
        weights = DecodeWeights(bundle.model, bundle.variables)
        self.call = matmul_floor(weights.get(batch)[1]["params"], batch, new)
        self.units = batch * new
        self.info = {"bandwidth_flat": flat, "bandwidth_rows": rows}

    def window(self):
        return self.call(), self.units


class TransformersDecoding(harness.Runner):
    def __init__(self, workdir: Path, batch: int, new: int, save: bool):
        import torch
        import transformers

        self.torch, self.new, self.workdir, self.save = torch, new, workdir, save
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(workdir / "checkpoint"), dtype=torch.float32).eval()
        self.ids = torch.from_numpy(np.load(workdir / "prompts.npy")[:batch].astype(np.int64))
        _, self.tokens = self.call()  # warm-up
        self.info = {"threads": torch.get_num_threads(), "torch": torch.__version__,
                     "transformers": transformers.__version__,
                     "weight_bytes": sum(p.numel() * p.element_size() for p in self.model.parameters())}

    def call(self):
        torch, ids = self.torch, self.ids
        with torch.inference_mode():
            start = time.perf_counter()
            out = self.model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=self.new,
                min_new_tokens=self.new, do_sample=False, use_cache=True, eos_token_id=None, pad_token_id=0,
            )
            seconds = time.perf_counter() - start
        return seconds, out[:, PROMPT_LEN:].numpy()

    def window(self):
        return self.call()[0], self.ids.shape[0] * self.new

    def finish(self):
        if self.save:
            np.save(self.workdir / "tokens_hf.npy", self.tokens)
        return {}


def worker(config: dict) -> harness.Runner:
    workdir, batch, new = Path(config["workdir"]), config["batch"], config["new"]
    if config["side"] == "dew":
        return DewDecoding(workdir, batch, new)
    if config["side"] == "floor":
        return MatmulFloor(workdir, batch, new, config["bandwidth_mb"])
    harness.set_peer_threads(config)
    return TransformersDecoding(workdir, batch, new, save=config["threads"] is None)


def main() -> None:
    if (config := harness.worker_config()) is not None:
        harness.serve(config, worker)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short sanity run (16 new tokens, 2 calls)")
    parser.add_argument("--repeats", type=int, help="timed calls per side (default 5; 2 with --quick)")
    parser.add_argument("--new-tokens", type=int, help="new tokens per call (default 128; 16 with --quick)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--bandwidth-mb", type=int, default=512)
    parser.add_argument("--dew-python", default=sys.executable, help="interpreter of the Dew side")
    parser.add_argument("--peer-python", default=sys.executable, help="interpreter of the torch sides")
    parser.add_argument("--build-checkpoint", help=argparse.SUPPRESS)  # run in its own process by main
    args = parser.parse_args()
    if args.build_checkpoint:
        build_checkpoint(args.build_checkpoint)
        return
    repeats = args.repeats or (2 if args.quick else 5)
    new = args.new_tokens or (16 if args.quick else 128)
    script = str(Path(__file__).resolve())
    with tempfile.TemporaryDirectory(prefix="dew-lm-decode-") as directory:
        workdir = Path(directory)
        subprocess.run([args.peer_python, script, "--build-checkpoint", str(workdir / "checkpoint")],
                       env=harness.peer_environment(), check=True, stdout=sys.stderr)
        prompts = np.random.default_rng(0).integers(0, CONFIG["vocab_size"], (max(args.batches), PROMPT_LEN))
        np.save(workdir / "prompts.npy", prompts.astype(np.int32))
        for batch in args.batches:
            config = {"batch": batch, "new": new, "bandwidth_mb": args.bandwidth_mb}
            sides = [harness.side("dew", "dew", script, [], {**config, "side": "dew"}, python=args.dew_python),
                     harness.side("xla_matmul_floor", "reference", script, [], {**config, "side": "floor"},
                                  python=args.dew_python, env=harness.dew_environment())]
            sides += harness.torch_sides(script, [], {**config, "side": "torch"}, compile=False,
                                         python=args.peer_python, label="transformers")
            result = harness.compare(sides, repeats, workdir=workdir)
            print(json.dumps(decode_record(result, batch, new, workdir, args.bandwidth_mb)), flush=True)


def decode_record(result: harness.Comparison, batch: int, new: int, workdir: Path, bandwidth_mb: int) -> dict:
    dew = result.dew
    floor = next(o for o in result.outcomes if o.name == "xla_matmul_floor")
    hf = next(o for o in result.outcomes if o.name == "transformers defaults")
    dew_tokens, hf_tokens = np.load(workdir / "tokens_dew.npy"), np.load(workdir / "tokens_hf.npy")
    partings = [first_parting(d, h) for d, h in zip(dew_tokens, hf_tokens)]
    parted = [p for p in partings if p is not None]
    prefill_s = dew.finished["prefill_s"]
    loop_rate = batch * (new - 1) / max(batch * new / dew.rate - prefill_s, 1e-9)  # the decode loop alone
    flat, rows = floor.info["bandwidth_flat"], floor.info["bandwidth_rows"]
    bandwidth = max(flat, rows)
    record = {
        "benchmark": "lm_decode",
        "work": (
            f"random Qwen3 {CONFIG['num_hidden_layers']}L x {CONFIG['hidden_size']}, "
            f"{CONFIG['num_attention_heads']}H/{CONFIG['num_key_value_heads']}KV x {CONFIG['head_dim']}, "
            f"SwiGLU {CONFIG['intermediate_size']}, vocab {CONFIG['vocab_size']}, tied, float32; "
            f"greedy, prompt {PROMPT_LEN} + {new} new tokens, batch {batch}, no EOS"
        ),
        "batch": batch,
        "dew_model": dew.info["dew_model"],
        **result.report("tokens_per_s", 1),
        "dew_over_xla_matmul_floor": round(dew.rate / floor.rate, 3),
        "dew_prefill_ms": round(prefill_s * 1e3, 1),
        "dew_decode_loop_tokens_per_s": round(loop_rate, 1),
        "rows_identical": f"{len(partings) - len(parted)}/{len(partings)}",
        "first_parting_positions": partings,
        "earliest_parting": min(parted) if parted else None,
        "weight_bytes": dew.info["weight_bytes"],
        "transformers_weight_bytes": hf.info.get("weight_bytes"),
        "memory_bandwidth_gb_s": round(bandwidth / 1e9, 2),
        "bandwidth": (
            f"jitted float32 sums over {bandwidth_mb} MB, median of 7: to a scalar {flat / 1e9:.2f} GB/s, "
            f"per row of [1024, -1] {rows / 1e9:.2f} GB/s; the larger"
        ),
    }
    if batch == 1:
        bound = bandwidth / dew.info["weight_bytes"]  # tokens/s if every weight is read once per token
        record["bandwidth_bound_tokens_per_s"] = round(bound, 1)
        record["dew_fraction_of_bound"] = round(dew.rate / bound, 3)
        record["dew_decode_loop_fraction_of_bound"] = round(loop_rate / bound, 3)
        record["goal"] = "dew_over_best_peer >= 3 and dew_fraction_of_bound >= 0.75"
    else:
        record["goal"] = "dew_over_best_peer >= 3 (XLA:CPU's floor: xla_matmul_floor_tokens_per_s)"
    record.update({
        "hardware": harness.hardware(),
        "jax": dew.info["jax"], "torch": hf.info.get("torch"), "transformers": hf.info.get("transformers"),
    })
    return record


if __name__ == "__main__":
    main()
