"""GPT-OSS (GptOssForCausalLM): attention sinks, biases everywhere, and clamped-SwiGLU experts.

Each layer attends with learned sinks (one logit per query head, ``self_attn.sinks``) and biases
on q, k, v and o; layers alternate between a ``sliding_window`` and full attention as
``layer_types`` lists them (sliding first by default). RoPE is YaRN-scaled (the release's
``rope_parameters``: factor 32 over a 4,096-token original context, ``truncate=False``). Every
feed-forward is a mixture: a biased linear router whose k largest logits go through a softmax,
and experts whose fused ``gate_up_proj [E, hidden, 2F]`` alternates gate and up columns, with
biases and GPT-OSS's clamped SwiGLU (`dew.nn.moe.clamped_swiglu`). Unlike the other families the
expert tensors are stored whole, already ``[in, out]``, not one per expert.

The released checkpoints store those expert kernels in MXFP4 (``*_blocks`` and ``*_scales``);
`dew.interop.codecs` decodes them on load and packs them again on save.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dew.interop.families import llama
from dew.interop.families.llama import Weight
from dew.nn.backbones.layer_plan import FULL_ATTENTION, SLIDING_ATTENTION, LayerKind
from dew.nn.moe import Mixture

MODEL_TYPE = "gpt_oss"
ARCHITECTURE = "GptOssForCausalLM"
DEFAULT_THETA = 150000.0  # transformers' GptOssConfig.default_theta
DEFAULT_ROPE = {  # what transformers' GptOssConfig fills in when config.json names no RoPE
    "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
    "original_max_position_embeddings": 4096,
}
# the Mixture settings that make a layer GPT-OSS's (the sizes and swiglu constants come from the config)
MIXTURE_SETTINGS = dict(score="softmax", normalize_top_k=True, routed_scale=1.0, shared_expert_features=None,
                        router_bias=True, expert_bias=True, activation="clamped_swiglu", gate_up="interleaved")


def _layer(hf: str, dew: str, transpose: bool = False) -> Weight:
    return Weight(f"model.layers.{{i}}.{hf}", f"layers_{{i}}/{dew}", transpose)


WEIGHTS: tuple[Weight, ...] = tuple(w for w in llama.WEIGHTS if ".mlp." not in w.hf) + (
    _layer("self_attn.sinks", "self_attn/sinks"),
    _layer("mlp.router.weight", "mlp/gate", True),
    _layer("mlp.router.bias", "mlp/gate_bias"),
    _layer("mlp.experts.gate_up_proj", "mlp/experts/gate_up_proj"),
    _layer("mlp.experts.gate_up_proj_bias", "mlp/experts/gate_up_proj_bias"),
    _layer("mlp.experts.down_proj", "mlp/experts/down_proj"),
    _layer("mlp.experts.down_proj_bias", "mlp/experts/down_proj_bias"),
)
# adapters reach the experts through these: the fused gate_up_proj (gate and up columns interleaved,
# as transformers holds it, so a factor's columns line up on both sides) and down_proj
EXPERT_PARAMETERS: dict[str, tuple[str, ...]] = {
    "mlp.experts.gate_up_proj": ("gate_up_proj",),
    "mlp.experts.down_proj": ("down_proj",),
}
IGNORED_SUFFIXES = llama.IGNORED_SUFFIXES


def layer_types(config: Mapping[str, Any], layers: int) -> tuple[str, ...]:
    """config.json's ``layer_types``, or transformers' default: sliding, full, sliding, ..."""
    types = config.get("layer_types")
    if types is None:
        return tuple(SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(layers))
    unknown = sorted(set(types) - {SLIDING_ATTENTION, FULL_ATTENTION})
    if unknown:
        raise ValueError(
            f"config.json's layer_types names {unknown}; gpt_oss layers are 'sliding_attention' or 'full_attention'"
        )
    return tuple(types)


def model_kwargs(config: Mapping[str, Any]) -> dict[str, Any]:
    """CausalTransformer arguments for a GPT-OSS config.json."""
    if not config.get("rope_parameters") and not config.get("rope_scaling"):
        config = {**config, "rope_parameters": {**DEFAULT_ROPE, "rope_theta": config.get("rope_theta", DEFAULT_THETA)}}
    kwargs = llama.decoder_kwargs(config, default_theta=DEFAULT_THETA)
    layers = kwargs["num_layers"]
    types = layer_types(config, layers)
    kwargs.update(
        attention_bias=bool(config.get("attention_bias", True)),  # GptOssConfig's default
        norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        mlp_bias=False,
        attention_sinks=True,
        layer_types=types,
        mixture=dict(
            MIXTURE_SETTINGS,
            num_experts=int(llama.require(config, "num_local_experts")),
            top_k=int(llama.require(config, "num_experts_per_tok")),
            expert_features=kwargs["mlp_features"],
            swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(config.get("swiglu_limit", 7.0)),
        ),
    )
    if SLIDING_ATTENTION in types:
        window = config.get("sliding_window", 128)
        if not window:
            raise ValueError(f"config.json's layer_types has sliding layers but sliding_window={window!r}; give a window")
        kwargs["kinds"] = {SLIDING_ATTENTION: LayerKind(window=int(window))}
    return kwargs


def hf_config(model: Any) -> dict[str, Any]:
    """config.json for a model with GPT-OSS's attention (sinks, one window) and mixture in every layer."""
    llama.check_common(model, MODEL_TYPE, mixture=True)
    if not model.attention_sinks:
        raise ValueError("attention_sinks=False cannot be exported as gpt_oss, whose attention has sinks")
    if model.qk_norm:
        raise ValueError("qk_norm=True cannot be exported as gpt_oss (GPT-OSS has no q/k norm)")
    if model.qkv_bias and not model.attention_bias:
        raise ValueError("qkv_bias=True (no bias on o) cannot be exported as gpt_oss: its attention_bias covers q, k, v and o")
    mixture = dict(model.mixture or {})
    if not mixture or set(model.mlp_plan) != {"mixture"}:
        raise ValueError(
            f"mlp layers {list(model.mlp_plan)} cannot be exported as gpt_oss, whose every layer is a mixture of experts"
        )
    layer = Mixture(**mixture, parent=None)
    different = {name: getattr(layer, name) for name, value in MIXTURE_SETTINGS.items()
                 if getattr(layer, name) != value}
    if different:
        raise ValueError(
            f"mixture settings {different} cannot be exported as gpt_oss, whose experts are {MIXTURE_SETTINGS}"
        )
    windows = llama.windows(model)
    if len(windows) > 1:
        raise ValueError(f"sliding windows {sorted(windows)} cannot be exported as gpt_oss, whose layers share one")
    config = llama.decoder_config(model, MODEL_TYPE, ARCHITECTURE)
    rope = llama.export_rope_scaling(model) or {"rope_type": "default"}
    del config["rope_scaling"]  # GptOssConfig reads rope_parameters, and fills in YaRN when it is absent
    config.update(
        rope_parameters={**rope, "rope_theta": model.rope_theta},
        intermediate_size=mixture["expert_features"],
        layer_types=[SLIDING_ATTENTION if kind.window is not None else FULL_ATTENTION for kind in model.layer_plan],
        sliding_window=windows.pop() if windows else None,
        num_local_experts=mixture["num_experts"],
        num_experts_per_tok=mixture["top_k"],
        swiglu_alpha=layer.swiglu_alpha,
        swiglu_limit=layer.swiglu_limit,
        output_router_logits=False,
        router_aux_loss_coef=0.001,
    )
    return config
