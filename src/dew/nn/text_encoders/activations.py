"""The activations text-encoder configs name (transformers' ``hidden_act`` / ``dense_act_fn`` strings)."""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax


def quick_gelu(x: jax.Array) -> jax.Array:
    """OpenAI CLIP's sigmoid approximation of GELU: x * sigmoid(1.702 x)."""
    return x * jax.nn.sigmoid(1.702 * x)


ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "quick_gelu": quick_gelu,
    "gelu": lambda x: nn.gelu(x, approximate=False),
    "gelu_new": lambda x: nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: nn.gelu(x, approximate=True),
    "relu": nn.relu,
    "silu": nn.silu,
}


def activation(name: str, owner: str) -> Callable[[jax.Array], jax.Array]:
    """The function ``name`` stands for, or a ValueError listing the names ``owner`` accepts."""
    if name not in ACTIVATIONS:
        raise ValueError(f"{owner}: unknown activation {name!r}; expected one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]

