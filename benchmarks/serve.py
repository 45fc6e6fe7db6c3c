"""Serving throughput: Dew's continuous-batching Server against static batches and transformers' own.

The random Qwen3 of benchmarks/lm_decode.py (width 512, 8 layers, vocabulary 8192, float32), with
room for 1024 positions, is built with transformers from a fixed seed and saved, and every side
reads those weights. The load: 48 requests whose prompts are 32 to 480 random tokens, all queued at
once, each continued by 128 greedy tokens with no end-of-sequence token. Sides, each in its own
process (benchmarks/harness.py):

- Dew's `Server` (dense cache, 16 slots of 608 tokens): every request submitted, then `step()` until
  all finish; a request's time to first token is when its first token reached the host.
- Dew's `Server` over a paged cache (`--paged`, or `--paged SIDE ...` for some): pages of 16
  tokens in a pool of 40% of the dense cache's pages (requests queue for pages); the same with the
  dense cache's pages, prefilling whole prompts and with chunk=64 (chunked prefill); and a
  shared-prefix load, every prompt behind the same 256 tokens, served paged with and without
  prefix_cache (emptied before each window, so a window shares only the pages it computes). Each
  must draw the dense Server's tokens (the prefix load: each other's). Chunking is judged by the
  longest `step()`, the longest a decoding row waits for its next token, against the same pool
  prefilling whole prompts.
- Dew's static batches: `generate` over the requests 16 at a time in arrival order (prompts padded
  to the batch's longest); a request's first token is visible when its batch's call returns.
- transformers' continuous batching, `model.generate_batch` (its defaults), at torch's default thread
  count and at each smaller one (`harness.torch_sides`); the Server's ratio is against the fastest.

A window serves the whole load once; the rate is generated tokens over its wall time (median of
--repeats windows after a warm-up that compiles). Time to first token is reported as p50/p99 over
the requests of every window, and a Server's `step()` times as p50/p99 and the longest. Dew's two
sides must draw the same tokens (greedy); the count of requests that agree with transformers token
for token is reported too (random weights leave near-ties, so a late parting is rounding). Prints
one JSON line.

    .venv-ref/bin/python benchmarks/serve.py --dew-python .venv/bin/python [--quick] [--repeats 3] [--paged [SIDE ...]]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import harness
from lm_decode import CONFIG

SERVE_CONFIG = {**CONFIG, "max_position_embeddings": 1024}
FULL = dict(requests=48, shortest=32, longest=480, new=128, slots=16)
QUICK = dict(requests=12, shortest=8, longest=96, new=16, slots=4)
PAGE_SIZE, PAGED_SHARE, CHUNK, SHARED_PREFIX = 16, 0.4, 64, 256
PAGED_SIDES = ("paged", "paged_full", "chunked", "prefix", "no_prefix")


def build_checkpoint(directory: str) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**SERVE_CONFIG)).to(torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(directory)


def write_prompts(workdir: Path, load: dict) -> None:
    """The load's random prompts (a fixed seed), into `workdir`/prompts.json for every side."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, SERVE_CONFIG["vocab_size"], int(n)).tolist()
               for n in rng.integers(load["shortest"], load["longest"] + 1, load["requests"])]
    (workdir / "prompts.json").write_text(json.dumps(prompts))


def load_prompts(workdir: Path, shared_prefix: bool = False) -> list[list[int]]:
    prompts = json.loads((workdir / "prompts.json").read_text())
    if shared_prefix:
        prefix = np.random.default_rng(1).integers(0, SERVE_CONFIG["vocab_size"], SHARED_PREFIX).tolist()
        prompts = [prefix + prompt for prompt in prompts]
    return prompts


def percentiles(values: list[float]) -> dict[str, float]:
    return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99))}


class DewSide(harness.Runner):
    """The Server (dense or paged) or static `generate` batches over the same load."""

    def __init__(self, workdir: Path, load: dict, side: str):
        import jax
        import jax.numpy as jnp

        from dew.inference import TextGeneration
        from dew.inference.serving import Server
        from dew.interop import PretrainedDecoder
        from dew.nn.kv_cache import KVCache
        from dew.sampling import Sampling, generate

        bundle = PretrainedDecoder.load(str(workdir / "checkpoint"), dtype=jnp.float32)
        self.task = TextGeneration(bundle.model, bundle.variables)
        shared = side in ("prefix", "no_prefix")
        self.prompts, self.load, self.workdir = load_prompts(workdir, shared), load, workdir
        self.side, self.static = side, side == "static"
        self.greedy, self.generate, self.jax = Sampling(temperature=0.0), generate, jax
        self.first_token_s: list[float] = []
        self.step_s: list[float] = []  # each Server.step(): the gap a decoding row waits between tokens
        capacity = load["longest"] + load["new"] + (SHARED_PREFIX if shared else 0)
        dense_pages = load["slots"] * -(-capacity // PAGE_SIZE)
        options = {
            "server": {},
            "server_steps8": dict(decode_steps=8),
            "paged": dict(kv_cache=KVCache(page_size=PAGE_SIZE, pages=int(PAGED_SHARE * dense_pages))),
            "paged_full": dict(kv_cache=KVCache(page_size=PAGE_SIZE, pages=dense_pages)),
            "chunked": dict(kv_cache=KVCache(page_size=PAGE_SIZE, pages=dense_pages), chunk=CHUNK),
            "prefix": dict(kv_cache=KVCache(page_size=PAGE_SIZE, pages=dense_pages), prefix_cache=True),
            "no_prefix": dict(kv_cache=KVCache(page_size=PAGE_SIZE, pages=dense_pages)),
        }
        if not self.static:
            self.server = Server.from_task(self.task, slots=load["slots"], capacity=capacity, **options[side])
        self.tokens = self.serve()[1]  # compiles every program the load needs
        self.first_token_s.clear()
        self.step_s.clear()
        self.info = {"side": side, "jax": jax.__version__, "pages": getattr(self.server, "pages", None)
                     if not self.static else None}

    def serve(self) -> tuple[float, list[list[int]]]:
        return self.serve_static() if self.static else self.serve_continuous()

    def serve_continuous(self):
        self.server.reset_prefix_cache()  # every window shares only what it computes itself
        start = time.perf_counter()
        requests = [self.server.submit(p, max_new_tokens=self.load["new"], sampling=self.greedy, seed=0)
                    for p in self.prompts]
        first = {}
        while len(first) < len(requests) or not all(r.finished for r in requests):
            began = time.perf_counter()
            drawn = self.server.step()
            self.step_s.append(time.perf_counter() - began)
            for request, _ in drawn:
                first.setdefault(id(request), time.perf_counter() - start)
        seconds = time.perf_counter() - start
        self.first_token_s += list(first.values())
        return seconds, [r.tokens for r in requests]

    def serve_static(self):
        model, variables = self.task.weights.get(self.load["slots"])
        start, tokens = time.perf_counter(), []
        slots = self.load["slots"]
        for i in range(0, len(self.prompts), slots):
            rows = self.prompts[i:i + slots]
            out = self.generate(model, variables, rows, self.load["new"], key=self.jax.random.key(0),
                                sampling=self.greedy)
            drawn = np.asarray(out.tokens)  # waits for the call
            self.first_token_s += [time.perf_counter() - start] * len(rows)
            tokens += drawn.tolist()
        return time.perf_counter() - start, tokens

    def window(self):
        seconds, _ = self.serve()
        return seconds, len(self.prompts) * self.load["new"]

    def finish(self):
        np.save(self.workdir / f"tokens_{self.side}.npy", np.asarray(self.tokens))
        finished = {"first_token_s": percentiles(self.first_token_s)}
        if self.step_s:
            finished["step_s"] = {**percentiles(self.step_s), "longest": max(self.step_s)}
        if self.side == "prefix":
            finished["reused_prompt_tokens"] = self.server._pool.reused_tokens
        return finished


class TransformersSide(harness.Runner):
    """transformers' `generate_batch` (continuous batching with its paged cache) over the same load."""

    def __init__(self, workdir: Path, load: dict, keep_tokens: bool = True):
        import torch
        import transformers
        from transformers import GenerationConfig

        self.torch, self.workdir, self.load, self.keep_tokens = torch, workdir, load, keep_tokens
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(workdir / "checkpoint"), dtype=torch.float32).eval()
        self.prompts = load_prompts(workdir)
        self.config = GenerationConfig(max_new_tokens=load["new"], min_new_tokens=load["new"], do_sample=False,
                                       eos_token_id=None, pad_token_id=0)
        self.first_token_s: list[float] = []
        self.tokens = self.serve()[1]
        self.first_token_s.clear()
        self.info = {"threads": torch.get_num_threads(), "torch": torch.__version__,
                     "transformers": transformers.__version__}

    def serve(self):
        start = time.perf_counter()
        outputs = self.model.generate_batch(self.prompts, generation_config=self.config, record_timestamps=True)
        seconds = time.perf_counter() - start
        ordered = [outputs[key] for key in sorted(outputs, key=lambda k: int(k.split("_")[-1]))]
        for out in ordered:
            if out.timestamps:
                self.first_token_s.append(out.timestamps[0] - out.created_time)
        return seconds, [list(out.generated_tokens) for out in ordered]

    def window(self):
        return self.serve()[0], len(self.prompts) * self.load["new"]

    def finish(self):
        if self.keep_tokens:  # one configuration writes the tokens compared with the Server's
            np.save(self.workdir / "tokens_hf.npy", np.asarray(self.tokens))
        return {"first_token_s": percentiles(self.first_token_s) if self.first_token_s else None}


def worker(config: dict) -> harness.Runner:
    workdir, load = Path(config["workdir"]), config["load"]
    if config["side"] == "torch":
        harness.set_peer_threads(config)
        return TransformersSide(workdir, load, keep_tokens=config.get("loss_run", False))
    return DewSide(workdir, load, config["side"])


def agreement(a: np.ndarray, b: np.ndarray) -> dict:
    same = [bool(np.array_equal(x, y)) for x, y in zip(a, b)]
    partings = [int(np.nonzero(x != y)[0][0]) for x, y in zip(a, b) if x.shape == y.shape and not np.array_equal(x, y)]
    return {"identical_requests": sum(same), "of": len(same), "first_partings": partings}


def main() -> None:
    if (config := harness.worker_config()) is not None:
        harness.serve(config, worker)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small load (12 requests of 8-96 tokens, 16 draws, 4 slots)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-peer", action="store_true", help="time Dew's sides only")
    parser.add_argument("--paged", nargs="*", choices=PAGED_SIDES, default=None, metavar="SIDE",
                        help="add the paged, chunked and shared-prefix Server sides (all of them, or those named: "
                             + ", ".join(PAGED_SIDES) + ")")
    parser.add_argument("--dew-python", default=sys.executable, help="interpreter of the Dew sides")
    parser.add_argument("--peer-python", default=sys.executable, help="interpreter of the transformers side")
    parser.add_argument("--build-checkpoint", help=argparse.SUPPRESS)  # run in its own process by main
    args = parser.parse_args()
    if args.build_checkpoint:
        build_checkpoint(args.build_checkpoint)
        return
    load = QUICK if args.quick else FULL
    paged = () if args.paged is None else tuple(args.paged or PAGED_SIDES)
    script = str(Path(__file__).resolve())
    with tempfile.TemporaryDirectory(prefix="dew-serve-") as directory:
        workdir = Path(directory)
        subprocess.run([args.peer_python, script, "--build-checkpoint", str(workdir / "checkpoint")],
                       env=harness.peer_environment(), check=True, stdout=sys.stderr)
        write_prompts(workdir, load)
        config = {"load": load}
        sides = [harness.side("dew Server", "dew", script, [], {**config, "side": "server"}, python=args.dew_python),
                 harness.side("dew static generate", "reference", script, [], {**config, "side": "static"},
                              python=args.dew_python, env=harness.dew_environment())]
        sides += [harness.side(f"dew Server {name}", "reference", script, [], {**config, "side": name},
                               python=args.dew_python, env=harness.dew_environment()) for name in paged]
        if not args.no_peer:
            sides += harness.torch_sides(script, [], {**config, "side": "torch"}, compile=False,
                                         python=args.peer_python, label="transformers generate_batch")
        result = harness.compare(sides, args.repeats, workdir=workdir)
        record = {"benchmark": "serve", "load": load, "repeats": args.repeats,
                  "hardware": harness.hardware()}
        for outcome in result.outcomes:
            record[outcome.name] = {"tokens_per_second": outcome.rate, "unavailable": outcome.unavailable,
                                    **(outcome.finished or {}), "info": outcome.info}
        server, static = np.load(workdir / "tokens_server.npy"), np.load(workdir / "tokens_static.npy")
        record["server_vs_static"] = agreement(server, static)
        rates = {o.name: o.rate for o in result.outcomes}
        for name in {"paged", "paged_full", "chunked"} & set(paged):
            record[f"{name}_vs_server"] = agreement(np.load(workdir / f"tokens_{name}.npy"), server)
            record[f"{name}_over_server"] = rates[f"dew Server {name}"] / result.dew.rate
        longest = {o.name: (o.finished or {}).get("step_s", {}).get("longest") for o in result.outcomes}
        if longest.get("dew Server chunked") and longest.get("dew Server paged_full"):
            # chunked prefill against the same pool prefilling whole prompts: the longest step
            record["chunked_longest_step_over_paged_full"] = (
                longest["dew Server chunked"] / longest["dew Server paged_full"])
        if {"prefix", "no_prefix"} <= set(paged):
            prefix, no_prefix = (np.load(workdir / f"tokens_{name}.npy") for name in ("prefix", "no_prefix"))
            record["prefix_vs_no_prefix"] = agreement(prefix, no_prefix)
            record["prefix_over_no_prefix"] = rates["dew Server prefix"] / rates["dew Server no_prefix"]
        if (workdir / "tokens_hf.npy").exists():
            record["server_vs_transformers"] = agreement(server, np.load(workdir / "tokens_hf.npy"))
        static_rate = next(o.rate for o in result.outcomes if o.name == "dew static generate")
        record["server_over_static"] = result.dew.rate / static_rate if static_rate else None
        if not args.no_peer and result.by_role("peer") and any(o.rate for o in result.by_role("peer")):
            record["server_over_transformers"] = result.dew.rate / result.best_peer.rate
        print(json.dumps(record))


if __name__ == "__main__":
    main()
