"""Mistral (MistralForCausalLM): the Llama block, no biases, and an optional sliding window.

With ``sliding_window`` set (Mistral 7B v0.1 used 4096), every layer attends to the last
``sliding_window`` tokens; v0.2 and later set it to null. Read for loading and for writing a loaded
Mistral checkpoint back; a model trained from scratch exports as llama or qwen3.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dew.interop.families import llama
from dew.interop.families.llama import Weight
from dew.nn.backbones.layer_plan import SLIDING_ATTENTION, LayerKind

MODEL_TYPE = "mistral"
ARCHITECTURE = "MistralForCausalLM"

WEIGHTS: tuple[Weight, ...] = llama.WEIGHTS
IGNORED_SUFFIXES = llama.IGNORED_SUFFIXES


def model_kwargs(config: Mapping[str, Any]) -> dict[str, Any]:
    """CausalTransformer arguments for a Mistral config.json."""
    kwargs = llama.decoder_kwargs(config)
    kwargs.update(attention_bias=False, mlp_bias=False)  # Mistral's linears have no bias
    window = config.get("sliding_window")
    if window:
        kwargs.update(layer_types=(SLIDING_ATTENTION,) * kwargs["num_layers"],
                      kinds={SLIDING_ATTENTION: LayerKind(window=int(window))})
    return kwargs


def hf_config(model: Any) -> dict[str, Any]:
    """config.json for a Llama-block model without biases whose layers share one window (or none)."""
    llama.check_common(model, MODEL_TYPE)
    for name in ("qk_norm", "attention_bias", "mlp_bias"):
        if getattr(model, name):
            raise ValueError(f"{name}=True cannot be exported as mistral, which has no such weights")
    plan = model.layer_plan
    windows = {kind.window for kind in plan}
    if len(windows) > 1:
        raise ValueError(
            f"a mix of full and sliding-window layers ({list(model.layer_types)}) cannot be exported "
            "as mistral, whose layers all share one sliding_window"
        )
    config = llama.decoder_config(model, MODEL_TYPE, ARCHITECTURE)
    del config["attention_bias"]
    config["sliding_window"] = plan[0].window
    return config
