"""Qwen3-MoE (Qwen3MoeForCausalLM): the Qwen3 block with mixture-of-experts feed-forwards.

A layer's feed-forward is a mixture of ``num_experts`` SwiGLU experts (``moe_intermediate_size``
wide, ``num_experts_per_tok`` chosen by a softmax router, their scores renormalized when
``norm_topk_prob``) unless the layer is listed in ``mlp_only_layers`` or falls between the
``decoder_sparse_step``-th layers; those have a dense MLP ``intermediate_size`` wide. The
checkpoint stores the router as ``mlp.gate`` and one tensor per expert under ``mlp.experts``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dew.interop.families import llama, qwen3
from dew.interop.families.llama import Weight
from dew.nn.backbones.layer_plan import DENSE_MLP, MIXTURE_MLP, SLIDING_ATTENTION, LayerKind
from dew.nn.moe import Mixture

MODEL_TYPE = "qwen3_moe"
ARCHITECTURE = "Qwen3MoeForCausalLM"


def _expert(name: str) -> Weight:
    return Weight(f"model.layers.{{i}}.mlp.experts.{{e}}.{name}.weight", f"layers_{{i}}/mlp/experts/{name}", True)


WEIGHTS: tuple[Weight, ...] = qwen3.WEIGHTS + (
    Weight("model.layers.{i}.mlp.gate.weight", "layers_{i}/mlp/gate", True),
    _expert("gate_proj"),
    _expert("up_proj"),
    _expert("down_proj"),
)
EXPERT_PARAMETERS = llama.STACKED_EXPERTS  # adapters reach the experts through these
IGNORED_SUFFIXES = llama.IGNORED_SUFFIXES


def mlp_layer_types(config: Mapping[str, Any], layers: int) -> tuple[str, ...]:
    """Each layer's feed-forward by transformers' rule: a mixture unless listed in
    ``mlp_only_layers`` or off the ``decoder_sparse_step`` grid."""
    experts = int(config.get("num_experts", config.get("num_local_experts")) or 0)
    step = int(config.get("decoder_sparse_step") or 1)
    dense_only = set(config.get("mlp_only_layers") or ())
    return tuple(
        MIXTURE_MLP if i not in dense_only and experts > 0 and (i + 1) % step == 0 else DENSE_MLP
        for i in range(layers)
    )


def model_kwargs(config: Mapping[str, Any]) -> dict[str, Any]:
    """CausalTransformer arguments for a Qwen3-MoE config.json."""
    kwargs = llama.decoder_kwargs(config)
    kwargs.update(qk_norm=True, mlp_bias=False)
    window = config.get("sliding_window")
    if config.get("use_sliding_window", False) and window:  # then every layer slides
        kwargs.update(layer_types=(SLIDING_ATTENTION,) * kwargs["num_layers"],
                      kinds={SLIDING_ATTENTION: LayerKind(window=int(window))})
    types = mlp_layer_types(config, kwargs["num_layers"])
    if MIXTURE_MLP in types:
        kwargs["mixture"] = dict(
            num_experts=int(config.get("num_experts", config.get("num_local_experts"))),
            top_k=int(llama.require(config, "num_experts_per_tok")),
            expert_features=int(llama.require(config, "moe_intermediate_size")),
            normalize_top_k=bool(config.get("norm_topk_prob", False)),
        )
        kwargs["mlp_layer_types"] = types
    return kwargs


def hf_config(model: Any) -> dict[str, Any]:
    """config.json for a Qwen3-block model with softmax-routed mixture layers (and dense ones)."""
    llama.check_common(model, MODEL_TYPE, mixture=True)
    mixture = dict(model.mixture or {})
    if not mixture:
        raise ValueError("a model without mixture layers (mixture=None) exports as qwen3, not qwen3_moe")
    layer = Mixture(**mixture, parent=None)
    wanted = dict(score="softmax", routed_scale=1.0, shared_expert_features=None)
    different = {name: getattr(layer, name) for name, value in wanted.items() if getattr(layer, name) != value}
    if different:
        raise ValueError(
            f"mixture settings {different} cannot be exported as qwen3_moe, whose router scores by "
            "softmax, scales by 1 and has no shared expert"
        )
    if model.mlp_bias:
        raise ValueError("mlp_bias=True cannot be exported as qwen3_moe (its MLPs have no bias)")
    windows = {kind.window for kind in model.layer_plan}
    if len(windows) > 1:
        raise ValueError(
            f"a mix of full and sliding-window layers ({list(model.layer_types)}) cannot be exported as "
            "qwen3_moe, whose layers all share one sliding_window"
        )
    dense = qwen3.hf_config(model.clone(mixture=None, mlp_layer_types=None, first_k_dense=0))
    window = windows.pop()
    config = {**dense, "model_type": MODEL_TYPE, "architectures": [ARCHITECTURE]}
    for key in ("layer_types", "max_window_layers"):
        config.pop(key)
    config.update(
        use_sliding_window=window is not None,
        sliding_window=window,
        num_experts=mixture["num_experts"],
        num_experts_per_tok=mixture["top_k"],
        moe_intermediate_size=mixture["expert_features"],
        norm_topk_prob=layer.normalize_top_k,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i, kind in enumerate(model.mlp_plan) if kind == DENSE_MLP],
        output_router_logits=False,
        router_aux_loss_coef=0.001,
    )
    return config
