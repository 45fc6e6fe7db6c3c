"""The GPU paths, checked and timed on one NVIDIA GPU: cuDNN attention, bfloat16 training, the
Server's throughput, and host memory (Layout(host=...), offloaded remat) in XLA's memory analysis.

Each section runs in its own process with its own time limit and prints one JSON line; the parent
collects them into `--out/gpu_check.jsonl` (a section's log goes beside it). A section that fails
is reported with its error and the others still run.

- `attention`: `dot_product_attention` as Dew calls it (causal, causal with a window, causal with
  key lengths, bidirectional; grouped-query heads) must resolve "auto" to "cudnn" for bfloat16 and
  match `reference_attention` in float32 on the same bfloat16 values, outputs and gradients; the
  negative control is the same call with the other causality. Forward and backward are timed for
  "cudnn", "xla" and "blockwise".
- `lm_train`: a Llama-style decoder trained by `Trainer` + `LMObjective` in bfloat16 compute
  (float32 parameters) with "auto" (cuDNN) and "xla" attention, against transformers'
  `LlamaForCausalLM` of the same shape under bfloat16 autocast with fused AdamW (`lm_train_torch`,
  its own process). A short float32 run and a bfloat16 run from the same state must give losses
  within 2% of each other.
- `serve`: benchmarks/serve.py's load (48 requests of 32-480 prompt tokens, 128 greedy draws, 16
  slots, its random Qwen3) through Dew's Server (dense, at `decode_steps` 1 and 8; paged at 40% of
  the dense pages; chunked),
  Dew's static `generate` batches, and transformers' `generate_batch` on the GPU (`serve_torch`).
  Every Dew side must draw the dense Server's tokens.
- `offload`: XLA's memory analysis of the compiled training step with and without
  `Layout(host=("opt_state", "ema"))` and with "minimal" against "minimal_offloaded" remat, and
  the losses of a few steps of each (they must be equal).

    python benchmarks/gpu_check.py --out DIR [--quick] [--sections attention,lm_train,...]

`--quick` shrinks every size so the script runs on a CPU as a check of the script itself (there the
cuDNN rows are reported as not applicable).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
SECTIONS = ("attention", "offload", "lm_train", "serve", "lm_train_torch", "serve_torch", "serve_step")
SHORT = bool(os.environ.get("DEW_GPU_CHECK_SHORT"))  # set by --short for the sections' processes
# seconds per section on an H200 with the machine's own jax 0.11.2, where compiling a program takes
# ~5-7 s: a whole run needs ~20 minutes, so a session picks sections with --sections
LIMITS = {"attention": 180, "offload": 150, "lm_train": 240, "serve": 330, "lm_train_torch": 150,
          "serve_torch": 120,
          "serve_step": 330}


def median_seconds(call, repeats: int) -> float:
    """Median wall seconds of `call()` (which must wait for its own result) after one warm call."""
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# --- attention ----------------------------------------------------------------------------------


def section_attention(quick: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dew.nn.attention import dot_product_attention, resolve_attention_impl

    shapes = [(1, 128, 4, 2, 64)] if quick else [(4, 2048, 16, 4, 128)]
    impls = ("auto", "xla") if SHORT else ("auto", "xla", "blockwise")
    every_case = {"causal": dict(causal=True), "causal_window": dict(causal=True, window=256),
                  "causal_lengths": dict(causal=True, lengths=True), "bidirectional": dict(causal=False)}
    rows = [f32_matmul_error()]
    for number, (batch, length, heads, kv_heads, head_dim) in enumerate(shapes):
        cases = every_case if number == 0 else {"causal": every_case["causal"]}
        keys = jax.random.split(jax.random.key(0), 4)
        q = jax.random.normal(keys[0], (batch, length, heads, head_dim), jnp.bfloat16)
        k = jax.random.normal(keys[1], (batch, length, kv_heads, head_dim), jnp.bfloat16)
        v = jax.random.normal(keys[2], (batch, length, kv_heads, head_dim), jnp.bfloat16)
        cotangent = jax.random.normal(keys[3], q.shape, jnp.float32)
        lengths = jnp.asarray(np.linspace(length // 3, length, batch).astype(np.int32))
        for name, case in cases.items():
            # every array is an argument of the compiled programs: a captured one would be a constant
            # that XLA folds at compile time
            settings = dict(causal=case["causal"], window=case.get("window"))
            with_lengths = bool(case.get("lengths"))
            row = {"shape": [batch, length, heads, kv_heads, head_dim], "case": name,
                   "auto_resolves_to": resolve_attention_impl("auto", dtype=jnp.bfloat16, head_dim=head_dim)}

            def loss(q, k, v, cotangent, lengths, impl, causal):
                out = dot_product_attention(q, k, v, impl=impl, **{**settings, "causal": causal},
                                            kv_lengths=lengths if with_lengths else None)
                return jnp.sum(out.astype(jnp.float32) * cotangent), out

            def program(impl, causal=case["causal"], upcast=False):
                def run(q, k, v, cotangent, lengths):
                    if upcast:
                        q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
                    return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v, cotangent, lengths, impl, causal)
                return jax.jit(run).lower(q, k, v, cotangent, lengths).compile()

            arguments = (q, k, v, cotangent, lengths)
            want_grads, want = program("reference", upcast=True)(*arguments)
            _, other = program("reference", causal=not case["causal"], upcast=True)(*arguments)
            valid = None
            if with_lengths:  # queries past a row's length: reported apart ("all rows")
                valid = (jnp.arange(length)[None, :] < lengths[:, None])[:, :, None, None]
            for impl in impls:
                try:
                    compiled = program(impl)
                    grads, out = compiled(*arguments)
                    out32 = out.astype(jnp.float32)
                    error = jnp.abs(out32 - want)
                    entry = {"max_abs_error": float(jnp.max(error if valid is None else jnp.where(valid, error, 0))),
                             "max_abs_error_all_rows": float(jnp.max(error)),
                             "grad_max_rel_error": [
                                 float(jnp.max(jnp.abs(g.astype(jnp.float32) - w)) / float(jnp.max(jnp.abs(w))))
                                 for g, w in zip(grads, want_grads)],
                             "negative_control_error": float(jnp.max(jnp.abs(out32 - other))),
                             "runs_cudnn_custom_call": "cudnn" in compiled.as_text().lower(),
                             "fwd_bwd_ms": 1e3 * median_seconds(
                                 lambda: jax.block_until_ready(compiled(*arguments)), 3 if quick else 10)}
                except Exception as error:  # noqa: BLE001  (a kernel that refuses a case is a finding)
                    entry = {"error": f"{type(error).__name__}: {str(error)[:400]}"}
                row[impl] = entry
                print(json.dumps({name: {impl: entry}}), file=sys.stderr, flush=True)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    return {"rows": rows}


def f32_matmul_error() -> dict:
    """How far a float32 product on this backend is from float64 at the default precision (TF32 on
    an NVIDIA GPU shows as ~1e-3 relative), and at "highest"."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    a = np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32)
    exact = a.astype(np.float64) @ a.astype(np.float64)
    rel = lambda x: float(np.max(np.abs(np.asarray(x, np.float64) - exact)) / np.max(np.abs(exact)))  # noqa: E731
    return {"case": "f32_matmul", "platform": jax.devices()[0].platform, "device": str(jax.devices()[0]),
            "default_precision_rel_error": rel(jnp.dot(a, a)),
            "highest_precision_rel_error": rel(jnp.dot(a, a, precision="highest")),
            "jax_default_matmul_precision": str(jax.config.jax_default_matmul_precision)}


# --- LM training --------------------------------------------------------------------------------

LM_FULL = dict(vocab=8192, width=1024, layers=12, heads=16, mlp=2816, context=1024, batch=16)
LM_QUICK = dict(vocab=256, width=64, layers=2, heads=4, mlp=128, context=32, batch=4)


def lm_batches(size: dict, count: int):
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.integers(0, size["vocab"], (count, size["batch"], size["context"] + 1)).astype(np.int32)


def section_lm_train(quick: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import optax

    import harness

    from dew import Trainer
    from dew.nn.backbones import CausalTransformer
    from dew.objectives.lm import LMObjective

    size = LM_QUICK if quick else LM_FULL
    batches = lm_batches(size, 8)
    steps = 3 if quick else 20
    result = {"size": size, "tokens_per_step": size["batch"] * size["context"]}

    def trainer(dtype, impl):
        model = CausalTransformer(vocab_size=size["vocab"], emb_features=size["width"], num_layers=size["layers"],
                                  num_heads=size["heads"], mlp_features=size["mlp"], max_seq_len=size["context"],
                                  tie_embeddings=False, scan_layers=True, dtype=dtype, param_dtype=jnp.float32,
                                  attention_impl=impl)
        return Trainer(LMObjective(model, size["context"]), optax.adamw(3e-4, weight_decay=0.1), key=jax.random.key(0))

    losses = {}
    for name, dtype, impl in (("bf16_auto", jnp.bfloat16, "auto"), ("bf16_xla", jnp.bfloat16, "xla"),
                              ("f32_xla", jnp.float32, "xla")):
        t = trainer(dtype, impl)
        compile_s, _ = harness.fit_window(t, batches, size["batch"], 5)  # compiles; the loss run
        losses[name] = [row["loss"] for row in t.history]
        if name != "f32_xla":
            seconds = [harness.fit_window(t, batches, size["batch"], steps)[0] for _ in range(3)]
            result[name] = {"tokens_per_second": steps * result["tokens_per_step"] / statistics.median(seconds),
                            "first_fit_s": compile_s}
        result[f"{name}_losses"] = [round(x, 4) for x in losses[name]]
        print(json.dumps({name: result.get(name), "losses": result[f"{name}_losses"]}), file=sys.stderr, flush=True)
    drift = max(abs(a - b) / abs(b) for a, b in zip(losses["bf16_auto"], losses["f32_xla"]))
    result["bf16_vs_f32_max_rel_loss_difference"] = drift
    result["bf16_losses_within_2_percent"] = drift < 0.02
    if "bf16_xla" in result:
        result["cudnn_over_xla"] = result["bf16_auto"]["tokens_per_second"] / result["bf16_xla"]["tokens_per_second"]
    params = t.init_state().variables["params"]
    result["params"] = int(sum(x.size for x in jax.tree_util.tree_leaves(params)))
    result["jax"] = jax.__version__
    return result


def section_lm_train_torch(quick: bool) -> dict:
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    size = LM_QUICK if quick else LM_FULL
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=size["vocab"], hidden_size=size["width"], num_hidden_layers=size["layers"],
                         num_attention_heads=size["heads"], num_key_value_heads=size["heads"],
                         intermediate_size=size["mlp"], max_position_embeddings=size["context"],
                         tie_word_embeddings=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=device == "cuda")
    batches = torch.as_tensor(lm_batches(size, 8), device=device).long()

    def step(forward, i):
        # transformers shifts the labels inside its loss: the ids are passed as both
        tokens = batches[i % len(batches)][:, :-1]
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = forward(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    def window(forward, steps):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(steps):
            loss = step(forward, i)
        float(loss)  # waits for the last step
        return time.perf_counter() - start

    steps = 3 if quick else 20
    tokens_per_step = size["batch"] * size["context"]
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
              "transformers": transformers.__version__}
    forwards = {"eager": model} if quick else {"eager": model, "compiled": torch.compile(model)}
    for name, forward in forwards.items():
        try:
            result[name] = {"warm_up_s": window(forward, 3)}
            result[name]["tokens_per_second"] = steps * tokens_per_step / statistics.median(
                [window(forward, steps) for _ in range(3)])
        except Exception as error:  # noqa: BLE001  (torch.compile may not build here)
            result[name] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        print(json.dumps({name: result[name]}), file=sys.stderr, flush=True)
    return result


# --- host memory (Layout(host=...), offloaded remat) --------------------------------------------


def section_offload(quick: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import optax

    import harness

    from dew import Trainer
    from dew.nn.backbones import CausalTransformer
    from dew.objectives.lm import LMObjective
    from dew.training import Layout

    size = LM_QUICK if quick else dict(LM_FULL, layers=2 if SHORT else 4, batch=8)
    batches = lm_batches(size, 4)

    def trainer(layout=Layout(), remat=None):
        model = CausalTransformer(vocab_size=size["vocab"], emb_features=size["width"], num_layers=size["layers"],
                                  num_heads=size["heads"], mlp_features=size["mlp"], max_seq_len=size["context"],
                                  scan_layers=True, remat=remat, dtype=jnp.bfloat16, param_dtype=jnp.float32)
        return Trainer(LMObjective(model, size["context"], ema_decay=0.999), optax.adamw(3e-4),
                       key=jax.random.key(0), layout=layout)

    def analysis(t):
        batch = {"text": jax.ShapeDtypeStruct((size["batch"], size["context"] + 1), jnp.int32)}
        stats = t.compiled_step().lower(t._abstract_with_shardings(), batch).compile().memory_analysis()
        return {name: int(getattr(stats, name)) for name in dir(stats)
                if name.endswith("_in_bytes") and isinstance(getattr(stats, name), int)}

    result = {"size": size, "devices": str(jax.devices()),
              "memories": [str(m.kind) for m in jax.devices()[0].addressable_memories()]}
    variants = {"baseline": dict(), "host_opt_state_ema": dict(layout=Layout(host=("opt_state", "ema"), min_shard=1)),
                "remat_minimal": dict(remat="minimal"), "remat_minimal_offloaded": dict(remat="minimal_offloaded")}
    for name, settings in variants.items():
        entry = {}
        try:
            t = trainer(**settings)
            entry["memory"] = analysis(t)
            if not SHORT:
                harness.fit_window(t, batches, size["batch"], 3)
                entry["losses"] = [row["loss"] for row in t.history]
        except Exception as error:  # noqa: BLE001
            entry["error"] = f"{type(error).__name__}: {str(error)[:400]}"
            entry["traceback"] = traceback.format_exc()[-1500:]
        result[name] = entry
        print(json.dumps({name: entry}), file=sys.stderr, flush=True)

    def device_bytes(entry):
        m = entry.get("memory", {})
        return m.get("argument_size_in_bytes", 0) + m.get("temp_size_in_bytes", 0)

    if "memory" in result["baseline"] and "memory" in result["host_opt_state_ema"]:
        result["host_layout_device_argument_bytes_saved"] = (
            result["baseline"]["memory"]["argument_size_in_bytes"]
            - result["host_opt_state_ema"]["memory"]["argument_size_in_bytes"])
        result["host_layout_same_losses"] = result["baseline"].get("losses") == result["host_opt_state_ema"].get("losses")
    if "memory" in result["remat_minimal"] and "memory" in result["remat_minimal_offloaded"]:
        result["offloaded_remat_temp_bytes_saved"] = (
            result["remat_minimal"]["memory"]["temp_size_in_bytes"]
            - result["remat_minimal_offloaded"]["memory"]["temp_size_in_bytes"])
        a, b = result["remat_minimal"].get("losses"), result["remat_minimal_offloaded"].get("losses")
        result["offloaded_remat_loss_max_rel_difference"] = (
            max(abs(x - y) / abs(y) for x, y in zip(a, b)) if a and b else None)
    result["device_bytes"] = {name: device_bytes(entry) for name, entry in result.items()
                              if isinstance(entry, dict) and "memory" in entry}
    return result


# --- serving ------------------------------------------------------------------------------------


def serve_setup(workdir: Path, quick: bool) -> dict:
    """The serve.py load and checkpoint in `workdir` (built once, by the first serving section)."""
    import serve

    load = serve.QUICK if quick else serve.FULL
    if not (workdir / "checkpoint").exists():
        serve.build_checkpoint(str(workdir / "checkpoint"))
        serve.write_prompts(workdir, load)
    return load


def section_serve(quick: bool, workdir: Path) -> dict:
    import numpy as np

    import serve

    load = serve_setup(workdir, quick)
    result = {"load": load}
    for side in ("server", "static", "server_steps8", "paged", "chunked"):
        try:
            start = time.perf_counter()
            runner = serve.DewSide(workdir, load, side)
            setup_s = time.perf_counter() - start
            windows = [runner.window() for _ in range(2)]
            seconds = statistics.median(w[0] for w in windows)
            result[side] = {"tokens_per_second": windows[0][1] / seconds, "setup_and_compile_s": setup_s,
                            **runner.finish(), "pages": runner.info.get("pages")}
        except Exception as error:  # noqa: BLE001
            result[side] = {"error": f"{type(error).__name__}: {str(error)[:400]}",
                            "traceback": traceback.format_exc()[-1500:]}
        print(json.dumps({side: result[side]}), file=sys.stderr, flush=True)
    server_tokens = workdir / "tokens_server.npy"
    if server_tokens.exists():
        reference = np.load(server_tokens)
        for side in ("static", "server_steps8", "paged", "chunked"):
            if (workdir / f"tokens_{side}.npy").exists():
                result[f"{side}_vs_server"] = serve.agreement(np.load(workdir / f"tokens_{side}.npy"), reference)
    rate = lambda side: result.get(side, {}).get("tokens_per_second")  # noqa: E731
    if rate("server") and rate("static"):
        result["server_over_static"] = rate("server") / rate("static")
    for side in ("server_steps8", "paged", "chunked"):
        if rate("server") and rate(side):
            result[f"{side}_over_server"] = rate(side) / rate("server")
    return result


def section_serve_torch(quick: bool, workdir: Path) -> dict:
    import numpy as np
    import torch
    import transformers
    from transformers import GenerationConfig

    import serve

    load = serve_setup(workdir, quick)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(workdir / "checkpoint"), dtype=torch.float32)
    model = model.to(device).eval()
    prompts = serve.load_prompts(workdir)
    config = GenerationConfig(max_new_tokens=load["new"], min_new_tokens=load["new"], do_sample=False,
                              eos_token_id=None, pad_token_id=0)

    def run():
        start = time.perf_counter()
        outputs = model.generate_batch(prompts, generation_config=config)
        seconds = time.perf_counter() - start
        ordered = [outputs[key] for key in sorted(outputs, key=lambda k: int(k.split("_")[-1]))]
        return seconds, [list(out.generated_tokens) for out in ordered]

    run()
    timed = [run() for _ in range(2)]
    seconds = statistics.median(t[0] for t in timed)
    result = {"device": device, "tokens_per_second": len(prompts) * load["new"] / seconds,
              "torch": torch.__version__, "transformers": transformers.__version__}
    if (workdir / "tokens_server.npy").exists():
        result["server_vs_transformers"] = serve.agreement(np.load(workdir / "tokens_server.npy"),
                                                           np.asarray(timed[0][1]))
    return result


# Where a Server call's time goes: each variant in its own process (XLA flags are per process)
SERVE_STEP_VARIANTS = {
    "default": {},
    "no_command_buffers": {"XLA_FLAGS": "--xla_gpu_enable_command_buffer="},
    "no_cond": {"DEW_GPU_CHECK_NO_COND": "1"},
}


def section_serve_step(quick: bool, workdir: Path) -> dict:
    """The Server's decode call on serve.py's model, timed apart, under each of SERVE_STEP_VARIANTS."""
    serve_setup(workdir, quick)  # the checkpoint, built once
    result = {}
    for name, env in SERVE_STEP_VARIANTS.items():
        command = [sys.executable, __file__, "--out", str(workdir), "--section", "serve_step_one", "--workdir",
                   str(workdir)] + (["--quick"] if quick else [])
        try:  # the variant prints each figure to the section's log as it has it
            done = subprocess.run(command, stdout=subprocess.PIPE, stderr=sys.stderr, text=True, timeout=100,
                                  env={**os.environ, **env, "DEW_GPU_CHECK_VARIANT": name})
        except subprocess.TimeoutExpired:
            result[name] = {"error": "over its limit of 100 s"}
            continue
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        result[name] = json.loads(lines[-1]) if done.returncode == 0 and lines else {"error": f"exit {done.returncode}"}
        print(json.dumps({name: result[name]}), file=sys.stderr, flush=True)
    return result


def section_serve_step_one(quick: bool, workdir: Path) -> dict:
    """One variant: milliseconds of a Server decode call (1 and 8 iterations) with the host
    waiting for it, of its launch alone, of a whole `Server.step()`, of a one-row prefill, and of
    a step of `generate`'s loop over the same rows (the static batch's inner loop)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    if os.environ.get("DEW_GPU_CHECK_NO_COND"):  # every lax.cond as both branches and a select
        def cond(pred, true_fun, false_fun, *operands):
            return jax.tree.map(lambda a, b: jnp.where(pred, a, b), true_fun(*operands), false_fun(*operands))

        jax.lax.cond = cond

    import serve
    from dew.inference import TextGeneration
    from dew.inference import serving
    from dew.interop import PretrainedDecoder
    from dew.sampling import Sampling, generate

    load = serve.QUICK if quick else serve.FULL
    bundle = PretrainedDecoder.load(str(workdir / "checkpoint"), dtype=jnp.float32)
    task = TextGeneration(bundle.model, bundle.variables)
    slots, capacity, prompt = load["slots"], load["longest"] + load["new"], load["longest"] // 2
    server = serving.Server.from_task(task, slots=slots, capacity=capacity)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, serve.SERVE_CONFIG["vocab_size"], prompt).tolist() for _ in range(slots)]
    greedy = Sampling(temperature=0.0)
    for p in prompts:
        server.submit(p, max_new_tokens=capacity - prompt, sampling=greedy, seed=0)
    server.step()  # every row seated: one prefill width
    server.step()

    def decode(steps):
        server._cache, server._state, tokens, _ = serving._decode_jit(
            server.model, server.variables, server._cache, server._state, None, steps=steps)
        return tokens

    def synced(steps):
        return lambda: np.asarray(decode(steps))

    repeats = 5 if quick else 30
    result = {"variant": os.environ.get("DEW_GPU_CHECK_VARIANT"), "slots": slots, "capacity": capacity,
              "jax": jax.__version__}
    result["decode_1_ms"] = median_seconds(synced(1), repeats) * 1e3
    print(json.dumps(result), file=sys.stderr, flush=True)
    result["decode_8_ms"] = median_seconds(synced(8), repeats // 2) * 1e3
    print(json.dumps(result), file=sys.stderr, flush=True)
    launches = []
    for _ in range(repeats):
        jax.block_until_ready(server._cache)
        start = time.perf_counter()
        tokens = decode(1)
        launches.append(time.perf_counter() - start)
        np.asarray(tokens)
    result["launch_1_ms"] = statistics.median(launches) * 1e3
    result["server_step_ms"] = median_seconds(server.step, repeats) * 1e3
    print(json.dumps(result), file=sys.stderr, flush=True)
    width = serving.padded_width(prompt, capacity)
    tokens = np.zeros((1, width), np.int32)
    tokens[0, :prompt] = prompts[0]

    def prefill():
        server._cache, server._state = serving._prefill_jit(
            server.model, server.variables, server._cache, server._state, np.int32(0), tokens, np.int32(prompt),
            jax.random.key(0), serving.RowSampling.of(greedy))
        jax.block_until_ready(server._state)

    result["prefill_one_row_ms"] = median_seconds(prefill, repeats) * 1e3
    if result["variant"] == "default" and quick:  # on a GPU, serve's static side gives the loop's step
        model, variables = task.weights.get(slots)
        short, long = 8, 8 + (8 if quick else 64)

        def static(new):
            return lambda: np.asarray(generate(model, variables, prompts, new, key=jax.random.key(0),
                                               sampling=greedy).tokens)

        per_call = {new: median_seconds(static(new), 3 if quick else 5) for new in (short, long)}
        result["generate_step_ms"] = (per_call[long] - per_call[short]) / (long - short) * 1e3
    return result


# --- the parent ---------------------------------------------------------------------------------


def run_section(name: str, quick: bool, workdir: Path) -> dict:
    if name == "attention":
        return section_attention(quick)
    if name == "lm_train":
        return section_lm_train(quick)
    if name == "lm_train_torch":
        return section_lm_train_torch(quick)
    if name == "offload":
        return section_offload(quick)
    if name == "serve":
        return section_serve(quick, workdir)
    if name == "serve_torch":
        return section_serve_torch(quick, workdir)
    if name == "serve_step":
        return section_serve_step(quick, workdir)
    if name == "serve_step_one":  # one variant's own process, started by serve_step
        return section_serve_step_one(quick, workdir)
    raise ValueError(f"unknown section {name!r}; the sections are {SECTIONS}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for gpu_check.jsonl and the sections' logs")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a check of the script on a CPU")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--budget", type=float, default=500.0,
                        help="seconds for the whole run: a section gets what is left, up to its own limit")
    parser.add_argument("--short", action="store_true",
                        help="each section's shortest form: no blockwise attention rows, host memory compiled only")
    parser.add_argument("--section", help=argparse.SUPPRESS)  # a section's own process
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.section:
        sys.path[:0] = [str(SRC), str(HERE)]  # Dew, and the benchmarks' harness and serve.py
        started = time.perf_counter()
        record = run_section(args.section, args.quick, Path(args.workdir))
        print(json.dumps({"section": args.section, "seconds": round(time.perf_counter() - started, 1), **record}))
        return
    unknown = sorted(set(args.sections.split(",")) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; the sections are {', '.join(SECTIONS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "PYTHONUNBUFFERED": "1",
           **({"DEW_GPU_CHECK_SHORT": "1"} if args.short else {})}
    deadline = time.perf_counter() + args.budget
    with tempfile.TemporaryDirectory(prefix="dew-gpu-check-") as workdir:
        for name in args.sections.split(","):
            limit = min(LIMITS[name] * (4 if args.quick else 1), deadline - time.perf_counter())
            if limit < 20:
                record = {"section": name, "error": "skipped: the run's budget is spent"}
                with open(out / "gpu_check.jsonl", "a") as f:
                    f.write(json.dumps(record) + "\n")
                continue
            command = [sys.executable, __file__, "--out", str(out), "--section", name, "--workdir", workdir]
            command += ["--quick"] if args.quick else []
            with open(out / f"{name}.log", "w") as log:
                try:
                    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                                          timeout=limit)
                    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
                    record = json.loads(lines[-1]) if done.returncode == 0 and lines else {
                        "section": name, "error": f"exit {done.returncode}", "stdout": done.stdout[-2000:]}
                except subprocess.TimeoutExpired:
                    record = {"section": name, "error": f"over its limit of {limit:.0f} s"}
            with open(out / "gpu_check.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
            print(json.dumps(record)[:3000], flush=True)


if __name__ == "__main__":
    main()
