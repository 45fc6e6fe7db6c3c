"""DeepSeek-V3 (DeepseekV3ForCausalLM, also the architecture of Kimi K2): latent attention and
sigmoid-routed grouped experts.

Each layer attends by multi-head latent attention (`dew.nn.backbones.latent_attention`: a low-rank
query when ``q_lora_rank`` is set, one compressed key/value latent of ``kv_lora_rank`` plus a shared
rope key of ``qk_rope_head_dim`` per token, heads split ``qk_nope_head_dim`` + ``qk_rope_head_dim``
for scores and ``v_head_dim`` for values). The first ``first_k_dense_replace`` layers have a dense
SwiGLU MLP (``intermediate_size``); the others a mixture (`dew.nn.moe.Mixture`): sigmoid scores plus
``e_score_correction_bias`` choose ``num_experts_per_tok`` of ``n_routed_experts`` experts from the
``topk_group`` best of ``n_group`` groups, the chosen unbiased scores are renormalized
(``norm_topk_prob``) and scaled by ``routed_scaling_factor``, and ``n_shared_experts`` shared experts
(one SwiGLU ``n_shared_experts * moe_intermediate_size`` wide) see every token.

The multi-token prediction layers a release carries after the last layer
(``model.layers.{num_hidden_layers + k}.*``, ``num_nextn_predict_layers`` of them) are not part of
the causal LM (transformers does not build them): they are read into the ``mtp`` collection, frozen
(no gradient, no optimizer state), and written back by ``save``. Layer k holds ``enorm``, ``hnorm``,
``eh_proj`` (``[2 * hidden, hidden]``, Dew's layout), ``embed_tokens``, ``shared_head/norm``,
``shared_head/head`` and ``block``: a decoder layer shaped like the model's last, with its router's
``score_bias`` inside (DeepSeek-V3, arXiv:2412.19437, section 2.2).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dew.interop import fp8_blocks
from dew.interop.families import llama
from dew.interop.families.llama import Weight, _linear, _norm
from dew.nn.backbones.layer_plan import DENSE_MLP, MIXTURE_MLP
from dew.nn.moe import Mixture

MODEL_TYPE = "deepseek_v3"
ARCHITECTURE = "DeepseekV3ForCausalLM"


def _expert(name: str) -> Weight:
    return Weight(f"model.layers.{{i}}.mlp.experts.{{e}}.{name}.weight", f"layers_{{i}}/mlp/experts/{name}", True)


def _shared(name: str) -> Weight:
    return Weight(f"model.layers.{{i}}.mlp.shared_experts.{name}.weight",
                  f"layers_{{i}}/mlp/shared_expert/{name}/kernel", True)


WEIGHTS: tuple[Weight, ...] = tuple(w for w in llama.WEIGHTS if ".self_attn." not in w.hf) + (
    *_linear("self_attn.q_proj"),
    *_linear("self_attn.q_a_proj"),
    _norm("self_attn.q_a_layernorm"),
    *_linear("self_attn.q_b_proj"),
    *_linear("self_attn.kv_a_proj_with_mqa"),
    _norm("self_attn.kv_a_layernorm"),
    *_linear("self_attn.kv_b_proj"),
    *_linear("self_attn.o_proj"),
    Weight("model.layers.{i}.mlp.gate.weight", "layers_{i}/mlp/gate", True),
    # a buffer in transformers, moved by the balancing rule: the "balance" collection in Dew
    Weight("model.layers.{i}.mlp.gate.e_score_correction_bias", "balance/layers_{i}/mlp/score_bias"),
    _expert("gate_proj"),
    _expert("up_proj"),
    _expert("down_proj"),
    _shared("gate_proj"),
    _shared("up_proj"),
    _shared("down_proj"),
)
EXPERT_PARAMETERS = llama.STACKED_EXPERTS  # adapters reach the routed experts through these
IGNORED_SUFFIXES = llama.IGNORED_SUFFIXES

# Settings older DeepSeek configs spell out, with the one value Dew (and transformers) implement.
ROUTING = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}


# A multi-token prediction layer's own tensors ({i}: its index in the checkpoint, after the last layer);
# its decoder layer is named by WEIGHTS, as the model's last layer is.
MTP_WEIGHTS: tuple[Weight, ...] = (
    Weight("model.layers.{i}.enorm.weight", "enorm/scale"),
    Weight("model.layers.{i}.hnorm.weight", "hnorm/scale"),
    Weight("model.layers.{i}.eh_proj.weight", "eh_proj/kernel", True),
    Weight("model.layers.{i}.embed_tokens.weight", "embed_tokens/embedding"),
    Weight("model.layers.{i}.shared_head.norm.weight", "shared_head/norm/scale"),
    Weight("model.layers.{i}.shared_head.head.weight", "shared_head/head/kernel", True),
)
MTP_MARKER = "model.layers.{i}.eh_proj.weight"  # a checkpoint holds layer k when it holds this tensor


def mtp_shapes(hidden: int, vocab: int) -> dict[str, tuple[int, ...]]:
    """The shapes of `MTP_WEIGHTS` in Dew's layout: the two norms, the projection of the
    concatenated ``[norm(embedding), norm(hidden)]`` back to the width, and the head's embedding and output."""
    return {"enorm/scale": (hidden,), "hnorm/scale": (hidden,), "eh_proj/kernel": (2 * hidden, hidden),
            "embed_tokens/embedding": (vocab, hidden), "shared_head/norm/scale": (hidden,),
            "shared_head/head/kernel": (hidden, vocab)}


def mtp_layers(config: Mapping[str, Any]) -> int:
    """How many multi-token prediction layers config.json says the checkpoint may hold."""
    return int(config.get("num_nextn_predict_layers") or 0)


def _check_routing(config: Mapping[str, Any]) -> None:
    for key, supported in ROUTING.items():
        if key in config and config[key] != supported:
            raise ValueError(
                f"config.json sets {key}={config[key]!r}; Dew's deepseek_v3 implements {key}={supported!r} "
                "(sigmoid scores with the balancing bias, as DeepSeek-V3 and Kimi K2 ship)"
            )
    method = (config.get("quantization_config") or {}).get("quant_method")
    if method not in (None, fp8_blocks.METHOD):
        raise ValueError(
            f"config.json's quantization_config sets quant_method={method!r}; Dew reads deepseek_v3 weights "
            f"unquantized or as {fp8_blocks.METHOD!r} blocks with weight_scale_inv (the released format)"
        )
    if config.get("attention_bias"):
        raise ValueError("config.json sets attention_bias=True; Dew's latent attention has no biases "
                         "(attention_bias=False, as the released DeepSeek-V3 sets it)")


def model_kwargs(config: Mapping[str, Any]) -> dict[str, Any]:
    """CausalTransformer arguments for a DeepSeek-V3 config.json."""
    _check_routing(config)
    kwargs = llama.decoder_kwargs({**config, "head_dim": llama.require(config, "qk_rope_head_dim")})
    heads = kwargs["num_heads"]
    kwargs.update(num_kv_heads=heads, qk_norm=False, mlp_bias=False)
    kwargs["latent_attention"] = dict(
        kv_lora_rank=int(llama.require(config, "kv_lora_rank")),
        qk_nope_head_dim=int(llama.require(config, "qk_nope_head_dim")),
        qk_rope_head_dim=int(llama.require(config, "qk_rope_head_dim")),
        v_head_dim=int(llama.require(config, "v_head_dim")),
        q_lora_rank=None if config.get("q_lora_rank") is None else int(config["q_lora_rank"]),
        rope_interleave=bool(config.get("rope_interleave", True)),
    )
    dense_layers = int(config.get("first_k_dense_replace") or 0)
    experts = int(config.get("n_routed_experts") or 0)
    if experts and dense_layers < kwargs["num_layers"]:
        expert_features = int(llama.require(config, "moe_intermediate_size"))
        shared = int(config.get("n_shared_experts") or 0)
        groups = int(config.get("n_group") or 1)
        kwargs["mixture"] = dict(
            num_experts=experts,
            top_k=int(llama.require(config, "num_experts_per_tok")),
            expert_features=expert_features,
            score="sigmoid",
            score_bias=True,
            groups=groups,
            group_top_k=int(config.get("topk_group") or groups),
            normalize_top_k=bool(config.get("norm_topk_prob", False)),
            routed_scale=float(config.get("routed_scaling_factor", 1.0)),
            shared_expert_features=shared * expert_features if shared else None,
        )
        kwargs["first_k_dense"] = dense_layers
    return kwargs


def hf_config(model: Any) -> dict[str, Any]:
    """config.json for a CausalTransformer with latent attention and DeepSeek-routed mixture layers."""
    latent = dict(model.latent_attention or {})
    if not latent:
        raise ValueError("a model without latent attention (latent_attention=None) cannot be exported as "
                         "deepseek_v3; it exports as llama, qwen3, qwen3_moe or mixtral")
    llama.check_common(model, MODEL_TYPE, mixture=True)
    if model.attention_bias or model.qkv_bias or model.mlp_bias or model.qk_norm:
        raise ValueError("attention or MLP biases and q/k norm cannot be exported as deepseek_v3, whose latent "
                         "attention and MLPs have none")
    if llama.windows(model):
        raise ValueError("sliding-window layers cannot be exported as deepseek_v3, whose layers attend to every "
                         "earlier token")
    plan = model.mlp_plan
    dense_layers = plan.index(MIXTURE_MLP) if MIXTURE_MLP in plan else len(plan)
    if plan != (DENSE_MLP,) * dense_layers + (MIXTURE_MLP,) * (len(plan) - dense_layers) or not model.mixture:
        raise ValueError(f"mlp layers {list(plan)} cannot be exported as deepseek_v3, whose dense layers are the "
                         "first first_k_dense_replace and whose others are mixtures of experts")
    layer = Mixture(**model.mixture, parent=None)
    wanted = dict(score="sigmoid", score_bias=True)
    different = {name: getattr(layer, name) for name, value in wanted.items() if getattr(layer, name) != value}
    shared = layer.shared_expert_features or 0
    if shared % layer.expert_features or layer.shared_expert_gate:
        different.update(shared_expert_features=layer.shared_expert_features,
                         shared_expert_gate=layer.shared_expert_gate)
    if different:
        raise ValueError(
            f"mixture settings {different} cannot be exported as deepseek_v3, whose router scores by sigmoid "
            "with a balancing bias and whose ungated shared experts are whole multiples of an expert"
        )
    config = llama.decoder_config(model, MODEL_TYPE, ARCHITECTURE)
    for key in ("head_dim", "rope_theta", "rope_scaling"):
        config.pop(key)
    rope = {"rope_type": "default", "rope_theta": model.rope_theta, **(llama.export_rope_scaling(model) or {})}
    config.update(
        num_key_value_heads=model.num_heads,
        rope_parameters=rope,
        kv_lora_rank=latent["kv_lora_rank"],
        q_lora_rank=latent.get("q_lora_rank"),
        qk_nope_head_dim=latent["qk_nope_head_dim"],
        qk_rope_head_dim=latent["qk_rope_head_dim"],
        v_head_dim=latent["v_head_dim"],
        rope_interleave=bool(latent.get("rope_interleave", False)),
        first_k_dense_replace=dense_layers,
        n_routed_experts=layer.num_experts,
        num_experts_per_tok=layer.top_k,
        moe_intermediate_size=layer.expert_features,
        n_shared_experts=shared // layer.expert_features,
        n_group=layer.groups,
        topk_group=layer.group_top_k or layer.groups,
        norm_topk_prob=layer.normalize_top_k,
        routed_scaling_factor=layer.routed_scale,
        num_nextn_predict_layers=0,
        output_router_logits=False,
    )
    return config
