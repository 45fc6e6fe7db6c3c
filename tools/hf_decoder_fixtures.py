"""Build tiny random Hugging Face decoders and record what transformers computes with them.

Writes one directory per model (Llama, Qwen3, Qwen3 with a sliding layer, Mistral, Qwen2, Mixtral,
Qwen3-MoE, GPT-OSS, DeepSeek-V3 with and without the query's low rank) under tests/fixtures/hf/,
read by tests/test_interop.py, tests/test_moe_families.py, tests/test_gpt_oss.py and
tests/test_deepseek_v3.py:

    config.json, model.safetensors, generation_config.json   (save_pretrained, float32)
    reference.npz   input_ids [2, 12] and their logits [2, 12, vocab];
                    prompt [2, 5] and its greedy continuation [2, 10] (generate, do_sample=False);
                    for a mixture of experts, aux_loss: the load-balancing loss of input_ids

The weights are seeded and drawn wider than HF's N(0, 0.02) initializer (and the RMSNorm scales are
moved off 1), so the logits depend clearly on every tensor: a transposed or swapped weight, or a
wrong RoPE setting, changes them far beyond the test tolerance.

GPT-OSS's expert kernels are drawn as MXFP4, the way the release stores them: random 4-bit codes
and power-of-two block scales, decoded by transformers' own `convert_moe_packed_tensors` (exact in
float32). gpt_oss/ holds them decoded; gpt_oss-mxfp4/ holds the same model with the expert
kernels as ``*_blocks`` and ``*_scales`` and a ``quantization_config``, and transformers' logits
from loading that directory (dequantize=True) are checked against gpt_oss's before it is kept.

Run with the reference environment (torch CPU + transformers), not Dew's:

    python3 -m venv .venv-ref
    .venv-ref/bin/pip install torch==2.13.0
    .venv-ref/bin/pip install transformers safetensors numpy
    .venv-ref/bin/python tools/hf_decoder_fixtures.py            # every fixture
    .venv-ref/bin/python tools/hf_decoder_fixtures.py mistral    # only the named ones

``deepseek_v3-fp8`` is the deepseek_v3 fixture's weights quantized here to FP8 blocks (DeepSeek's
release format, small blocks), with the weights, logits and greedy tokens transformers reads from it.
``deepseek_v3-mtp`` is the deepseek_v3 fixture with one multi-token prediction layer after its last
(``model.layers.3.*``, as the release's ``model.layers.61.*``), drawn here since transformers does not
build it; transformers reads the directory (leaving that layer out) with the source's logits.
"""

from __future__ import annotations

import pathlib
import shutil
import sys

import numpy as np
import torch
import transformers

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests/fixtures/hf"

SIZES = dict(
    vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, intermediate_size=128,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)

DEEPSEEK_SIZES = {k: v for k, v in SIZES.items() if k != "head_dim"}  # its head widths are its own

FIXTURES = {
    # Llama 3.1 style: an untied head and "llama3" RoPE scaling with a small original context,
    # so the scaling changes most of the head's frequencies.
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        SIZES, tie_word_embeddings=False, max_position_embeddings=64, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
        rms_norm_eps=1e-5,
    )),
    # Qwen3: q/k RMSNorm and a tied head.
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(
        SIZES, tie_word_embeddings=True, max_position_embeddings=64, rope_theta=1000000.0,
    )),
    # Qwen3 with its second layer on a 4-token sliding window (a narrower model, to stay small).
    "qwen3-sliding": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(
        SIZES, hidden_size=32, head_dim=8, intermediate_size=64, tie_word_embeddings=True,
        max_position_embeddings=64, use_sliding_window=True, sliding_window=4, max_window_layers=1,
    )),
    # Mistral 7B v0.1's structure at a tiny size: an untied head, grouped-query attention with four
    # query heads per key/value head (32 and 8 in the release), RoPE base 10,000 and every layer on
    # a sliding window, here 4 tokens so the 12-token inputs cross it.
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(
        SIZES, num_attention_heads=8, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
        max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-5, sliding_window=4,
    )),
    # Qwen2.5-0.5B's structure: biases on q, k and v only, 7 query heads per key/value head
    # (14 and 2 in the release), a tied head, RoPE base 1,000,000, no sliding window.
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(
        {k: v for k, v in SIZES.items() if k != "head_dim"},  # Qwen2's heads split hidden_size
        hidden_size=56, num_attention_heads=7, num_key_value_heads=1, intermediate_size=96, tie_word_embeddings=True, max_position_embeddings=64, rope_theta=1000000.0,
    )),
    # Mixtral 8x7B's structure: every layer a mixture of 8 experts, top-2 with the chosen scores
    # renormalized, grouped-query attention with 4 query heads per key/value head, an untied head
    # and RoPE base 1,000,000 (narrow experts, to stay small).
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, dict(
        SIZES, hidden_size=32, num_attention_heads=8, num_key_value_heads=2, head_dim=8, intermediate_size=24,
        num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False, max_position_embeddings=64,
        rope_theta=1000000.0, rms_norm_eps=1e-5, sliding_window=None,
    )),
    # Qwen3-30B-A3B's structure: q/k norm, heads wider than the model (8 x 8 over a 32-wide
    # residual, as 32 x 128 over 2048), softmax top-k routing with the chosen scores renormalized
    # (norm_topk_prob) and an untied head; 3 layers, the middle one dense by mlp_only_layers and a
    # dense MLP wider than the experts, as the release's dense intermediate_size is.
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, dict(
        SIZES, hidden_size=32, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=8,
        intermediate_size=48, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=3,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], tie_word_embeddings=False,
        max_position_embeddings=64, rope_theta=1000000.0,
    )),
    # gpt-oss-20b's structure: layers alternating between a sliding window (here 4 tokens, so the
    # 12-token inputs cross it; 128 in the release) and full attention, sinks and q/k/v/o biases,
    # 4 query heads per key/value head (64 and 8), top-4 of 8 experts (of 32) with router and
    # expert biases and the clamped SwiGLU, an untied head, and the release's YaRN RoPE over a
    # small original context so the scaling changes most frequencies. Widths are multiples of 32,
    # MXFP4's block.
    "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM, dict(
        SIZES, hidden_size=32, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=8,
        intermediate_size=32, num_local_experts=8, num_experts_per_tok=4, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False,
        max_position_embeddings=512, rms_norm_eps=1e-5, attention_bias=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16},
    )),
    # DeepSeek-V3's structure (the architecture Kimi K2 ships): multi-head latent attention with a
    # low-rank query (q_lora_rank) and a compressed key/value latent plus one shared rope key, heads
    # split into unrotated and rotated parts with a value width of its own, YaRN RoPE (whose mscale
    # also scales the softmax), the first layer dense (first_k_dense_replace), then mixtures routed by
    # sigmoid scores with a balancing bias, the best 2 of 4 groups, top-3 of 8 renormalized and scaled
    # by 2.5, and a shared expert.
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, dict(
        DEEPSEEK_SIZES, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=3,
        n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=8, tie_word_embeddings=False, max_position_embeddings=64, rope_interleave=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
    )),
    # DeepSeek-V3's attention without the query's low rank (q_lora_rank=None, as DeepSeek-V2-Lite),
    # plain RoPE without interleaving, and every layer a mixture with one group.
    "deepseek_v3-full-q": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, dict(
        DEEPSEEK_SIZES, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, n_shared_experts=2, routed_scaling_factor=1.0, norm_topk_prob=False,
        first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=8, tie_word_embeddings=False, max_position_embeddings=64, rope_interleave=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )),
}

# MXFP4 expert kernels: the power-of-two exponents their block scales are drawn from, per kernel
MXFP4_EXPONENTS = {"gate_up_proj": (-3, 0), "down_proj": (-5, -2)}

WEIGHT_STD = 0.15  # wider than HF's 0.02 so the logits are far from uniform


def build(config_cls, model_cls, settings, seed):
    torch.manual_seed(seed)
    config = config_cls(**settings, attn_implementation="eager")
    model = model_cls(config).to(torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if tensor.ndim == 1 and name.endswith("norm.weight"):
                tensor.copy_(1.0 + 0.2 * torch.randn(tensor.shape, generator=generator))
            elif name.endswith(".sinks"):  # sinks on the scale of the attention logits
                tensor.copy_(torch.randn(tensor.shape, generator=generator))
            else:
                tensor.copy_(WEIGHT_STD * torch.randn(tensor.shape, generator=generator))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek's balancing bias: moved off zero
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))
    if config.tie_word_embeddings:
        model.tie_weights()
    return model


def draw_mxfp4_experts(model, seed):
    """Replace every expert kernel by the decoding of random MXFP4 codes; returns the packed
    tensors by checkpoint name (``*_blocks [E, out, in / 32, 16]``, ``*_scales [E, out, in / 32]``)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(seed)
    packed = {}
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            kernel = name.rsplit(".", 1)[-1]
            if kernel not in MXFP4_EXPONENTS:
                continue
            experts, width_in, width_out = tensor.shape
            blocks = torch.from_numpy(rng.integers(0, 256, (experts, width_out, width_in // 32, 16), dtype=np.uint8))
            low, high = MXFP4_EXPONENTS[kernel]
            scales = torch.from_numpy((127 + rng.integers(low, high + 1, blocks.shape[:-1])).astype(np.uint8))
            tensor.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
            packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
    return packed


def write_mxfp4_copy(directory, packed, logits, input_ids):
    """``directory``-mxfp4: the checkpoint with its expert kernels packed, after checking that
    transformers loads it (dequantizing) to the same logits."""
    import json

    from safetensors.torch import load_file, save_file

    target = directory.with_name(directory.name + "-mxfp4")
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(directory, target)
    (target / "reference.npz").unlink()
    tensors = load_file(target / "model.safetensors")
    for name in packed:
        tensors.pop(name.removesuffix("_blocks").removesuffix("_scales"), None)
    save_file({**tensors, **packed}, target / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                   "lm_head"],
    }
    (target / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    reloaded = transformers.GptOssForCausalLM.from_pretrained(
        target, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32)
    with torch.no_grad():
        got = reloaded.eval()(torch.from_numpy(input_ids)).logits.float().numpy()
    error = float(np.abs(got - logits).max())
    if error > 1e-5:
        shutil.rmtree(target)
        raise SystemExit(f"transformers reads {target} to logits {error} away from the unpacked model's")
    print(f"{target.name}: transformers' dequantized logits within {error:.1e} of {directory.name}'s")


def record(name, seed):
    config_cls, model_cls, settings = FIXTURES[name]
    model = build(config_cls, model_cls, settings, seed)
    packed = draw_mxfp4_experts(model, seed) if name == "gpt_oss" else {}
    directory = OUT / name
    shutil.rmtree(directory, ignore_errors=True)
    model.save_pretrained(directory, safe_serialization=True)

    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    input_ids = rng.integers(3, vocab, size=(2, 12)).astype(np.int64)  # no bos/eos/pad ids
    prompt = rng.integers(3, vocab, size=(2, 5)).astype(np.int64)
    with torch.no_grad():
        logits = model(torch.from_numpy(input_ids)).logits.float().numpy()
        generated = model.generate(
            torch.from_numpy(prompt), attention_mask=torch.ones_like(torch.from_numpy(prompt)),
            max_new_tokens=10, do_sample=False, num_beams=1,
        ).numpy()[:, prompt.shape[1]:]
    extra = {}
    if getattr(model.config, "num_experts_per_tok", None):  # a mixture: its load-balancing loss too
        with torch.no_grad():
            aux_loss = model(torch.from_numpy(input_ids), output_router_logits=True).aux_loss
        if aux_loss is not None:  # DeepSeek-V3 balances by its bias and reports none
            extra["aux_loss"] = aux_loss.numpy()
    np.savez_compressed(
        directory / "reference.npz",
        input_ids=input_ids.astype(np.int32), logits=logits.astype(np.float32),
        prompt=prompt.astype(np.int32), greedy=generated.astype(np.int32), **extra,
    )
    size = sum(path.stat().st_size for path in directory.iterdir())
    print(f"{name}: {size / 1024:.0f} KiB, greedy {generated.tolist()}")
    if packed:
        write_mxfp4_copy(directory, packed, logits, input_ids)


FP8_SOURCE = "deepseek_v3"
FP8_BLOCK = (4, 8)  # small blocks, so each tiny weight holds several (the releases use 128 x 128)
FP8_QUANTIZED = ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj",
                 "self_attn.o_proj", "gate_proj", "up_proj", "down_proj")  # as the release: not the router


def quantize_fp8(weight, block):
    """DeepSeek's block quantization in torch: one scale per block, amax / 448, values weight / scale."""
    rows, cols = weight.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    scale = torch.empty(grid, dtype=torch.float32)
    values = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            part = weight[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            scale[i, j] = part.abs().max() / 448.0
            values[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = (part / scale[i, j]).to(
                torch.float8_e4m3fn)
    return values, scale


def record_fp8():
    """The deepseek_v3 fixture's weights FP8-quantized in blocks, and what transformers reads from them:
    its dequantized float32 weights (reference.npz "dequantized/NAME"), logits and greedy tokens."""
    import json

    from safetensors.torch import load_file, save_file

    source, directory = OUT / FP8_SOURCE, OUT / f"{FP8_SOURCE}-fp8"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    tensors = load_file(source / "model.safetensors")
    quantized = {}
    for name, tensor in list(tensors.items()):
        if name.endswith(".weight") and ".layers." in name and any(f".{m}.weight" in name for m in FP8_QUANTIZED):
            tensors[name], tensors[name + "_scale_inv"] = quantize_fp8(tensor, FP8_BLOCK)
            quantized[name] = tensors[name]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(FP8_BLOCK)}
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    shutil.copy(source / "generation_config.json", directory / "generation_config.json")

    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager",
        quantization_config=transformers.FineGrainedFP8Config(dequantize=True, weight_block_size=list(FP8_BLOCK)),
    ).eval()
    state = model.state_dict()
    reference = dict(np.load(source / "reference.npz"))
    with torch.no_grad():
        logits = model(torch.from_numpy(reference["input_ids"]).long()).logits.float().numpy()
        prompt = torch.from_numpy(reference["prompt"]).long()
        generated = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10,
                                   do_sample=False, num_beams=1).numpy()[:, prompt.shape[1]:]
    dequantized = {}
    for name in quantized:  # transformers holds experts stacked: [E, 2F, H] gate_up and [E, H, F] down
        if ".experts." in name:
            layer, rest = name.split(".mlp.experts.")
            expert, projection = int(rest.split(".")[0]), rest.split(".")[1]
            if projection == "down_proj":
                value = state[f"{layer}.mlp.experts.down_proj"][expert]
            else:
                gate_up = state[f"{layer}.mlp.experts.gate_up_proj"][expert]
                half = gate_up.shape[0] // 2
                value = gate_up[:half] if projection == "gate_proj" else gate_up[half:]
        else:
            value = state[name]
        dequantized[f"dequantized/{name}"] = value.float().numpy()
    np.savez_compressed(directory / "reference.npz", input_ids=reference["input_ids"], prompt=reference["prompt"],
                        logits=logits.astype(np.float32), greedy=generated.astype(np.int32), **dequantized)
    print(f"{directory.name}: {len(quantized)} FP8 tensors, greedy {generated.tolist()}")


MTP_SOURCE = "deepseek_v3"


def record_mtp():
    """The deepseek_v3 fixture plus a multi-token prediction layer: enorm, hnorm, eh_proj, embed_tokens,
    shared_head.{norm,head} and a decoder layer shaped like the last one, with its own balancing bias."""
    import json

    from safetensors.torch import load_file, save_file

    source, directory = OUT / MTP_SOURCE, OUT / f"{MTP_SOURCE}-mtp"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    config = json.loads((source / "config.json").read_text())
    last, mtp = config["num_hidden_layers"] - 1, config["num_hidden_layers"]
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    generator = torch.Generator().manual_seed(len(FIXTURES) + 1)

    def draw(name, shape):
        if name.endswith("norm.weight"):
            return 1.0 + 0.2 * torch.randn(shape, generator=generator)
        if name.endswith("e_score_correction_bias"):
            return 0.1 * torch.randn(shape, generator=generator)
        return WEIGHT_STD * torch.randn(shape, generator=generator)

    tensors = load_file(source / "model.safetensors")
    added = {}
    for name, tensor in sorted(tensors.items()):
        if name.startswith(f"model.layers.{last}."):
            added[name.replace(f"model.layers.{last}.", f"model.layers.{mtp}.", 1)] = tuple(tensor.shape)
    for part, shape in {"enorm.weight": (hidden,), "hnorm.weight": (hidden,), "eh_proj.weight": (hidden, 2 * hidden),
                        "embed_tokens.weight": (vocab, hidden), "shared_head.norm.weight": (hidden,),
                        "shared_head.head.weight": (vocab, hidden)}.items():
        added[f"model.layers.{mtp}.{part}"] = shape
    for name, shape in added.items():
        tensors[name] = draw(name, shape).to(torch.float32).contiguous()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = 1
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    shutil.copy(source / "generation_config.json", directory / "generation_config.json")

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    reference = dict(np.load(source / "reference.npz"))
    with torch.no_grad():
        logits = model(torch.from_numpy(reference["input_ids"]).long()).logits.float().numpy()
    if not np.array_equal(logits, reference["logits"]):
        raise SystemExit("transformers' logits changed with the multi-token prediction layer beside the model")
    np.savez_compressed(directory / "reference.npz", **reference)
    print(f"{directory.name}: {len(added)} multi-token prediction tensors")


def main(names):
    """Record the named fixtures (all by default); each keeps the seed of its place in FIXTURES."""
    unknown = sorted(set(names) - set(FIXTURES) - {f"{FP8_SOURCE}-fp8", f"{MTP_SOURCE}-mtp"})
    if unknown:
        raise SystemExit(f"unknown fixtures {unknown}; choose from {list(FIXTURES)}")
    OUT.mkdir(parents=True, exist_ok=True)
    for seed, name in enumerate(FIXTURES):
        if not names or name in names:
            record(name, seed)
    if not names or f"{FP8_SOURCE}-fp8" in names:
        record_fp8()
    if not names or f"{MTP_SOURCE}-mtp" in names:
        record_mtp()
    total = sum(path.stat().st_size for path in OUT.rglob("*") if path.is_file())
    print(f"total {total / 1024:.0f} KiB in {OUT}")


if __name__ == "__main__":
    main(sys.argv[1:])
