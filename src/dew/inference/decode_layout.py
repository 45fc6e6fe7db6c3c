"""Decoding on XLA:CPU from a rearranged copy of a CausalTransformer's weights.

A decode step is a chain of thin matrix products (one row per sequence), and XLA:CPU streams the
weights through them fastest when they are few and wide and the kernels are stored ``[out, in]``
(benchmarks/README.md has the measurements). `decode_layout` turns a model and its variables into
a `DecodeTransformer` and its variables, which compute the same function: per layer, q/k/v fused
into ``self_attn/qkv_proj`` and gate/up into ``mlp/gate_up_proj``, and every projection kernel
stored transposed as ``kernel_t`` (``[q + k + v, in]``, ``[out, in]`` for o, ``[2 * hidden, in]``,
``[out, in]`` for down); a mixture layer's feed-forward (`dew.nn.moe.Mixture`) keeps its
parameters as they are. The pair goes to `dew.sampling.generate` as it is.

The model keeps its one layout for training, checkpoints and exports; this copy lives only as long
as the `DecodeWeights` a task holds (`get(rows)` converts on first use, once per weights).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.checks import count
from dew.nn.backbones.causal_transformer import (
    INIT_STD,
    MLP,
    CausalTransformer,
    DecoderBlock,
    SelfAttention,
)

# Rows that decode faster from the layout on XLA:CPU (the random 29M Qwen3 of benchmarks/lm_decode.py,
# 128 greedy tokens, the same tokens either way): one row, whose widening products XLA fuses into one
# loop (`transposed_product`), and 3 to 48 rows, 6-10% faster than the training layout, mostly in the
# down projection, which runs about 1.9x faster with its kernel stored [out, in] at 16 rows. Two rows
# ran 11% slower from the layout and 64 rows 2-4% slower, so they decode from the weights as trained.
LAYOUT_ROWS = frozenset({1, *range(3, 49)})


def transposed_product(x: jax.Array, kernel_t: jax.Array) -> jax.Array:
    """``x @ kernel_t.T`` for a kernel stored ``[out, in]``, in the form XLA:CPU runs fastest.

    For one-row decoding a widening product is written ``x @ kernel_t.T``, which XLA fuses (with
    the producer of ``x``, e.g. the RMSNorm) into one loop split over the cores; a square or
    narrowing one stays a plain matrix product with the ``[out, in]`` operand, which runs faster
    than that loop for them (benchmarks/README.md). For several rows XLA runs either form as the
    same matrix product. The result is the same.
    """
    if kernel_t.shape[-2] > kernel_t.shape[-1]:
        return x @ kernel_t.T
    return jnp.einsum("...i,oi->...o", x, kernel_t)


class TransposedDense(nn.Module):
    """A dense projection whose kernel is stored ``[out, in]`` (``kernel_t``), plus an optional bias."""

    features: int
    use_bias: bool = False
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel_t = self.param(
            "kernel_t", nn.initializers.normal(INIT_STD), (self.features, x.shape[-1]), self.param_dtype
        )
        y = transposed_product(x.astype(self.dtype), kernel_t.astype(self.dtype))
        if self.use_bias:
            bias = self.param("bias", nn.initializers.zeros, (self.features,), self.param_dtype)
            y = y + bias.astype(self.dtype)
        return y


class DecodeSelfAttention(SelfAttention):
    """`SelfAttention` reading one fused ``qkv_proj`` and a transposed ``o_proj``."""

    def project_qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        q_features, kv_features = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = TransposedDense(q_features + 2 * kv_features, self.use_bias or self.qkv_bias, self.dtype,
                              self.param_dtype, name="qkv_proj")(x)
        q, k, v = jnp.split(qkv, [q_features, q_features + kv_features], axis=-1)
        return q, k, v

    def project_out(self, out: jax.Array, features: int) -> jax.Array:
        return TransposedDense(features, self.use_bias, self.dtype, self.param_dtype, name="o_proj")(out)


class DecodeMLP(MLP):
    """`MLP` reading one fused ``gate_up_proj`` and a transposed ``down_proj``."""

    def project_gate_up(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        gate_up = TransposedDense(2 * self.features, self.use_bias, self.dtype, self.param_dtype,
                                  name="gate_up_proj")(x)
        gate, up = jnp.split(gate_up, 2, axis=-1)
        return gate, up

    def project_down(self, h: jax.Array, width: int) -> jax.Array:
        return TransposedDense(width, self.use_bias, self.dtype, self.param_dtype, name="down_proj")(h)


class DecodeBlock(DecoderBlock):
    """`DecoderBlock` with the decode layout's attention and MLP."""

    attention_class = DecodeSelfAttention
    mlp_class = DecodeMLP


class DecodeTransformer(CausalTransformer):
    """`CausalTransformer` over the decode layout: same settings, cache and call, other parameters."""

    block_class = DecodeBlock


# --- the conversion ------------------------------------------------------------------------------


def _transposed(projection: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A dense projection's ``{kernel [in, out], bias?}`` as ``{kernel_t [out, in], bias?}``."""
    if set(projection) not in ({"kernel"}, {"kernel", "bias"}):
        raise ValueError(
            f"{where} holds {sorted(projection)}; a CausalTransformer projection holds 'kernel' and "
            "optionally 'bias'. Convert the variables the model was initialized or loaded with"
        )
    out = {"kernel_t": jnp.swapaxes(projection["kernel"], -1, -2)}
    if "bias" in projection:
        out["bias"] = projection["bias"]
    return out


def _fused(parts: list[Mapping[str, Any]], where: str) -> dict[str, Any]:
    """Projections of one input side by side: kernels ``[in, sum(out)]`` and biases, transposed."""
    biased = {"bias" in p for p in parts}
    if len(biased) != 1:
        raise ValueError(f"{where}: some of these projections have a bias and some do not; all or none must")
    fused = {"kernel": jnp.concatenate([p["kernel"] for p in parts], axis=-1)}
    if biased == {True}:
        fused["bias"] = jnp.concatenate([p["bias"] for p in parts], axis=-1)
    return _transposed(fused, where)


def _decode_block(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    """One layer's parameters (or all layers', stacked by scan_layers) in the decode layout."""
    attention, mlp = dict(block["self_attn"]), dict(block["mlp"])
    qkv = [attention.pop(name) for name in ("q_proj", "k_proj", "v_proj")]
    attention["qkv_proj"] = _fused(qkv, f"{where}/self_attn/q_proj, k_proj, v_proj")
    attention["o_proj"] = _transposed(attention["o_proj"], f"{where}/self_attn/o_proj")
    if "experts" not in mlp:  # a mixture layer keeps its parameters as they are
        gate_up = [mlp.pop(name) for name in ("gate_proj", "up_proj")]
        mlp["gate_up_proj"] = _fused(gate_up, f"{where}/mlp/gate_proj, up_proj")
        mlp["down_proj"] = _transposed(mlp["down_proj"], f"{where}/mlp/down_proj")
    return {**block, "self_attn": attention, "mlp": mlp}


def _decode_layers(layers: Mapping[str, Any]) -> dict[str, Any]:
    return {name: _decode_block(block, name) for name, block in layers.items()}


_decode_layers_jit = jax.jit(_decode_layers)  # one compile per parameter shapes, reused by every task


def decode_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """CausalTransformer params (``layers_{i}`` or scanned ``layers``) in the decode layout.

    The layers are rearranged in one jitted pass; the embedding, final norm and head are the same
    arrays, not copies.
    """
    layers = {name: block for name, block in params.items() if name == "layers" or name.startswith("layers_")}
    if not layers:
        raise ValueError(f"expected CausalTransformer params with layers_0, ... or layers; got keys {sorted(params)}")
    return {**params, **_decode_layers_jit(layers)}


def decode_model(model: CausalTransformer) -> DecodeTransformer:
    """The `DecodeTransformer` with `model`'s settings (equal ones for equal models, so jit reuses it)."""
    settings = {
        field.name: getattr(model, field.name)
        for field in dataclasses.fields(model)
        if field.init and field.name not in ("parent", "name")
    }
    return DecodeTransformer(**settings)


def decode_layout(model: CausalTransformer, variables: Any) -> tuple[DecodeTransformer, Any]:
    """The decode model and variables for `model` and `variables`; they compute the same function.

    Only the layers' parameters are copied (rearranged); the embedding, head and other collections
    are shared. The originals stay as they are, for training and saving.
    """
    if type(model) is not CausalTransformer:
        raise TypeError(f"decode_layout converts a CausalTransformer, got {type(model).__name__}")
    variables = nn.unbox(variables)
    if not isinstance(variables, Mapping) or "params" not in variables:
        raise ValueError("decode_layout needs Flax variables with a 'params' collection, as model.init returns")
    return decode_model(model), {**variables, "params": decode_params(variables["params"])}


def uses_decode_layout(model: Any, variables: Any, rows: int) -> bool:
    """Whether `rows` rows of `model` decode from the decode layout.

    Only on the CPU backend (other backends have their own kernels), for the row counts in
    `LAYOUT_ROWS`, only an exact CausalTransformer (a subclass may compute something else) and only
    concrete weights (inside a trace the copy would be made on every call).
    """
    count(rows, "rows")
    if rows not in LAYOUT_ROWS or jax.default_backend() != "cpu" or type(model) is not CausalTransformer:
        return False
    if model.latent_attention is not None:  # latent attention decodes through its own absorbed products
        return False
    return not any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(variables))


def for_decoding(model: Any, variables: Any, rows: int) -> tuple[Any, Any]:
    """The model and variables `generate` should decode `rows` rows with: converted or as given."""
    if uses_decode_layout(model, variables, rows):
        return decode_layout(model, variables)
    return model, variables


class DecodeWeights:
    """A model and its weights, and their decode layout, made on first use and kept.

    For a task over fixed weights: ``get(rows)`` answers as `for_decoding` does, converting at most
    once. A task over other weights builds another (the copy lives as long as this object).
    """

    def __init__(self, model: Any, variables: Any):
        self.model = model
        self.variables = variables
        self._converted: tuple[DecodeTransformer, Any] | None = None
        self._lock = threading.Lock()  # concurrent calls on one task convert once

    def get(self, rows: int) -> tuple[Any, Any]:
        """The model and variables to decode `rows` rows with."""
        if not uses_decode_layout(self.model, self.variables, rows):
            return self.model, self.variables
        with self._lock:
            if self._converted is None:
                self._converted = decode_layout(self.model, self.variables)
            return self._converted
