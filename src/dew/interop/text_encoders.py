"""transformers text-encoder directories in and out: CLIP's text tower and T5's encoder.

`PretrainedTextEncoder.load(directory)` reads config.json and dispatches on ``model_type``:
``clip_text_model`` (CLIPTextModel, CLIPTextModelWithProjection; the projection loads when the
checkpoint has ``text_projection.weight``), ``clip`` (the text half of a CLIPModel) and ``t5``
(T5EncoderModel, or the encoder of a T5ForConditionalGeneration). The directory's tokenizer.json
becomes a `CaptionTokens` at the encoder's context length. `save(directory)` writes
config.json, model.safetensors and the tokenizer back in transformers' layout.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from dew.data.caption_tokens import CaptionTokens
from dew.files import staged_directory
from dew.hub import local_directory
from dew.interop.safetensors_io import SINGLE_FILE, open_checkpoint, save_file
from dew.interop.weight_map import expected_params, read_params, torch_tensors
from dew.nn.text_encoders.clip import CLIPTextEncoder
from dew.nn.text_encoders.t5 import T5Encoder

CONFIG_FILE = "config.json"
MODEL_TYPES = ("clip_text_model", "clip", "t5")


# --- CLIP -----------------------------------------------------------------------------------------


# transformers' CLIPTextConfig defaults, for the keys a config.json may leave out
CLIP_DEFAULTS = dict(vocab_size=49408, hidden_size=512, intermediate_size=2048, projection_dim=512,
                     num_hidden_layers=12, num_attention_heads=8, max_position_embeddings=77,
                     hidden_act="quick_gelu", layer_norm_eps=1e-5, eos_token_id=49407)


def clip_kwargs(config: Mapping[str, Any], has_projection: bool) -> dict[str, Any]:
    """CLIPTextEncoder arguments from a CLIPTextConfig (or a CLIPConfig's text_config)."""
    text = (config.get("text_config") or {}) if config.get("model_type") == "clip" else config
    text = {**CLIP_DEFAULTS, **{key: value for key, value in text.items() if value is not None}}
    eos = text["eos_token_id"]
    kwargs = dict(
        vocab_size=text["vocab_size"], hidden_size=text["hidden_size"],
        intermediate_size=text["intermediate_size"], num_layers=text["num_hidden_layers"],
        num_heads=text["num_attention_heads"], max_position_embeddings=text["max_position_embeddings"],
        hidden_act=text["hidden_act"], layer_norm_eps=text["layer_norm_eps"],
        eos_token_id=int(eos[0] if isinstance(eos, list) else eos),
    )
    if has_projection:
        kwargs["projection_dim"] = config.get("projection_dim") or text["projection_dim"]
    return kwargs


def clip_config(model: CLIPTextEncoder, tokenizer: CaptionTokens | None) -> dict[str, Any]:
    config = {
        "model_type": "clip_text_model",
        "architectures": ["CLIPTextModelWithProjection" if model.projection_dim else "CLIPTextModel"],
        "vocab_size": model.vocab_size, "hidden_size": model.hidden_size,
        "intermediate_size": model.intermediate_size, "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads, "max_position_embeddings": model.max_position_embeddings,
        "hidden_act": model.hidden_act, "layer_norm_eps": model.layer_norm_eps,
        "eos_token_id": model.eos_token_id,
    }
    if model.projection_dim:
        config["projection_dim"] = model.projection_dim
    if tokenizer is not None:
        config["pad_token_id"] = tokenizer.tokenizer.pad_id
        if tokenizer.tokenizer.bos_id is not None:
            config["bos_token_id"] = tokenizer.tokenizer.bos_id
    return config


def clip_name(path: tuple[str, ...]) -> str:
    """``layers_3/self_attn/q_proj/kernel`` -> ``text_model.encoder.layers.3.self_attn.q_proj.weight``."""
    if path[0] == "text_projection":
        return "text_projection.weight"
    head, *rest = "/".join(path).split("/")
    if head in ("token_embedding", "position_embedding"):
        head = f"embeddings.{head}"
    head = re.sub(r"^layers_(\d+)$", r"encoder.layers.\1", head)
    leaf = {"kernel": "weight", "scale": "weight", "embedding": "weight"}.get(rest[-1], rest[-1])
    return ".".join(["text_model", head, *rest[:-1], leaf])


def _clip_ignored(name: str) -> bool:
    """A CLIPModel's image tower, and the position-id buffer older transformers versions saved."""
    return name.startswith(("vision_model.", "visual_projection.", "logit_scale")) or name.endswith(".position_ids")


# --- T5 -------------------------------------------------------------------------------------------


# transformers' T5Config defaults, for the keys a config.json may leave out
T5_DEFAULTS = dict(vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8,
                   relative_attention_num_buckets=32, relative_attention_max_distance=128,
                   layer_norm_epsilon=1e-6, feed_forward_proj="relu")


def t5_kwargs(config: Mapping[str, Any]) -> dict[str, Any]:
    """T5Encoder arguments from a T5Config (``feed_forward_proj``: "relu", "gated-gelu", ...)."""
    config = {**T5_DEFAULTS, **{key: value for key, value in config.items() if value is not None}}
    projection = config["feed_forward_proj"]
    gated = projection.startswith("gated-")
    act = projection.split("-")[-1]
    if projection == "gated-gelu":  # transformers reads this one as the tanh GELU
        act = "gelu_new"
    return dict(act=act, gated=gated, **{key: config[key] for key in T5_DEFAULTS if key != "feed_forward_proj"})


def t5_config(model: T5Encoder, tokenizer: CaptionTokens | None) -> dict[str, Any]:
    if model.gated and model.act == "gelu":
        raise ValueError(
            "transformers reads feed_forward_proj='gated-gelu' as the tanh GELU, so a T5Encoder with "
            "gated=True, act='gelu' (exact) cannot be saved in its layout; use act='gelu_new'"
        )
    if model.gated and model.act == "gelu_new":
        projection = "gated-gelu"
    elif model.gated:
        projection = f"gated-{model.act}"
    else:
        projection = model.act
    config = {
        "model_type": "t5", "architectures": ["T5EncoderModel"], "vocab_size": model.vocab_size,
        "d_model": model.d_model, "d_kv": model.d_kv, "num_heads": model.num_heads, "d_ff": model.d_ff,
        "num_layers": model.num_layers, "relative_attention_num_buckets": model.relative_attention_num_buckets,
        "relative_attention_max_distance": model.relative_attention_max_distance,
        "layer_norm_epsilon": model.layer_norm_epsilon, "feed_forward_proj": projection,
        "is_encoder_decoder": False, "use_cache": False,
    }
    if tokenizer is not None:
        config["pad_token_id"] = tokenizer.tokenizer.pad_id
        config["eos_token_id"] = tokenizer.tokenizer.eos_id
    return config


_T5_PARTS = {"attention": "layer.0.SelfAttention", "attention_norm": "layer.0.layer_norm",
             "ff": "layer.1.DenseReluDense", "ff_norm": "layer.1.layer_norm"}


def t5_name(path: tuple[str, ...]) -> str:
    """``block_1/ff/wi_0/kernel`` -> ``encoder.block.1.layer.1.DenseReluDense.wi_0.weight``."""
    if path[0] == "shared":
        return "shared.weight"
    if path[0] == "relative_attention_bias":
        return "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    if path[0] == "final_layer_norm":
        return "encoder.final_layer_norm.weight"
    block, part = path[0].split("/") if "/" in path[0] else (path[0], path[1])
    rest = path[1:] if "/" in path[0] else path[2:]
    index = block.removeprefix("block_")
    return ".".join(["encoder.block", index, _T5_PARTS[part], *rest[:-1], "weight"])


def _t5_ignored(name: str) -> bool:
    """A T5ForConditionalGeneration's decoder and head, and the encoder's copy of the tied embedding."""
    return name.startswith(("decoder.", "lm_head.")) or name == "encoder.embed_tokens.weight"


# --- the bundle -----------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=0)
def _apply(model: Any, variables: Any, ids: jax.Array, mask: jax.Array | None) -> Any:
    return model.apply(variables, ids, mask)


EXAMPLE_IDS = (1, 2)  # the shape of the token ids the params are traced with


@dataclasses.dataclass(frozen=True, eq=False)
class PretrainedTextEncoder:
    """A text encoder (`CLIPTextEncoder` or `T5Encoder`), its weights and its caption tokenizer.

    Attributes:
      model: the Flax module.
      variables: ``{"params": ...}``.
      tokens: a `CaptionTokens` (captions -> ids and mask), or None when the directory has no
        tokenizer.json.
      config: the transformers config.json as a dict.
    """

    model: CLIPTextEncoder | T5Encoder
    variables: Mapping[str, Any]
    tokens: CaptionTokens | None = None
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def load(cls, directory: str | Path, *, max_length: int | None = None, truncate: bool = True,
             dtype: Any = jnp.float32, param_dtype: Any = jnp.float32,
             revision: str | None = None) -> "PretrainedTextEncoder":
        """Read a transformers CLIP or T5 directory (or a Hub id's snapshot in the local cache).

        ``max_length`` is the caption length in tokens: CLIP's context by default; T5 takes the
        tokenizer's ``model_max_length`` unless given (SD3 uses 256, Flux 512).
        """
        path = local_directory(directory, revision=revision, what="text encoder")
        config_path = path / CONFIG_FILE
        if not config_path.is_file():
            present = sorted(p.name for p in path.iterdir())[:12]
            raise FileNotFoundError(
                f"no {CONFIG_FILE} in {path}; a transformers text-encoder directory holds it beside "
                f"{SINGLE_FILE}. For a diffusers pipeline point at its text_encoder/ folder. It holds {present}"
            )
        config = json.loads(config_path.read_text())
        model_type = config.get("model_type")
        checkpoint = open_checkpoint(path)
        if model_type in ("clip_text_model", "clip"):
            model = CLIPTextEncoder(**clip_kwargs(config, "text_projection.weight" in checkpoint),
                                    dtype=dtype, param_dtype=param_dtype)
            name, ignored = clip_name, _clip_ignored
            if "embeddings.token_embedding.weight" in checkpoint:  # transformers 5 saves CLIPTextModel unprefixed
                checkpoint = {n if n.startswith("text_projection") else f"text_model.{n}": checkpoint[n]
                              for n in checkpoint}
        elif model_type == "t5":
            model = T5Encoder(**t5_kwargs(config), dtype=dtype, param_dtype=param_dtype)
            name, ignored = t5_name, _t5_ignored
            if "shared.weight" not in checkpoint and "encoder.embed_tokens.weight" in checkpoint:
                checkpoint = {n: checkpoint[n] for n in checkpoint}
                checkpoint["shared.weight"] = checkpoint.pop("encoder.embed_tokens.weight")
        else:
            raise ValueError(
                f"{config_path} has model_type={model_type!r}; Dew's text encoders load {list(MODEL_TYPES)} "
                "(CLIPTextModel / CLIPTextModelWithProjection / CLIPModel, T5EncoderModel)"
            )
        params = read_params(checkpoint, expected_params(model, jnp.zeros(EXAMPLE_IDS, jnp.int32)), name,
                             where=str(path), param_dtype=param_dtype, ignored=ignored)
        tokens = None
        if (path / "tokenizer.json").is_file():
            length = max_length or _default_length(model, path)
            tokens = CaptionTokens(path, length, truncate=truncate)
        return cls(model=model, variables={"params": params}, tokens=tokens, config=config)

    def __call__(self, texts: Sequence[str], *, masked: bool = False) -> Any:
        """Encode captions: a `CLIPTextOutput` for CLIP, the last states [B, L, D] for T5.

        ``masked`` passes the padding mask to attention (SD and Flux pipelines do not).
        """
        if self.tokens is None:
            raise ValueError("this encoder was loaded without a tokenizer.json; call the model on token ids instead")
        ids, mask = self.tokens(texts)
        return _apply(self.model, self.variables, jnp.asarray(ids), jnp.asarray(mask) if masked else None)

    def save(self, directory: str | Path, *, overwrite: bool = False, dtype: Any = None) -> Path:
        """Write config.json, model.safetensors and the tokenizer files (``dtype`` casts the weights)."""
        if isinstance(self.model, CLIPTextEncoder):
            config, name = clip_config(self.model, self.tokens), clip_name
        else:
            config, name = t5_config(self.model, self.tokens), t5_name
        tensors = torch_tensors(self.variables["params"], expected_params(self.model, jnp.zeros(EXAMPLE_IDS, jnp.int32)),
                                name, dtype=dtype)
        with staged_directory(Path(directory).expanduser(), overwrite=overwrite) as staging:
            (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
            save_file(tensors, staging / SINGLE_FILE, metadata={"format": "pt"})
            if self.tokens is not None:
                self.tokens.tokenizer.save(staging)
        return Path(directory).expanduser()


def _default_length(model: Any, path: Path) -> int:
    if isinstance(model, CLIPTextEncoder):
        return model.max_position_embeddings
    settings = json.loads((path / "tokenizer_config.json").read_text()) if (path / "tokenizer_config.json").is_file() else {}
    length = settings.get("model_max_length")
    if not isinstance(length, int) or length > 4096:
        raise ValueError(
            f"{path} sets no usable model_max_length for its T5 tokenizer (got {length!r}); pass "
            "max_length= (SD3 encodes 256 tokens, Flux 512)"
        )
    return length
