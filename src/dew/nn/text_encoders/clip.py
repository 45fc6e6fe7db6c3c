"""CLIP's text tower (Radford et al. 2021): the prompt encoder of SD 1.x / 2.x, SDXL and Flux.

    x = token_embedding[ids] + position_embedding[0..L)
    num_layers x pre-norm causal blocks:
        x = x + out_proj(attention(LN1(x)))          causal, plus the padding mask when given
        x = x + fc2(act(fc1(LN2(x))))                act: quick_gelu (OpenAI) or gelu (OpenCLIP)
    last = final_layer_norm(x)
    pooled = last at the end-of-text token; projected = text_projection(pooled) (no bias)

`penultimate` is the output of the second-to-last block, before the final norm (transformers'
``hidden_states[-2]``, what SDXL and SD 2.x condition on). The pooled row follows transformers:
with the legacy ``eos_token_id == 2`` it sits at the highest id of each row (the end-of-text id
is the largest in CLIP's vocabulary), otherwise at the first position holding ``eos_token_id``.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from dew.nn.attention import dot_product_attention
from dew.nn.embeddings import dense
from dew.nn.text_encoders.activations import activation

LEGACY_EOS_ID = 2  # configs written before transformers #24773 say 2; pooling then takes the argmax id


@flax.struct.dataclass
class CLIPTextOutput:
    """What `CLIPTextEncoder` returns, each with the batch axis first.

    last: [B, L, D] final-normed states. penultimate: [B, L, D] the second-to-last block's output.
    pooled: [B, D] the final state at the end-of-text token. projected: [B, projection_dim], or
    None for a model without a projection.
    """

    last: jax.Array
    penultimate: jax.Array
    pooled: jax.Array
    projected: jax.Array | None = None


def layer_norm(eps: float, name: str, *, dtype: Any, param_dtype: Any) -> nn.LayerNorm:
    return nn.LayerNorm(
        epsilon=eps, dtype=dtype, param_dtype=param_dtype, use_fast_variance=False,
        scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("norm",)),
        name=name,
    )


class CLIPAttention(nn.Module):
    """Multi-head self-attention with separate q/k/v/out projections (all with bias); causal in the
    text tower, over every patch in the image tower."""

    num_heads: int
    causal: bool = True
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array | None) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        batch, length, features = x.shape
        head_dim = features // self.num_heads

        def heads(name):
            return dense(features, ("embed", "heads"), name, **kw)(x).reshape(batch, length, self.num_heads, head_dim)

        out = dot_product_attention(heads("q_proj"), heads("k_proj"), heads("v_proj"), causal=self.causal, mask=mask)
        return dense(features, ("heads", "embed"), "out_proj", **kw)(out.reshape(batch, length, features))


class CLIPEncoderLayer(nn.Module):
    """x + attention(LN1(x)), then x + MLP(LN2(x)); shared by the text and image towers."""

    num_heads: int
    intermediate_size: int
    hidden_act: str
    layer_norm_eps: float
    causal: bool = True
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array | None) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        act = activation(self.hidden_act, "CLIP")
        x = x + CLIPAttention(self.num_heads, self.causal, name="self_attn", **kw)(layer_norm(self.layer_norm_eps, "layer_norm1", **kw)(x), mask)
        h = layer_norm(self.layer_norm_eps, "layer_norm2", **kw)(x)
        h = dense(self.intermediate_size, ("embed", "mlp"), "mlp/fc1", **kw)(h)
        return x + dense(x.shape[-1], ("mlp", "embed"), "mlp/fc2", **kw)(act(h))


class CLIPTextEncoder(nn.Module):
    """CLIPTextModel, or CLIPTextModelWithProjection when ``projection_dim`` is set.

    Defaults are OpenAI's ViT-L/14 text tower (SD 1.x). Called on token ids [B, L] (L at most
    ``max_position_embeddings``) and an optional attention mask [B, L] (1 = token, 0 = padding;
    SD pipelines pass none), it returns a `CLIPTextOutput`.
    """

    vocab_size: int = 49408
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_layers: int = 12
    num_heads: int = 12
    max_position_embeddings: int = 77
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    eos_token_id: int = 49407
    projection_dim: int | None = None
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def _check(self, ids: jax.Array) -> None:
        if ids.ndim != 2:
            raise ValueError(f"CLIPTextEncoder takes token ids [batch, length]; got shape {tuple(ids.shape)}")
        if ids.shape[1] > self.max_position_embeddings:
            raise ValueError(
                f"CLIPTextEncoder: {ids.shape[1]} tokens exceed max_position_embeddings="
                f"{self.max_position_embeddings}; tokenize with max_length={self.max_position_embeddings}"
            )
        if self.hidden_size % self.num_heads:
            raise ValueError(f"CLIPTextEncoder: hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}")

    @nn.compact
    def __call__(self, ids: jax.Array, attention_mask: jax.Array | None = None) -> CLIPTextOutput:
        self._check(ids)
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        init = nn.initializers.normal(0.02)
        tokens = nn.Embed(self.vocab_size, self.hidden_size, name="token_embedding", **kw,
                          embedding_init=nn.with_logical_partitioning(init, ("vocab", "embed")))
        positions = nn.Embed(self.max_position_embeddings, self.hidden_size, name="position_embedding", **kw,
                             embedding_init=nn.with_logical_partitioning(init, (None, "embed")))
        x = tokens(ids) + positions(jnp.arange(ids.shape[1]))[None]
        mask = None if attention_mask is None else attention_mask[:, None, None, :].astype(bool)

        states = [x]
        for i in range(self.num_layers):
            x = CLIPEncoderLayer(self.num_heads, self.intermediate_size, self.hidden_act, self.layer_norm_eps,
                                 name=f"layers_{i}", **kw)(x, mask)
            states.append(x)
        last = layer_norm(self.layer_norm_eps, "final_layer_norm", **kw)(x)

        if self.eos_token_id == LEGACY_EOS_ID:
            eos_positions = jnp.argmax(ids, axis=-1)
        else:
            eos_positions = jnp.argmax(ids == self.eos_token_id, axis=-1)
        pooled = jnp.take_along_axis(last, eos_positions[:, None, None], axis=1)[:, 0]
        projected = None
        if self.projection_dim is not None:
            projected = dense(self.projection_dim, ("embed", None), "text_projection", use_bias=False, **kw)(pooled)
        return CLIPTextOutput(last=last, penultimate=states[-2], pooled=pooled, projected=projected)
