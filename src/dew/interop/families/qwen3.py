"""Qwen3 (Qwen3ForCausalLM): config translation and weight-name table.

Qwen3 is the Llama block plus an RMSNorm over each query and key head before RoPE (``q_norm``,
``k_norm``, one ``[head_dim]`` scale shared by all heads). Its MLP has no bias. Layers may use a
sliding window: with ``use_sliding_window``, the layers ``layer_types`` marks "sliding_attention"
(or, in configs without ``layer_types``, those from ``max_window_layers`` on) attend to the last
``sliding_window`` tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dew.interop.families import llama
from dew.interop.families.llama import Weight
from dew.nn.backbones.layer_plan import FULL_ATTENTION, SLIDING_ATTENTION, LayerKind

MODEL_TYPE = "qwen3"
ARCHITECTURE = "Qwen3ForCausalLM"

WEIGHTS: tuple[Weight, ...] = llama.WEIGHTS + (
    Weight("model.layers.{i}.self_attn.q_norm.weight", "layers_{i}/self_attn/q_norm/scale"),
    Weight("model.layers.{i}.self_attn.k_norm.weight", "layers_{i}/self_attn/k_norm/scale"),
)
IGNORED_SUFFIXES = llama.IGNORED_SUFFIXES


def layer_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """``layer_types`` and ``kinds`` for the config's sliding-window layers (empty: none)."""
    window = config.get("sliding_window")
    if not config.get("use_sliding_window", False) or not window:
        return {}  # transformers turns the window off: every layer attends to everything
    layers = int(llama.require(config, "num_hidden_layers"))
    types = config.get("layer_types")
    if types is None:  # the older rule: layers from max_window_layers on slide
        first = int(config.get("max_window_layers", layers))
        types = [SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(layers)]
    unknown = sorted(set(types) - {FULL_ATTENTION, SLIDING_ATTENTION})
    if unknown:
        raise ValueError(
            f"config.json layer_types holds {unknown}; qwen3 layers are 'full_attention' or "
            "'sliding_attention'"
        )
    if SLIDING_ATTENTION not in types:
        return {}
    return dict(layer_types=tuple(types), kinds={SLIDING_ATTENTION: LayerKind(window=int(window))})


def model_kwargs(config: Mapping[str, Any]) -> dict[str, Any]:
    """CausalTransformer arguments for a Qwen3 config.json."""
    kwargs = llama.decoder_kwargs(config)
    kwargs.update(qk_norm=True, mlp_bias=False, **layer_settings(config))
    return kwargs


def hf_config(model: Any) -> dict[str, Any]:
    """config.json for a CausalTransformer with q/k norm (at most one sliding-window size)."""
    llama.check_common(model, MODEL_TYPE)
    if not model.qk_norm:
        raise ValueError("qk_norm=False cannot be exported as qwen3 (Qwen3 always normalizes q and k)")
    if model.mlp_bias:
        raise ValueError("mlp_bias=True cannot be exported as qwen3 (Qwen3's MLP has no bias)")
    windows = llama.windows(model)
    if len(windows) > 1:
        raise ValueError(
            f"layers with different sliding windows {sorted(windows)} cannot be exported as qwen3, "
            "which has one sliding_window for all sliding layers"
        )
    config = llama.decoder_config(model, MODEL_TYPE, ARCHITECTURE)
    config.update(window_config(model))
    return config


def window_config(model: Any) -> dict[str, Any]:
    """The sliding-window fields of a Qwen config.json (Qwen2 and Qwen3 read them alike)."""
    windows = llama.windows(model)
    types = [SLIDING_ATTENTION if kind.window is not None else FULL_ATTENTION for kind in model.layer_plan]
    sliding = [i for i, name in enumerate(types) if name == SLIDING_ATTENTION]
    return dict(
        use_sliding_window=bool(sliding),
        sliding_window=windows.pop() if sliding else None,
        # transformers older than layer_types slid the layers from max_window_layers on
        max_window_layers=sliding[0] if sliding else model.num_layers,
        layer_types=types,
    )
