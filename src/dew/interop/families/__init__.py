"""The Hugging Face model families Dew reads and writes, keyed by config.json's ``model_type``.

Each family module holds a config translation (``model_kwargs(config)`` from config.json to
`CausalTransformer` arguments, ``hf_config(model)`` back, raising on settings the family cannot
express) and a weight-name table (``WEIGHTS``).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from dew.interop.families import deepseek_v3, gpt_oss, llama, mistral, mixtral, qwen2, qwen3, qwen3_moe

DECODER_FAMILIES: dict[str, ModuleType] = {
    llama.MODEL_TYPE: llama,
    qwen3.MODEL_TYPE: qwen3,
    mistral.MODEL_TYPE: mistral,
    qwen2.MODEL_TYPE: qwen2,
    mixtral.MODEL_TYPE: mixtral,
    qwen3_moe.MODEL_TYPE: qwen3_moe,
    deepseek_v3.MODEL_TYPE: deepseek_v3,
    gpt_oss.MODEL_TYPE: gpt_oss,
}


def supported_model_types() -> list[str]:
    return sorted(DECODER_FAMILIES)


def decoder_family(config: dict[str, Any], where: str = "config.json") -> ModuleType:
    """The family module for a config.json, or a ValueError listing the supported model types.

    Remote code (``auto_map`` / ``trust_remote_code``) is never run: only the model types
    implemented here load.
    """
    model_type = config.get("model_type")
    if model_type in DECODER_FAMILIES:
        return DECODER_FAMILIES[model_type]
    remote = ""
    if config.get("auto_map"):
        remote = (
            f" The config names remote code ({sorted(config['auto_map'])} in auto_map); Dew never "
            "imports or runs code from a checkpoint, so only natively implemented model types load."
        )
    raise ValueError(
        f"{where} has model_type={model_type!r}, which Dew cannot load as a decoder; supported "
        f"model types: {supported_model_types()}.{remote}"
    )


def export_family(model: Any, preferred: str | None = None) -> ModuleType:
    """The family a CausalTransformer is written as.

    ``preferred`` (the model type the weights were loaded from) wins when it can express the model;
    otherwise a model with latent attention is deepseek_v3, one with attention sinks is gpt_oss,
    one with mixture layers is qwen3_moe (with q/k norm) or mixtral (without), one with q/k/v-only
    biases is qwen2, and a dense one is qwen3 (with q/k norm) or llama.
    """
    if preferred in DECODER_FAMILIES:
        try:
            DECODER_FAMILIES[preferred].hf_config(model)
            return DECODER_FAMILIES[preferred]
        except ValueError:
            pass
    if model.latent_attention is not None:
        family = deepseek_v3
    elif model.attention_sinks:
        family = gpt_oss
    elif model.mixture is not None:
        family = qwen3_moe if model.qk_norm else mixtral
    elif model.qkv_bias and not model.attention_bias:
        family = qwen2
    else:
        family = qwen3 if model.qk_norm else llama
    family.hf_config(model)  # raises, naming the setting, when even this family cannot express it
    return family
