"""Which kind of attention and which feed-forward each decoder layer runs.

A decoder's layer pattern is configuration: ``layer_types`` names each layer's kind (as in Hugging
Face's ``config.layer_types``) and ``kinds`` says what a kind does. Two kinds are built in:
"full_attention" (every earlier key) and "sliding_attention" (the last ``window`` keys, the
query's own included), which has no default window, so ``kinds`` must give it one. Other names
may be defined in ``kinds``.

The feed-forward of each layer is "dense" (one SwiGLU MLP) or "mixture" (a routed mixture of
experts, `dew.nn.moe.Mixture`): ``mlp_layer_types`` names it per layer, or ``first_k_dense`` makes
the first k layers dense and the rest mixtures (DeepSeek's ``first_k_dense_replace``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dew.checks import count

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
BUILTIN_LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
DENSE_MLP = "dense"
MIXTURE_MLP = "mixture"
MLP_LAYER_TYPES = (DENSE_MLP, MIXTURE_MLP)


@dataclass(frozen=True)
class LayerKind:
    """What a kind of layer does.

    Attributes:
      window: attend to at most this many keys, the query's own included (None: no window).
      rope_theta: RoPE base for this kind (None: the model's ``rope_theta``), e.g. Gemma 3's local
        layers use 10,000 while its global layers use 1,000,000.
    """

    window: int | None = None
    rope_theta: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "window", count(self.window, "LayerKind.window", optional=True))
        if self.rope_theta is not None and self.rope_theta <= 0:
            raise ValueError(f"LayerKind.rope_theta must be positive, got {self.rope_theta!r}")


def resolve_layer_plan(
    num_layers: int,
    layer_types: Sequence[str] | None = None,
    kinds: Mapping[str, LayerKind] | None = None,
) -> tuple[LayerKind, ...]:
    """One `LayerKind` per layer from ``layer_types`` and ``kinds`` (all full attention by default)."""
    known: dict[str, LayerKind | None] = {FULL_ATTENTION: LayerKind(), SLIDING_ATTENTION: None}
    for name, kind in dict(kinds or {}).items():
        if not isinstance(kind, LayerKind):
            raise TypeError(f"kinds[{name!r}] must be a LayerKind, got {type(kind).__name__}")
        known[name] = kind
    if known[SLIDING_ATTENTION] is not None and known[SLIDING_ATTENTION].window is None:
        raise ValueError(
            "the 'sliding_attention' kind needs a window: "
            "kinds={'sliding_attention': LayerKind(window=...)}"
        )
    if layer_types is None:
        layer_types = (FULL_ATTENTION,) * num_layers
    if isinstance(layer_types, str):
        raise TypeError(f"layer_types must be a sequence of names, one per layer, got the string {layer_types!r}")
    layer_types = tuple(layer_types)
    if len(layer_types) != num_layers:
        raise ValueError(
            f"layer_types names {len(layer_types)} layers but num_layers={num_layers}; give one name per layer"
        )
    plan = []
    for i, name in enumerate(layer_types):
        if name not in known:
            raise ValueError(
                f"layer {i} has unknown layer type {name!r}; valid types are "
                f"{sorted(known)} (define new ones in kinds=)"
            )
        kind = known[name]
        if kind is None:
            raise ValueError(
                f"layer {i} is 'sliding_attention' but no window is set: pass "
                "kinds={'sliding_attention': LayerKind(window=...)}"
            )
        plan.append(kind)
    return tuple(plan)


def resolve_mlp_plan(
    num_layers: int,
    mlp_layer_types: Sequence[str] | None = None,
    first_k_dense: int = 0,
    has_mixture: bool = False,
) -> tuple[str, ...]:
    """Each layer's feed-forward, "dense" or "mixture".

    Without a mixture every layer is dense. With one, ``mlp_layer_types`` names each layer's, or
    (when it is None) the first ``first_k_dense`` layers are dense and the others mixtures.
    """
    first_k_dense = count(first_k_dense, "first_k_dense", minimum=0)
    if mlp_layer_types is None:
        if not has_mixture:
            if first_k_dense:
                raise ValueError(f"first_k_dense={first_k_dense} needs mixture layers; set mixture= or leave it 0")
            return (DENSE_MLP,) * num_layers
        if first_k_dense > num_layers:
            raise ValueError(f"first_k_dense={first_k_dense} is more than num_layers={num_layers}")
        return (DENSE_MLP,) * first_k_dense + (MIXTURE_MLP,) * (num_layers - first_k_dense)
    if isinstance(mlp_layer_types, str):
        raise TypeError(
            f"mlp_layer_types must be a sequence of names, one per layer, got the string {mlp_layer_types!r}"
        )
    types = tuple(mlp_layer_types)
    if first_k_dense:
        raise ValueError("give either mlp_layer_types or first_k_dense, not both")
    if len(types) != num_layers:
        raise ValueError(
            f"mlp_layer_types names {len(types)} layers but num_layers={num_layers}; give one name per layer"
        )
    for i, name in enumerate(types):
        if name not in MLP_LAYER_TYPES:
            raise ValueError(f"layer {i} has unknown mlp layer type {name!r}; valid types are {list(MLP_LAYER_TYPES)}")
    if MIXTURE_MLP in types and not has_mixture:
        raise ValueError("mlp_layer_types names 'mixture' layers but no mixture is set; pass mixture={...}")
    return types
