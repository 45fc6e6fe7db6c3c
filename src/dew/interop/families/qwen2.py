"""Qwen2 (Qwen2ForCausalLM): the Llama block with biases on the query, key and value projections.

Qwen2 (and Qwen2.5, which shares the model type) puts a bias on q, k and v but none on o or the
MLP, and has no q/k norm. Its sliding-window fields read as Qwen3's do (`qwen3.layer_settings`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dew.interop.families import llama, qwen3
from dew.interop.families.llama import Weight

MODEL_TYPE = "qwen2"
ARCHITECTURE = "Qwen2ForCausalLM"

WEIGHTS: tuple[Weight, ...] = llama.WEIGHTS
IGNORED_SUFFIXES = llama.IGNORED_SUFFIXES


def model_kwargs(config: Mapping[str, Any]) -> dict[str, Any]:
    """CausalTransformer arguments for a Qwen2 config.json."""
    kwargs = llama.decoder_kwargs(config)
    kwargs.update(attention_bias=False, qkv_bias=True, mlp_bias=False, **qwen3.layer_settings(config))
    return kwargs


def hf_config(model: Any) -> dict[str, Any]:
    """config.json for a Llama-block model with q/k/v biases only (at most one sliding-window size)."""
    llama.check_common(model, MODEL_TYPE, qkv_bias=True)
    if not model.qkv_bias or model.attention_bias:
        raise ValueError(
            f"qkv_bias={model.qkv_bias}, attention_bias={model.attention_bias} cannot be exported as qwen2, "
            "whose q, k and v projections have a bias and whose o projection has none "
            "(qkv_bias=True, attention_bias=False)"
        )
    for name in ("qk_norm", "mlp_bias"):
        if getattr(model, name):
            raise ValueError(f"{name}=True cannot be exported as qwen2, which has no such weights")
    if len(llama.windows(model)) > 1:
        raise ValueError(
            f"layers with different sliding windows {sorted(llama.windows(model))} cannot be exported as "
            "qwen2, which has one sliding_window for all sliding layers"
        )
    config = llama.decoder_config(model, MODEL_TYPE, ARCHITECTURE)
    del config["attention_bias"], config["head_dim"]  # Qwen2 has neither field: head_dim is hidden / heads
    if model.head_features * model.num_heads != model.emb_features:
        raise ValueError(
            f"head_dim={model.head_features} with {model.num_heads} heads cannot be exported as qwen2, "
            f"whose heads split the hidden size ({model.emb_features}) evenly"
        )
    config.update(qwen3.window_config(model))
    return config
