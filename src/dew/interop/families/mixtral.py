"""Mixtral (MixtralForCausalLM): the Mistral block with a mixture of SwiGLU experts in every layer.

Each layer's feed-forward routes a token to ``num_experts_per_tok`` of ``num_local_experts``
experts by a softmax router and always renormalizes the chosen scores to sum to one
(`dew.nn.moe.Mixture` with ``normalize_top_k=True``). An expert's ``w1``, ``w3`` and ``w2`` are
its gate, up and down projections, ``intermediate_size`` wide; the checkpoint stores one tensor
per expert under ``block_sparse_moe``. Attention has no biases and may slide as Mistral's does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dew.interop.families import llama, mistral
from dew.interop.families.llama import Weight
from dew.nn.moe import Mixture

MODEL_TYPE = "mixtral"
ARCHITECTURE = "MixtralForCausalLM"


def _expert(hf: str, dew: str) -> Weight:
    return Weight(f"model.layers.{{i}}.block_sparse_moe.experts.{{e}}.{hf}.weight",
                  f"layers_{{i}}/mlp/experts/{dew}", True)


WEIGHTS: tuple[Weight, ...] = tuple(w for w in llama.WEIGHTS if ".mlp." not in w.hf) + (
    Weight("model.layers.{i}.block_sparse_moe.gate.weight", "layers_{i}/mlp/gate", True),
    _expert("w1", "gate_proj"),
    _expert("w3", "up_proj"),
    _expert("w2", "down_proj"),
)
EXPERT_PARAMETERS = llama.STACKED_EXPERTS  # adapters reach the experts through these
IGNORED_SUFFIXES = llama.IGNORED_SUFFIXES


def model_kwargs(config: Mapping[str, Any]) -> dict[str, Any]:
    """CausalTransformer arguments for a Mixtral config.json."""
    jitter = config.get("router_jitter_noise") or 0.0
    if jitter:
        raise ValueError(
            f"config.json sets router_jitter_noise={jitter}; Dew's router adds no noise "
            "(router_jitter_noise=0.0, as the released Mixtral checkpoints set it)"
        )
    kwargs = mistral.model_kwargs(config)
    experts = int(llama.require(config, "num_local_experts"))
    kwargs["mixture"] = dict(
        num_experts=experts,
        top_k=int(llama.require(config, "num_experts_per_tok")),
        expert_features=kwargs["mlp_features"],
        normalize_top_k=True,
    )
    return kwargs


def hf_config(model: Any) -> dict[str, Any]:
    """config.json for a Mistral-block model whose every layer is a renormalized softmax mixture."""
    llama.check_common(model, MODEL_TYPE, mixture=True)
    mixture = dict(model.mixture or {})
    if not mixture or set(model.mlp_plan) != {"mixture"}:
        raise ValueError(
            f"mlp layers {list(model.mlp_plan)} cannot be exported as mixtral, whose every layer is a "
            "mixture of experts"
        )
    layer = Mixture(**mixture, parent=None)
    wanted = dict(score="softmax", normalize_top_k=True, routed_scale=1.0, shared_expert_features=None)
    different = {name: getattr(layer, name) for name, value in wanted.items() if getattr(layer, name) != value}
    if different:
        raise ValueError(
            f"mixture settings {different} cannot be exported as mixtral, which renormalizes the top-k "
            "softmax scores, scales them by 1 and has no shared expert"
        )
    dense = mistral.hf_config(model.clone(mixture=None, mlp_layer_types=None, first_k_dense=0))
    config = {**dense, "model_type": MODEL_TYPE, "architectures": [ARCHITECTURE]}
    config.update(
        intermediate_size=mixture["expert_features"],
        num_local_experts=mixture["num_experts"],
        num_experts_per_tok=mixture["top_k"],
        router_jitter_noise=0.0,
        output_router_logits=False,
        router_aux_loss_coef=0.001,
    )
    return config
