"""A dense decoder-only transformer in Llama/Qwen3 form.

token embedding -> num_layers x DecoderBlock -> RMSNorm -> lm head (tied to the embedding or not)

DecoderBlock (pre-norm, as in Llama):
    x = x + self_attn(input_layernorm(x))          GQA attention with RoPE (and Qwen3's q/k norm,
                                                   GPT-OSS's attention sinks)
    x = x + mlp(post_attention_layernorm(x))       SwiGLU: down(silu(gate(x)) * up(x)), or a
                                                   mixture of SwiGLU experts (dew.nn.moe.Mixture)

Parameter names follow Hugging Face's Llama layout (``layers_3/self_attn/q_proj/kernel`` for
``model.layers.3.self_attn.q_proj.weight``), with 2-D ``[in, out]`` kernels, so a checkpoint's
weight table is a rename plus a transpose. Every parameter carries logical axis names for
sharding. ``dtype`` is the compute dtype, ``param_dtype`` the storage dtype; logits come back in
float32. This is the model's one parameter layout: training, checkpoints and exports see it. The
projections are methods (`SelfAttention.project_qkv` / `project_out`, `MLP.project_gate_up` /
`project_down`) and the block classes are class attributes, so a subclass on the inference side
can read the same weights rearranged for a device (`dew.inference.decode_layout`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.core import FrozenDict
from jax.ad_checkpoint import checkpoint_name

from dew.nn import gpipe
from dew.nn.attention import cache_attention, check_attention_impl, paged_cache_attention
from dew.nn.backbones.decoder_parts import INIT_STD, RMSNorm, named_dense, rope_context
from dew.nn.backbones.latent_attention import LatentAttention, latent_settings
from dew.nn.backbones.layer_plan import MIXTURE_MLP, LayerKind, resolve_layer_plan, resolve_mlp_plan
from dew.nn import kv_pages
from dew.nn.kv_cache import KVCache, check_layout, init_kv_cache, write_kv, write_positions
from dew.nn.kv_quant import check_head_dim
from dew.nn.moe import BALANCE_COLLECTION, ROUTER_COLLECTION, Mixture
from dew.nn.rope import apply_rope, rope_cos_sin, rope_frequencies, rope_type
from dew.nn.sequence_parallel import split_length, token_rows
from dew.nn.sequence_parallel import attention as sequence_attention

REMAT_POLICIES = ("full", "minimal", "save_qkv_proj", "minimal_offloaded", "save_qkv_proj_offloaded")


def check_tokens(tokens: Any, vocab_size: int) -> None:
    """Raise a ValueError when concrete token ids fall outside ``[0, vocab_size)``.

    Traced arrays (inside jit) cannot be inspected and pass through unchecked.
    """
    if isinstance(tokens, jax.core.Tracer):
        return
    ids = np.asarray(tokens)
    if ids.size == 0:
        return
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got dtype {ids.dtype}")
    bad = np.argwhere((ids < 0) | (ids >= vocab_size))
    if bad.size:
        where = tuple(int(i) for i in bad[0])
        raise ValueError(
            f"token id {int(ids[where])} at index {where} is outside the vocabulary "
            f"[0, {vocab_size}); {len(bad)} id(s) out of range. Check the tokenizer matches the "
            f"model's vocab_size={vocab_size}"
        )


def _take_tokens(x: jax.Array, logits_at: Any) -> jax.Array:
    """The tokens ``x [B, L, width]`` at length indices ``logits_at [B, K]``: ``[B, K, width]``."""
    at = jnp.asarray(logits_at)
    if at.ndim != 2 or at.shape[0] != x.shape[0] or not jnp.issubdtype(at.dtype, jnp.integer):
        raise ValueError(
            f"logits_at must be integer indices [batch={x.shape[0]}, K] along the length axis, got "
            f"shape {at.shape} and dtype {at.dtype}; pass e.g. (lengths - 1)[:, None] for each row's last token"
        )
    if not isinstance(at, jax.core.Tracer) and at.size and (int(at.min()) < 0 or int(at.max()) >= x.shape[1]):
        raise ValueError(f"logits_at indices must lie in [0, {x.shape[1]}) (the call's length), got "
                         f"{int(at.min())}..{int(at.max())}")
    return jnp.take_along_axis(x, at[..., None].astype(jnp.int32), axis=1)


def remat_policy(name: str | None):
    """The jax.checkpoint policy for a remat name (None: no rematerialization)."""
    if name is None:
        return None
    policies = {
        "full": jax.checkpoint_policies.nothing_saveable,  # recompute the whole block
        "minimal": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep matmul outputs
        "save_qkv_proj": jax.checkpoint_policies.save_only_these_names("q_proj", "k_proj", "v_proj"),
        # the same residuals, kept in pinned host memory until the backward pass reads them
        "minimal_offloaded": jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
        "save_qkv_proj_offloaded": jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=(), names_which_can_be_offloaded=("q_proj", "k_proj", "v_proj"),
            offload_src="device", offload_dst="pinned_host",
        ),
    }
    if name not in policies:
        raise ValueError(f"remat={name!r} is not a known policy; use None or one of {REMAT_POLICIES}")
    return policies[name]


class SelfAttention(nn.Module):
    """Grouped-query self-attention with RoPE, optional per-head q/k RMSNorm, and a KV cache.

    ``sinks``: a learned logit per query head (param ``sinks [heads]``) that joins each query's
    softmax and is dropped after, as GPT-OSS's attention does (`dew.nn.attention.softmax_with_sinks`).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    window: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None
    max_seq_len: int = 2048
    qk_norm: bool = True
    use_bias: bool = False
    qkv_bias: bool = False
    sinks: bool = False
    norm_eps: float = 1e-6
    causal: bool = True
    attention_impl: str = "auto"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def project_qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries ``[N, heads * head_dim]``, keys and values ``[N, kv_heads * head_dim]`` of rows ``[N, width]``."""
        dense = dict(use_bias=self.use_bias or self.qkv_bias, dtype=self.dtype, param_dtype=self.param_dtype)
        q = named_dense(self.num_heads * self.head_dim, ("embed", "heads"), "q_proj", **dense)(x)
        k = named_dense(self.num_kv_heads * self.head_dim, ("embed", "kv_heads"), "k_proj", **dense)(x)
        v = named_dense(self.num_kv_heads * self.head_dim, ("embed", "kv_heads"), "v_proj", **dense)(x)
        return q, k, v

    def project_out(self, out: jax.Array, features: int) -> jax.Array:
        """The attended heads, rows ``[N, heads * head_dim]``, back to the model width `features`."""
        out_std = INIT_STD / math.sqrt(2 * self.num_layers)  # GPT-2's scaled residual init
        return named_dense(features, ("heads", "embed"), "o_proj", use_bias=self.use_bias, std=out_std,
                      dtype=self.dtype, param_dtype=self.param_dtype)(out)

    @nn.compact
    def __call__(self, x, positions, segment_ids=None, layer_cache=None, slots=None, window=None):
        batch, length, emb = x.shape
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        rows = token_rows(x)  # 2-D rows into the products, 3-D when the length is split
        q, k, v = self.project_qkv(rows)
        q, k, v = checkpoint_name(q, "q_proj"), checkpoint_name(k, "k_proj"), checkpoint_name(v, "v_proj")
        q = q.reshape(batch, length, heads, head_dim)
        k = k.reshape(batch, length, kv_heads, head_dim)
        v = v.reshape(batch, length, kv_heads, head_dim)

        if self.qk_norm:  # Qwen3: RMSNorm over head_dim, per head, before the rotation
            norm = dict(eps=self.norm_eps, dtype=self.dtype, param_dtype=self.param_dtype)
            q = RMSNorm(name="q_norm", **norm)(q)
            k = RMSNorm(name="k_norm", **norm)(k)

        inv_freq, attention_factor = rope_frequencies(
            head_dim, self.rope_theta, self.rope_scaling, rope_context(self.rope_scaling, self.max_seq_len)
        )
        cos, sin = rope_cos_sin(positions, inv_freq, attention_factor)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        sinks = None
        if self.sinks:
            sinks = self.param("sinks", nn.with_logical_partitioning(nn.initializers.normal(INIT_STD), ("heads",)),
                               (heads,), self.param_dtype)
        window = self.window if window is None else window
        attend = dict(causal=self.causal, window=window, impl=self.attention_impl)
        if layer_cache is None:
            out = sequence_attention(q, k, v, segment_ids=segment_ids, sinks=sinks, **attend)  # split by the step's mesh
            new_cache = None
        else:
            # write this call's keys and values to the shared slots from `index`, then attend over
            # the whole cache by position (`kv_positions` already records this call's tokens)
            # (a paged cache writes into its pool and gathers each row's pages to attend over them)
            kv_positions, index, page_table = slots
            cache_k, cache_v = layer_cache

            rules = dict(q_positions=positions, causal=self.causal, window=window, sinks=sinks)

            def attend(q, seen_k, seen_v, kv_positions):
                return cache_attention(q, seen_k, seen_v, kv_positions=kv_positions, **rules)

            def by_page(q, k_pool, v_pool, page_table, kv_positions, shared):
                return paged_cache_attention(q, k_pool, v_pool, page_table, kv_positions=kv_positions,
                                             shared=shared, **rules)

            if page_table is None:
                cache_k, cache_v = write_kv(cache_k, cache_v, k, v, index)
                out = attend(q, cache_k, cache_v, kv_positions)
            else:  # no row holds a token past slot max(index) + length: a gather reads only the pages before it
                cache_k, cache_v = kv_pages.write_pages(cache_k, cache_v, k, v, page_table, index)
                out = kv_pages.attend_pages(attend, q, cache_k, cache_v, page_table, kv_positions,
                                            jnp.max(index) + length, by_page)
            new_cache = (cache_k, cache_v)

        out = self.project_out(out.reshape(*rows.shape[:-1], heads * head_dim), emb)
        return out.reshape(batch, length, emb), new_cache


def _check_cache(cache: KVCache, batch: int, length: int) -> None:
    """Raise when `length` new tokens of `batch` rows cannot go into `cache` (concrete values only)."""
    if cache.batch_size != batch:
        raise ValueError(f"the KV cache holds {cache.batch_size} rows but the tokens have {batch}; "
                         "build it with model.init_cache(batch_size)")
    if length > cache.max_len:
        raise ValueError(f"{length} tokens do not fit a KV cache of max_len={cache.max_len}")
    if not cache.paged and not isinstance(cache.index, jax.core.Tracer) and int(np.max(cache.index)) + length > cache.max_len:
        raise ValueError(
            f"the KV cache has {cache.max_len - int(np.max(cache.index))} free slots of {cache.max_len} and "
            f"cannot take {length} more tokens; build it with a larger max_len"
        )


class MLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020, arXiv:2002.05202): down(silu(gate(x)) * up(x))."""

    features: int
    num_layers: int
    use_bias: bool = False
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def project_gate_up(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The gate and up projections of rows ``[N, width]``, each ``[N, features]``."""
        dense = dict(use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype)
        gate = named_dense(self.features, ("embed", "mlp"), "gate_proj", **dense)(x)
        up = named_dense(self.features, ("embed", "mlp"), "up_proj", **dense)(x)
        return gate, up

    def project_down(self, h: jax.Array, width: int) -> jax.Array:
        """The down projection of rows ``[N, features]`` back to ``[N, width]``."""
        out_std = INIT_STD / math.sqrt(2 * self.num_layers)  # GPT-2's scaled residual init
        return named_dense(width, ("mlp", "embed"), "down_proj", use_bias=self.use_bias, std=out_std,
                      dtype=self.dtype, param_dtype=self.param_dtype)(h)

    @nn.compact
    def __call__(self, x):
        shape = x.shape
        x = token_rows(x)  # 2-D matmuls (XLA's CPU backward then needs no transposes) unless split
        gate, up = self.project_gate_up(x)
        return self.project_down(nn.silu(gate) * up, shape[-1]).reshape(shape)


class DecoderBlock(nn.Module):
    """One pre-norm decoder layer; returns ``(x, new_layer_cache)`` so it can be scanned."""

    attention_class: ClassVar[type[SelfAttention]] = SelfAttention
    mlp_class: ClassVar[type[MLP]] = MLP

    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_features: int
    num_layers: int
    window: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None
    max_seq_len: int = 2048
    norm_eps: float = 1e-6
    qk_norm: bool = True
    attention_bias: bool = False
    qkv_bias: bool = False
    attention_sinks: bool = False
    mlp_bias: bool = False
    mixture: Mapping[str, Any] | None = None  # this layer's Mixture settings; None: a dense MLP
    latent_attention: Mapping[str, Any] | None = None  # LatentAttention settings; None: SelfAttention
    causal: bool = True
    attention_impl: str = "auto"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, positions, segment_ids=None, layer_cache=None, slots=None, window=None):
        x = split_length(x)  # rows kept over the batch axes (and the length over the sequence axis) layer by layer
        norm = dict(eps=self.norm_eps, dtype=self.dtype, param_dtype=self.param_dtype)
        attention = self.attention_class(
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            num_layers=self.num_layers, window=self.window, rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling, max_seq_len=self.max_seq_len, qk_norm=self.qk_norm,
            use_bias=self.attention_bias, qkv_bias=self.qkv_bias, sinks=self.attention_sinks,
            norm_eps=self.norm_eps, causal=self.causal,
            attention_impl=self.attention_impl, dtype=self.dtype, param_dtype=self.param_dtype,
            name="self_attn",
        ) if self.latent_attention is None else self._latent_attention()
        h, new_cache = attention(
            RMSNorm(name="input_layernorm", **norm)(x), positions, segment_ids, layer_cache, slots, window
        )
        x = x + h
        if self.mixture is None:
            mlp = self.mlp_class(self.mlp_features, self.num_layers, use_bias=self.mlp_bias, dtype=self.dtype,
                                 param_dtype=self.param_dtype, name="mlp")
        else:
            mlp = Mixture(**self.mixture, num_layers=self.num_layers, dtype=self.dtype,
                          param_dtype=self.param_dtype, name="mlp")
        x = x + mlp(RMSNorm(name="post_attention_layernorm", **norm)(x))
        return x, new_cache

    def _latent_attention(self) -> nn.Module:
        """DeepSeek's multi-head latent attention in place of `attention_class`."""
        # the latent attention module builds on this file's norm and projections, so it is imported here

        return LatentAttention(
            **self.latent_attention, num_heads=self.num_heads, num_layers=self.num_layers,
            rope_theta=self.rope_theta, rope_scaling=self.rope_scaling, max_seq_len=self.max_seq_len,
            norm_eps=self.norm_eps, causal=self.causal, attention_impl=self.attention_impl,
            dtype=self.dtype, param_dtype=self.param_dtype, name="self_attn",
        )


class CausalTransformer(nn.Module):
    """Decoder-only language model: tokens ``[B, L]`` -> float32 logits ``[B, L, vocab_size]``.

    ``model.apply(variables, tokens, positions=None, segment_ids=None)`` returns logits;
    with ``cache=`` (from `init_cache`) it returns ``(logits, new_cache)``: this call's keys and
    values go to the cache's next free slots (the same slots for every row), at the given positions
    (default: each row's next position, ``cache.lengths``), and every query attends to the cached
    tokens by position. ``logits_at=`` (int ``[B, K]``, indices along the length axis) computes
    the logits of those tokens only, ``[B, K, vocab_size]``: a prefill that needs the logits of
    each prompt's last token skips the output projection of all the others.

    Attributes beyond the usual sizes:
      num_kv_heads: key/value heads for grouped-query attention (default: num_heads).
      head_dim: per-head width (default: emb_features // num_heads).
      mlp_features: SwiGLU hidden width (default: 4 * emb_features).
      rope_scaling: an HF ``rope_scaling`` dict (types "linear", "llama3", "yarn") or None.
      qk_norm: Qwen3's RMSNorm on each query/key head before RoPE.
      attention_bias: biases on q, k, v and o (Llama's attention_bias); qkv_bias: on q, k, v only (Qwen2).
      attention_sinks: a learned sink logit per query head in every layer's softmax (GPT-OSS).
      layer_types, kinds: per-layer attention pattern (see layer_plan.py).
      mixture: `dew.nn.moe.Mixture` settings (``{"num_experts": 8, "top_k": 2, "expert_features":
        ...}``) for the mixture layers, or None for a dense model.
      mlp_layer_types, first_k_dense: which layers are "dense" and which "mixture" (layer_plan.py;
        by default every layer is a mixture when ``mixture`` is set).
      latent_attention: multi-head latent attention settings for every layer (DeepSeek's MLA,
        `dew.nn.backbones.latent_attention`: ``kv_lora_rank``, ``qk_nope_head_dim``,
        ``qk_rope_head_dim``, ``v_head_dim``, ``q_lora_rank``, ``rope_interleave``), or None for
        grouped-query attention; its KV cache holds each token's latent and shared rope key.
      attention_impl: "auto", "reference", "xla", "cudnn" or "blockwise"; never changes the parameters.
      scan_layers: run the layers with nn.scan (params stacked under ``layers/``).
      remat: None, "full", "minimal" or "save_qkv_proj"; "minimal_offloaded" and
        "save_qkv_proj_offloaded" keep the same residuals in pinned host memory.
      kv_cache: the layout `init_cache` allocates, a `KVCache` without arrays
        (``KVCache(quantized="int8")``); None is the dense cache in the compute dtype.
    """

    block_class: ClassVar[type[DecoderBlock]] = DecoderBlock

    vocab_size: int
    emb_features: int
    num_layers: int
    num_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    mlp_features: int | None = None
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None
    norm_eps: float = 1e-6
    qk_norm: bool = True
    tie_embeddings: bool = True
    attention_bias: bool = False
    qkv_bias: bool = False
    attention_sinks: bool = False
    mlp_bias: bool = False
    causal: bool = True
    layer_types: Sequence[str] | None = None
    kinds: Mapping[str, LayerKind] | None = None
    mixture: Mapping[str, Any] | None = None
    mlp_layer_types: Sequence[str] | None = None
    first_k_dense: int = 0
    latent_attention: Mapping[str, Any] | None = None
    attention_impl: str = "auto"
    scan_layers: bool = False
    remat: str | None = None
    kv_cache: KVCache | None = None
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def __post_init__(self):
        # hashable, immutable copies of the container settings (so the module can key a jit cache)
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, FrozenDict):
            object.__setattr__(self, "rope_scaling", FrozenDict(self.rope_scaling))
        if self.kinds is not None and not isinstance(self.kinds, FrozenDict):
            object.__setattr__(self, "kinds", FrozenDict(self.kinds))
        if self.layer_types is not None and not isinstance(self.layer_types, tuple):
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.mixture is not None and not isinstance(self.mixture, FrozenDict):
            object.__setattr__(self, "mixture", FrozenDict(self.mixture))
        if self.latent_attention is not None and not isinstance(self.latent_attention, FrozenDict):
            object.__setattr__(self, "latent_attention", FrozenDict(self.latent_attention))
        if self.mlp_layer_types is not None and not isinstance(self.mlp_layer_types, tuple):
            object.__setattr__(self, "mlp_layer_types", tuple(self.mlp_layer_types))
        self._validate()
        super().__post_init__()

    def _validate(self) -> None:
        for name in ("vocab_size", "emb_features", "num_layers", "num_heads", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not divisible by num_kv_heads={self.kv_heads}; "
                "grouped-query attention shares each key/value head among num_heads // num_kv_heads query heads"
            )
        if self.head_dim is None and self.emb_features % self.num_heads:
            raise ValueError(
                f"emb_features={self.emb_features} is not divisible by num_heads={self.num_heads}; "
                "pass head_dim explicitly"
            )
        if self.head_features % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_features}")
        check_attention_impl(self.attention_impl)
        if self.kv_cache is not None:
            check_layout(self.kv_cache)
            check_head_dim(self.kv_cache.quantized, self.head_features)
            if self.latent_attention is not None and (self.kv_cache.paged or self.kv_cache.quantized):
                raise ValueError(
                    f"latent attention caches its compressed latents densely and unquantized; got kv_cache="
                    f"{self.kv_cache}. Leave kv_cache unset for this model"
                )
        remat_policy(self.remat)
        rope_type(self.rope_scaling)
        plan = self.layer_plan
        mlp_plan = self.mlp_plan  # raises on a bad feed-forward plan
        if self.mixture is not None:
            reserved = sorted({"num_layers", "dtype", "param_dtype", "name", "parent"} & set(self.mixture))
            if reserved:
                raise ValueError(f"mixture= must not set {reserved}; the model passes its own")
            Mixture(**self.mixture, parent=None)  # raises, naming the setting, on a bad mixture
        if self.latent_attention is not None:

            LatentAttention(**latent_settings(self.latent_attention), num_heads=self.num_heads,
                            num_layers=self.num_layers, parent=None)  # raises, naming the setting
            windowed = sorted({kind.window for kind in plan if kind.window is not None})
            if windowed:
                raise ValueError(f"latent_attention has no sliding window, but layers slide over {windowed} "
                                 "tokens; use full-attention layers")
        if self.scan_layers and len(set(mlp_plan)) > 1:
            raise ValueError(
                f"scan_layers=True needs every layer to have the same feed-forward, but the layers mix "
                f"{sorted(set(mlp_plan))} ones; use scan_layers=False for this layer plan"
            )
        if self.scan_layers and len({kind.rope_theta for kind in plan}) > 1:
            raise ValueError(
                "scan_layers=True needs every layer kind to share rope_theta (only windows may differ "
                "between scanned layers); use scan_layers=False for this layer pattern"
            )

    # --- sizes, computed in plain sight ---------------------------------------------------------

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def head_features(self) -> int:
        return self.emb_features // self.num_heads if self.head_dim is None else self.head_dim

    @property
    def hidden_features(self) -> int:
        return 4 * self.emb_features if self.mlp_features is None else self.mlp_features

    @property
    def layer_plan(self) -> tuple[LayerKind, ...]:
        return resolve_layer_plan(self.num_layers, self.layer_types, self.kinds)

    @property
    def mlp_plan(self) -> tuple[str, ...]:
        """Each layer's feed-forward: "dense" or "mixture"."""
        return resolve_mlp_plan(self.num_layers, self.mlp_layer_types, self.first_k_dense, self.mixture is not None)

    def init_cache(self, batch_size: int, max_len: int | None = None, dtype: Any = None,
                   layout: KVCache | None = None, rows_own_pages: bool = True) -> KVCache:
        """An empty KV cache for ``batch_size`` rows of up to ``max_len`` (default max_seq_len) tokens,
        in `layout` (default: the model's ``kv_cache`` field; None is dense). `rows_own_pages`:
        see `init_kv_cache`."""
        max_len = self.max_seq_len if max_len is None else max_len
        if self.latent_attention is not None:  # one head whose keys are each token's latent and rope key
            latent = self.latent_attention
            return init_kv_cache(
                num_layers=self.num_layers, batch_size=batch_size, max_len=max_len, kv_heads=1,
                head_dim=latent["kv_lora_rank"] + latent["qk_rope_head_dim"], value_dim=0,
                dtype=self.dtype if dtype is None else dtype, stacked=self.scan_layers,
            )
        return init_kv_cache(
            num_layers=self.num_layers, batch_size=batch_size, max_len=max_len,
            kv_heads=self.kv_heads, head_dim=self.head_features,
            dtype=self.dtype if dtype is None else dtype, stacked=self.scan_layers,
            layout=self.kv_cache if layout is None else layout, rows_own_pages=rows_own_pages,
        )

    # --- forward ---------------------------------------------------------------------------------

    @nn.compact
    def __call__(self, tokens, positions=None, segment_ids=None, cache: KVCache | None = None, logits_at=None):
        tokens = jnp.asarray(tokens) if not isinstance(tokens, jax.core.Tracer) else tokens
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [batch, length] token ids, got shape {tokens.shape}")
        batch, length = tokens.shape
        if length > self.max_seq_len:
            raise ValueError(
                f"sequence of {length} tokens is longer than max_seq_len={self.max_seq_len}; "
                "shorten it or build the model with a larger max_seq_len"
            )
        check_tokens(tokens, self.vocab_size)

        slots = None
        if cache is not None:
            if segment_ids is not None:
                raise ValueError("segment_ids are not supported together with a KV cache")
            _check_cache(cache, batch, length)
            if positions is None:
                positions = cache.lengths[:, None] + jnp.arange(length, dtype=jnp.int32)
            positions = jnp.broadcast_to(positions, (batch, length)).astype(jnp.int32)
            if cache.paged:
                slots = (kv_pages.write_page_positions(cache.positions, positions, cache.index), cache.index,
                         cache.page_table)
            else:
                slots = (write_positions(cache.positions, positions, cache.index), cache.index, None)
        elif positions is None:
            positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
        else:
            positions = jnp.broadcast_to(positions, (batch, length)).astype(jnp.int32)

        embed = nn.Embed(
            self.vocab_size, self.emb_features, dtype=self.dtype, param_dtype=self.param_dtype,
            embedding_init=nn.with_logical_partitioning(nn.initializers.normal(INIT_STD), ("vocab", "embed")),
            name="embed_tokens",
        )
        x = split_length(embed(tokens))  # positions over the sequence axis, when the step splits them

        plan = self.layer_plan
        block_args = dict(
            latent_attention=self.latent_attention,
            num_heads=self.num_heads, num_kv_heads=self.kv_heads, head_dim=self.head_features,
            mlp_features=self.hidden_features, num_layers=self.num_layers, rope_scaling=self.rope_scaling,
            max_seq_len=self.max_seq_len, norm_eps=self.norm_eps, qk_norm=self.qk_norm,
            attention_bias=self.attention_bias, qkv_bias=self.qkv_bias, mlp_bias=self.mlp_bias,
            attention_sinks=self.attention_sinks, causal=self.causal, attention_impl=self.attention_impl, dtype=self.dtype, param_dtype=self.param_dtype,
        )
        mlp_plan = self.mlp_plan
        block_cls = self.block_class
        if self.remat is not None:
            block_cls = nn.remat(self.block_class, policy=remat_policy(self.remat), prevent_cse=not self.scan_layers)

        stages = gpipe.current() if cache is None and not self.is_initializing() else None
        if stages is not None and (not self.scan_layers or self.mixture is not None):
            raise ValueError(
                f"MeshSpec(stage={stages.stages}) runs a decoder's scanned layer stack as GPipe stages; "
                f"build it with scan_layers=True and dense layers (got scan_layers={self.scan_layers}, "
                f"mixture={'set' if self.mixture is not None else None}), or use stage=1."
            )
        if stages is not None:
            x = self._staged_layers(stages, block_cls, block_args, plan, x, positions, segment_ids)
            new_k = new_v = None
        elif self.scan_layers:
            mixture = self.mixture if mlp_plan[0] == MIXTURE_MLP else None
            x, new_k, new_v = self._scanned_layers(block_cls, dict(block_args, mixture=mixture), plan, x,
                                                   positions, segment_ids, cache, slots)
        else:
            new_k, new_v = [], []
            for i, kind in enumerate(plan):
                theta = self.rope_theta if kind.rope_theta is None else kind.rope_theta
                mixture = self.mixture if mlp_plan[i] == MIXTURE_MLP else None
                block = block_cls(window=kind.window, rope_theta=theta, mixture=mixture, name=f"layers_{i}",
                                  **block_args)
                layer_cache = None if cache is None else cache.layer(i)
                x, layer_cache = block(x, positions, segment_ids, layer_cache, slots, None)
                if cache is not None:
                    new_k.append(layer_cache[0])
                    new_v.append(layer_cache[1])
            new_k, new_v = tuple(new_k), tuple(new_v)

        if logits_at is not None:
            x = _take_tokens(x, logits_at)
        x = RMSNorm(eps=self.norm_eps, dtype=self.dtype, param_dtype=self.param_dtype, name="norm")(x)
        rows = token_rows(x)  # as every product of the blocks
        if self.tie_embeddings:
            logits = embed.attend(rows)
        else:
            logits = named_dense(self.vocab_size, ("embed", "vocab"), "lm_head", dtype=self.dtype,
                            param_dtype=self.param_dtype)(rows)
        logits = logits.reshape(batch, x.shape[1], self.vocab_size).astype(jnp.float32)
        if cache is None:
            return logits
        new_cache = cache.replace(
            k=new_k, v=new_v, positions=slots[0], index=cache.index + length,
            lengths=jnp.max(positions, axis=1) + 1,
        )
        return logits, new_cache

    def _layer_windows(self, plan):
        """The window every scanned layer shares (static), or each layer's window as data (0: none)."""
        if len({kind.window for kind in plan}) == 1:
            return plan[0].window, None
        return None, jnp.asarray([kind.window or 0 for kind in plan], jnp.int32)

    def _staged_layers(self, split, block_cls, block_args, plan, x, positions, segment_ids):
        """The scanned layers' weights run as GPipe stages over microbatches (dew.nn.gpipe)."""
        static_window, layer_windows = self._layer_windows(plan)
        theta = self.rope_theta if plan[0].rope_theta is None else plan[0].rope_theta
        block = block_cls(window=static_window, rope_theta=theta, mixture=None, parent=None, **block_args)
        weights = {"params": self.variables["params"]["layers"]}
        if layer_windows is not None:
            weights["window"] = layer_windows

        def layer(w, h, rows):
            return block.apply({"params": w["params"]}, h, rows[0], rows[1], None, None, w.get("window"))[0]

        return gpipe.run_stages(split, layer, weights, x, (positions, segment_ids))

    def _scanned_layers(self, block_cls, block_args, plan, x, positions, segment_ids, cache, slots):
        """All layers as one nn.scan over a stacked block; windows may differ per layer."""
        theta = self.rope_theta if plan[0].rope_theta is None else plan[0].rope_theta
        static_window, layer_windows = self._layer_windows(plan)
        scanned = nn.scan(
            block_cls,
            variable_axes={"params": 0, ROUTER_COLLECTION: 0, BALANCE_COLLECTION: 0},
            split_rngs={"params": True},
            in_axes=(nn.broadcast, nn.broadcast, 0, nn.broadcast, 0),
            length=self.num_layers,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        stack = scanned(window=static_window, rope_theta=theta, name="layers", **block_args)
        layer_cache = None if cache is None else (cache.k, cache.v)
        x, new_cache = stack(x, positions, segment_ids, layer_cache, slots, layer_windows)
        if new_cache is None:
            return x, None, None
        return x, new_cache[0], new_cache[1]
