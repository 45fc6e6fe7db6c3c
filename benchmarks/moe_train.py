"""Training throughput of a Qwen3-MoE-shaped decoder: Dew's Trainer against transformers + torch.

The model keeps Qwen3-30B-A3B's structure at ~20M parameters: 6 layers of width 256, 8 query and
4 key/value heads of 32 with q/k RMSNorm, and in every layer a mixture of 8 SwiGLU experts (512
wide) of which each token takes the top 2 by softmax score, renormalized (norm_topk_prob); byte
vocabulary of 256, untied head, context 128, batch 8. Dew trains `CausalTransformer(mixture=...)`
with `Trainer` + `LMObjective(balance_coef=0.001)`; the peer is transformers'
`Qwen3MoeForCausalLM` of the same configuration (its default experts implementation) with
`output_router_logits=True`, trained by a plain eager torch loop on cross-entropy plus 0.001 times
its `aux_loss`, the same load-balancing loss. Both use AdamW at lr 1e-3, betas (0.9, 0.99), eps
1e-8, weight decay 0.1 on the 2-D and 3-D weights only, no clipping, on the same byte windows
(lm_train.py's corpus and batches).

Each side runs in its own process (benchmarks/harness.py), as in lm_train.py: a loss run on the
same batch sequence, then alternating timed windows; the median tokens/s of each configuration,
Dew's ratio against the fastest, the mean loss of the last steps of each loss run, and the share
of (token, choice) assignments each expert received over the loss run (pooled over layers).
Timed in the same rounds, unless --no-floor: the floor, Dew's decoder of the same shape whose
every layer is one dense SwiGLU of the active width (2 x 512), the products a token's experts do
with no routing; its tokens/s against the best peer bounds what any mixture of this shape can
reach with Dew's products. Each side's achieved FLOP/s is reported as a fraction of the machine's
matmul ceiling (lm_train.py's: a jitted float32 1024^3 matmul, the faster of JAX's and torch's),
counting a token's active parameters (its two experts, the router, attention, embeddings and
head) as lm_train.py counts a dense model's: flops/token = 6 N_active + 12 L H Q T; so does the
goal, what twice the best peer would have to reach. Prints one JSON line.

    .venv-ref/bin/python benchmarks/moe_train.py --dew-python .venv/bin/python [--quick]
        [--steps N] [--window N] [--repeats N] [--no-floor] [--data PATH | --synthetic]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import harness
from lm_train import (Size, flops_per_token, fraction_of_ceiling, load_corpus, make_batches, matmul_ceiling,
                      matmul_gflops_jax, matmul_gflops_torch)

VOCAB, LR, BETAS, EPS, WEIGHT_DECAY, NORM_EPS, ROPE_THETA = 256, 1e-3, (0.9, 0.99), 1e-8, 0.1, 1e-6, 1000000.0
KV_HEADS, HEAD_DIM, EXPERTS, TOP_K, BALANCE_COEF = 4, 32, 8, 2, 0.001
LAST = 10  # losses averaged at the end of each loss run
WARMUP = 3
SIZE = Size(256, 6, 8, 512, 128, 8, steps=40, window=5, repeats=3, quick=(LAST, 2, 2))
FLOOR = "dew dense floor"  # the reference side: Dew's decoder with a dense SwiGLU of the active width


# --- Dew ----------------------------------------------------------------------------------------


def dew_model(dense: bool = False):
    """The benchmark's `CausalTransformer`: the mixture, or with `dense` the floor (one SwiGLU of the
    active width, top_k x expert width, in every layer)."""
    import jax.numpy as jnp

    from dew.nn.backbones import CausalTransformer

    mixture = {"num_experts": EXPERTS, "top_k": TOP_K, "expert_features": SIZE.mlp, "normalize_top_k": True}
    return CausalTransformer(
        vocab_size=VOCAB, emb_features=SIZE.width, num_layers=SIZE.layers, num_heads=SIZE.heads,
        num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, mlp_features=SIZE.mlp * (TOP_K if dense else 1),
        max_seq_len=SIZE.context, rope_theta=ROPE_THETA, norm_eps=NORM_EPS, qk_norm=True, tie_embeddings=False,
        mixture=None if dense else mixture, dtype=jnp.float32, param_dtype=jnp.float32,
    )


class DewSide(harness.Runner):
    """The mixture model, or with ``dense`` the floor: the same decoder whose every layer is one
    SwiGLU of the active width (top_k x expert width), the products each token's two experts do
    without any routing, so no mixture of this shape can step faster on Dew's products."""

    def __init__(self, batches: np.ndarray, loss_steps: int, window: int, dense: bool = False):
        import jax
        import optax

        from dew import Trainer
        from dew.objectives.lm import LMObjective

        model = dew_model(dense)
        decay_mask = lambda params: jax.tree_util.tree_map(lambda p: p.ndim >= 2, params)  # noqa: E731
        optimizer = optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY, mask=decay_mask)
        objective = LMObjective(model, SIZE.context, balance_coef=0.0 if dense else BALANCE_COEF)
        self.trainer = Trainer(objective, optimizer, key=jax.random.key(0))
        self.timed, self.steps = batches[:window], window
        params = sum(x.size for x in jax.tree_util.tree_leaves(self.trainer.init_state().variables["params"]))
        if dense:  # timed only: a warm-up compiles
            self.fit(batches[:WARMUP], WARMUP)
            self.info = {"params": params}
            return
        self.fit(batches[:loss_steps], loss_steps)  # the loss run; compiles
        history = self.trainer.history
        tokens = np.asarray([[row[f"router/expert_{e}_tokens"] for e in range(EXPERTS)] for row in history]).sum(0)
        self.info = {"params": params, "jax": jax.__version__,
                     "loss_last": round(statistics.fmean(r["cross_entropy"] for r in history[-LAST:]), 4),
                     "loss_first": round(history[0]["cross_entropy"], 4),
                     "expert_share": [round(float(t), 4) for t in tokens / tokens.sum()]}

    def fit(self, batches, steps: int) -> float:
        """Train `steps` steps from a fresh state, as a user's `fit` call does; the wall seconds."""
        return harness.timed_fit(self.trainer, batches, SIZE.batch, steps)

    def window(self):
        return self.fit(self.timed, self.steps), self.steps * SIZE.batch * SIZE.context

    def finish(self):
        return {"matmul_gflops": matmul_gflops_jax()}


def active_params() -> int:
    """The parameters one token uses, counted as lm_train.py's 6 N counts every parameter of a dense
    model: embedding and untied head, the final norm, and per layer attention (q/k norms
    included), both norms, the router and its top_k experts' SwiGLU."""
    attention = SIZE.width * HEAD_DIM * (2 * SIZE.heads + 2 * KV_HEADS) + 2 * HEAD_DIM
    experts = TOP_K * 3 * SIZE.width * SIZE.mlp + SIZE.width * EXPERTS
    return 2 * VOCAB * SIZE.width + SIZE.width + SIZE.layers * (attention + experts + 2 * SIZE.width)


# --- transformers + torch -----------------------------------------------------------------------


class TorchSide(harness.Runner):
    def __init__(self, batches: np.ndarray, loss_steps: int, window: int, compile: bool):
        import torch
        import transformers
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        self.torch = torch
        torch.manual_seed(0)
        config = Qwen3MoeConfig(
            vocab_size=VOCAB, hidden_size=SIZE.width, intermediate_size=SIZE.mlp, moe_intermediate_size=SIZE.mlp,
            num_hidden_layers=SIZE.layers, num_attention_heads=SIZE.heads, num_key_value_heads=KV_HEADS,
            head_dim=HEAD_DIM, num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True,
            decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=SIZE.context, rms_norm_eps=NORM_EPS,
            rope_theta=ROPE_THETA, tie_word_embeddings=False, attention_bias=False, attention_dropout=0.0,
            hidden_act="silu", use_cache=False, output_router_logits=True, router_aux_loss_coef=BALANCE_COEF,
        )
        model = Qwen3MoeForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        self.optimizer = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS)
        self.model = torch.compile(model) if compile else model
        self.counts = torch.zeros(EXPERTS)
        self.batches = [torch.from_numpy(b.astype(np.int64)) for b in batches]
        self.count_experts = True
        losses = self.run(self.batches[:loss_steps])  # the loss run, or the warm-up (compiles)
        self.count_experts = False
        self.info = {"params": sum(p.numel() for p in model.parameters()), "threads": torch.get_num_threads(),
                     "torch": torch.__version__, "transformers": transformers.__version__,
                     "experts_implementation": model.config._experts_implementation}
        if loss_steps > WARMUP:
            self.info.update({"loss_last": round(statistics.fmean(losses[-LAST:]), 4),
                              "loss_first": round(losses[0], 4),
                              "expert_share": [round(float(c), 4) for c in self.counts / self.counts.sum()]})
        self.timed = self.batches[:window]

    def step(self, batch):
        torch = self.torch
        inputs, targets = batch[:, :-1], batch[:, 1:]
        out = self.model(input_ids=inputs, use_cache=False, output_router_logits=True)
        cross_entropy = torch.nn.functional.cross_entropy(out.logits.reshape(-1, VOCAB).float(), targets.reshape(-1))
        loss = cross_entropy + BALANCE_COEF * out.aux_loss
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        if self.count_experts:  # the loss run only: the top-k choices of every layer's router
            with torch.no_grad():
                for logits in out.router_logits:
                    chosen = torch.topk(logits.float().softmax(-1), TOP_K, dim=-1).indices
                    self.counts += torch.bincount(chosen.reshape(-1), minlength=EXPERTS).float()
        return cross_entropy.detach()

    def run(self, batches) -> list[float]:
        return [float(x) for x in [self.step(b) for b in batches]]  # losses read after the loop

    def window(self):
        start = time.perf_counter()
        self.run(self.timed)
        return time.perf_counter() - start, len(self.timed) * SIZE.batch * SIZE.context

    def finish(self):
        return {"matmul_gflops": matmul_gflops_torch()}


def worker(config: dict) -> harness.Runner:
    batches = np.load(Path(config["workdir"]) / "batches.npy")
    if config["side"] in ("dew", "dew-dense"):
        return DewSide(batches, config["loss_steps"], config["window"], dense=config["side"] == "dew-dense")
    harness.set_peer_threads(config)
    loss_steps = config["loss_steps"] if config.get("loss_run") else WARMUP
    return TorchSide(batches, loss_steps, config["window"], config.get("compile", False))


# --- the parent ---------------------------------------------------------------------------------


def main() -> None:
    if (config := harness.worker_config()) is not None:
        harness.serve(config, worker)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short sanity run (few steps and windows)")
    parser.add_argument("--steps", type=int, help=f"steps of the loss run (default {SIZE.steps})")
    parser.add_argument("--window", type=int, help=f"steps per timed window (default {SIZE.window})")
    parser.add_argument("--repeats", type=int, help=f"timed windows per side (default {SIZE.repeats})")
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile configuration")
    parser.add_argument("--no-floor", action="store_true",
                        help="leave out the floor: Dew's decoder with a dense SwiGLU of the active width")
    parser.add_argument("--dew-python", default=sys.executable, help="interpreter of the Dew side")
    parser.add_argument("--peer-python", default=sys.executable, help="interpreter of the torch sides")
    parser.add_argument("--data", default=None, help="a text file read as bytes (default as lm_train.py)")
    parser.add_argument("--synthetic", action="store_true", help="a generated byte corpus instead of --data")
    args = parser.parse_args()
    corpus, corpus_name = load_corpus(args.data, args.synthetic)
    steps, window, repeats = SIZE.quick if args.quick else (SIZE.steps, SIZE.window, SIZE.repeats)
    steps, window, repeats = args.steps or steps, args.window or window, args.repeats or repeats
    if steps <= WARMUP:
        sys.exit(f"moe_train: --steps must be more than {WARMUP}, got {steps}")
    script = str(Path(__file__).resolve())
    config = {"loss_steps": steps, "window": window}
    sides = [harness.side("dew", "dew", script, [], {**config, "side": "dew"}, python=args.dew_python)]
    if not args.no_floor:
        sides.append(harness.side(FLOOR, "reference", script, [], {**config, "side": "dew-dense"},
                                  python=args.dew_python))
    sides += harness.torch_sides(script, [], {**config, "side": "torch"}, compile=not args.no_compile,
                                 python=args.peer_python)
    with tempfile.TemporaryDirectory(prefix="dew-moe-train-") as workdir:
        np.save(Path(workdir) / "batches.npy", make_batches(corpus, max(steps, window), SIZE))
        result = harness.compare(sides, repeats, workdir=workdir)
    dew, best = result.dew, result.best_peer
    floor = next((o for o in result.outcomes if o.name == FLOOR), None)
    torch_default = next(o for o in result.outcomes if o.name == "torch defaults")
    ceiling = matmul_ceiling(dew, torch_default)
    flops = flops_per_token(active_params(), SIZE.layers, SIZE.heads, HEAD_DIM, SIZE.context)
    torch_loss = next(o for o in result.outcomes if o.config.get("loss_run"))
    report = {
        "benchmark": "moe_train",
        "work": (
            f"Qwen3-MoE-shaped decoder {SIZE.layers}L x width {SIZE.width}, {SIZE.heads}/{KV_HEADS} heads of "
            f"{HEAD_DIM} with q/k norm, every layer {EXPERTS} SwiGLU experts of {SIZE.mlp} (top {TOP_K}, "
            f"renormalized), context {SIZE.context}, batch {SIZE.batch}, byte vocab {VOCAB}, untied; "
            f"cross-entropy + {BALANCE_COEF} x load-balancing loss; AdamW lr {LR} betas {list(BETAS)} "
            f"wd {WEIGHT_DECAY} on 2-D and 3-D weights, no clipping"
        ),
        "corpus": f"{corpus_name}, {len(corpus)} bytes",
        "params": {"dew": dew.info["params"], "torch": torch_default.info.get("params"),
                   **({"floor": floor.info.get("params")} if floor else {})},
        **result.report("tokens_per_s", 1),
        "goal": "dew_over_best_peer >= 2",
        **({"floor_over_best_peer": round(floor.rate / best.rate, 3),
            "dew_over_floor": round(dew.rate / floor.rate, 3)} if floor and floor.rate else {}),
        "window_steps": window,
        "loss_steps": steps,
        f"dew_cross_entropy_last{min(LAST, steps)}": dew.info.get("loss_last"),
        f"torch_cross_entropy_last{min(LAST, steps)}": torch_loss.info.get("loss_last"),
        "dew_cross_entropy_first": dew.info.get("loss_first"),
        "torch_cross_entropy_first": torch_loss.info.get("loss_first"),
        "dew_expert_share": dew.info.get("expert_share"),
        "torch_expert_share": torch_loss.info.get("expert_share"),
        "torch_loss_run_by": torch_loss.name,
        "torch_experts_implementation": torch_default.info.get("experts_implementation"),
        "matmul_gflops": {"jax_f32_1024": dew.finished.get("matmul_gflops"),
                          "torch_f32_1024": torch_default.finished.get("matmul_gflops")},
        "flops_per_token": flops,
        "dew_fraction_of_matmul": fraction_of_ceiling(dew.rate, flops, ceiling),
        "best_peer_fraction_of_matmul": fraction_of_ceiling(best.rate, flops, ceiling),
        "floor_fraction_of_matmul": fraction_of_ceiling(floor.rate, flops, ceiling) if floor else None,
        "goal_fraction_of_matmul": fraction_of_ceiling(2 * best.rate, flops, ceiling),
        "torch_default_threads": torch_default.info.get("threads"),
        "hardware": harness.hardware(),
        "jax": dew.info.get("jax"),
        "torch": torch_default.info.get("torch"),
        "transformers": torch_default.info.get("transformers"),
    }
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
