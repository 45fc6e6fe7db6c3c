"""Llama (LlamaForCausalLM): config translation and weight-name table.

Llama's block is Dew's `CausalTransformer` without q/k norm: pre-norm RMSNorm, grouped-query
attention with RoPE (rotate-half layout, so q/k need no permutation), a SwiGLU MLP, and a head
that may be tied to the embedding. ``attention_bias`` puts a bias on q, k, v *and* o (as
transformers does); ``mlp_bias`` on gate, up and down.

The helpers here (`decoder_kwargs`, `rope_settings`, `decoder_config`) also serve the families
built on the same block (Qwen3, Mistral).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MODEL_TYPE = "llama"
ARCHITECTURE = "LlamaForCausalLM"
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


# A mixture layer's experts as transformers holds them in memory (and PEFT's target_parameters
# name them): two stacked parameters under ``mlp.experts``, ``gate_up_proj`` being Dew's
# ``gate_proj`` and ``up_proj`` side by side on the output axis. Families whose experts follow it
# list it as their EXPERT_PARAMETERS.
STACKED_EXPERTS: dict[str, tuple[str, ...]] = {
    "mlp.experts.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.experts.down_proj": ("down_proj",),
}


@dataclass(frozen=True)
class Weight:
    """One tensor: its name in the checkpoint and its path in Dew's params.

    ``{i}`` in either name stands for the layer index. ``{e}`` in the checkpoint name stands for an
    expert's index: the checkpoint holds one tensor per expert, Dew one param with the experts
    stacked on its first axis (``expert`` says which slice, once the table is expanded).
    ``transpose`` marks a linear layer's weight, stored ``[out, in]`` by torch and ``[in, out]``
    by Flax.
    """

    hf: str
    dew: str
    transpose: bool = False
    expert: int | None = None


def _linear(module: str) -> tuple[Weight, Weight]:
    """A torch Linear inside layer {i}: its weight (transposed) and its bias."""
    return (
        Weight(f"model.layers.{{i}}.{module}.weight", f"layers_{{i}}/{module.replace('.', '/')}/kernel", True),
        Weight(f"model.layers.{{i}}.{module}.bias", f"layers_{{i}}/{module.replace('.', '/')}/bias"),
    )


def _norm(module: str) -> Weight:
    return Weight(f"model.layers.{{i}}.{module}.weight", f"layers_{{i}}/{module.replace('.', '/')}/scale")


# Every tensor the block can have; a tensor the configuration does not use (a bias when there is
# none, lm_head when the head is tied) is left out by matching against the model's own params.
WEIGHTS: tuple[Weight, ...] = (
    Weight("model.embed_tokens.weight", "embed_tokens/embedding"),
    *_linear("self_attn.q_proj"),
    *_linear("self_attn.k_proj"),
    *_linear("self_attn.v_proj"),
    *_linear("self_attn.o_proj"),
    *_linear("mlp.gate_proj"),
    *_linear("mlp.up_proj"),
    *_linear("mlp.down_proj"),
    _norm("input_layernorm"),
    _norm("post_attention_layernorm"),
    Weight("model.norm.weight", "norm/scale"),
    Weight("lm_head.weight", "lm_head/kernel", True),
)

# Buffers some checkpoints carry that are recomputed, not loaded.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


# --- HF config -> CausalTransformer ---------------------------------------------------------------


def require(config: Mapping[str, Any], key: str) -> Any:
    if config.get(key) is None:
        raise ValueError(
            f"config.json (model_type={config.get('model_type')!r}) has no {key!r}; "
            "it is required to build the model. Check the file is a complete transformers config"
        )
    return config[key]


def rope_settings(config: Mapping[str, Any], default_theta: float = 10000.0) -> tuple[float, dict | None]:
    """``(rope_theta, rope_scaling)`` from either config style.

    transformers 4 writes ``rope_theta`` and ``rope_scaling``; transformers 5 writes one
    ``rope_parameters`` dict holding ``rope_theta`` and ``rope_type``. ``rope_scaling`` is None
    for plain RoPE, else the dict Dew's RoPE reads (types linear, llama3, yarn).
    """
    theta = config.get("rope_theta", default_theta)
    source = config.get("rope_parameters") or config.get("rope_scaling")
    if not source:
        return float(theta), None
    if not isinstance(source, Mapping) or any(isinstance(v, Mapping) for v in source.values()):
        raise ValueError(
            f"config.json gives RoPE settings per layer type ({source!r}); "
            f"model_type={config.get('model_type')!r} uses one RoPE for every layer"
        )
    theta = source.get("rope_theta", theta)
    factor = source.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if factor not in (None, 1, 1.0):
        raise ValueError(
            f"config.json sets partial_rotary_factor={factor}; Dew's decoder rotates the whole head "
            "(partial_rotary_factor=1.0)"
        )
    kind = source.get("rope_type", source.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"config.json asks for RoPE type {kind!r}; Dew supports {SUPPORTED_ROPE_TYPES}. "
            "Dynamic NTK and LongRoPE scaling are not implemented"
        )
    if kind == "default":
        return float(theta), None
    scaling = {k: v for k, v in source.items() if k not in ("rope_theta", "type", "partial_rotary_factor")}
    scaling["rope_type"] = kind
    context = config.get("max_position_embeddings")
    if kind in ("llama3", "yarn") and context is not None:
        # transformers fills a missing original context with max_position_embeddings
        scaling.setdefault("original_max_position_embeddings", context)
    if kind == "yarn" and context is not None:
        # YaRN reads the checkpoint's context; keep it even when max_seq_len is overridden
        scaling["max_position_embeddings"] = context
    return float(theta), scaling


def check_activation(config: Mapping[str, Any]) -> None:
    act = config.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(
            f"config.json sets hidden_act={act!r}; Dew's decoder MLP is SwiGLU (hidden_act='silu')"
        )


def decoder_kwargs(config: Mapping[str, Any], *, default_theta: float = 10000.0) -> dict[str, Any]:
    """The CausalTransformer arguments every Llama-block family shares."""
    check_activation(config)
    hidden = int(require(config, "hidden_size"))
    heads = int(require(config, "num_attention_heads"))
    theta, scaling = rope_settings(config, default_theta)
    return dict(
        vocab_size=int(require(config, "vocab_size")),
        emb_features=hidden,
        num_layers=int(require(config, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        mlp_features=int(require(config, "intermediate_size")),
        max_seq_len=int(config.get("max_position_embeddings") or 2048),
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bool(config.get("attention_bias", False)),
        mlp_bias=bool(config.get("mlp_bias", False)),
        qk_norm=False,
    )


def model_kwargs(config: Mapping[str, Any]) -> dict[str, Any]:
    """CausalTransformer arguments for a Llama config.json."""
    return decoder_kwargs(config)


# --- CausalTransformer -> HF config ---------------------------------------------------------------


def export_rope_scaling(model: Any) -> dict | None:
    """The model's rope_scaling as a config.json writes it (Dew's own keys left out)."""
    if model.rope_scaling is None:
        return None
    scaling = {k: v for k, v in dict(model.rope_scaling).items() if k != "max_position_embeddings"}
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    return scaling


def windows(model: Any) -> set[int]:
    """The sliding-window sizes the model's layers use (empty: all full attention)."""
    return {kind.window for kind in model.layer_plan if kind.window is not None}


def check_common(model: Any, family: str, *, mixture: bool = False, qkv_bias: bool = False) -> None:
    """Refuse settings no Llama-block family in transformers can express, and mixture layers or
    q/k/v-only biases unless the family has them (``mixture``, ``qkv_bias``)."""
    if model.latent_attention is not None and family != "deepseek_v3":
        raise ValueError(f"latent attention cannot be exported as {family}; a model with it exports as deepseek_v3")
    if model.mixture is not None and not mixture:
        raise ValueError(
            f"mixture-of-experts layers (mixture={dict(model.mixture)}) cannot be exported as {family}, "
            "whose layers are dense; a mixture exports as qwen3_moe (with q/k norm) or mixtral"
        )
    if model.qkv_bias and not model.attention_bias and not qkv_bias:
        raise ValueError(
            f"qkv_bias=True (biases on q, k and v only) cannot be exported as {family}; it exports as qwen2"
        )
    if not model.causal:
        raise ValueError(f"causal=False cannot be exported as {family}: transformers' decoders are causal")
    experts = {name: value for name, value in dict(model.mixture or {}).items()
               if name in ("router_bias", "expert_bias", "activation", "gate_up")
               and value not in (False, "swiglu", "separate")}
    if experts and family != "gpt_oss":
        raise ValueError(f"mixture settings {experts} cannot be exported as {family}; GPT-OSS's experts export as gpt_oss")
    if model.attention_sinks and family != "gpt_oss":
        raise ValueError(f"attention_sinks=True cannot be exported as {family}, whose attention has no sinks; it exports as gpt_oss")
    thetas = {kind.rope_theta for kind in model.layer_plan if kind.rope_theta is not None}
    if thetas - {model.rope_theta}:
        raise ValueError(
            f"layer kinds with their own rope_theta ({sorted(thetas)}) cannot be exported as {family}, "
            "which uses one rope_theta for every layer"
        )


def decoder_config(model: Any, model_type: str, architecture: str) -> dict[str, Any]:
    """The config.json fields every Llama-block family shares."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": model.vocab_size,
        "hidden_size": model.emb_features,
        "intermediate_size": model.hidden_features,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.kv_heads,
        "head_dim": model.head_features,
        "hidden_act": "silu",
        "max_position_embeddings": model.max_seq_len,
        "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_theta,
        "rope_scaling": export_rope_scaling(model),
        "attention_bias": model.attention_bias,
        "attention_dropout": 0.0,
        "tie_word_embeddings": model.tie_embeddings,
        "initializer_range": 0.02,
        "use_cache": True,
    }


def hf_config(model: Any) -> dict[str, Any]:
    """config.json for a CausalTransformer that Llama can express (no q/k norm, no windows)."""
    check_common(model, MODEL_TYPE)
    if model.qk_norm:
        raise ValueError("qk_norm=True cannot be exported as llama (Llama has no q/k norm); export as qwen3")
    if windows(model):
        raise ValueError(
            f"layer_types={list(model.layer_types)} with sliding windows {sorted(windows(model))} "
            "cannot be exported as llama, whose layers all attend to every earlier token"
        )
    config = decoder_config(model, MODEL_TYPE, ARCHITECTURE)
    config["mlp_bias"] = model.mlp_bias
    config["pretraining_tp"] = 1
    return config
