"""Which kind of attention each decoder layer runs.

A decoder's layer pattern is configuration: ``layer_types`` names each layer's kind (as in Hugging
Face's ``config.layer_types``) and ``kinds`` says what a kind does. Two kinds are built in:
"full_attention" (every earlier key) and "sliding_attention" (the last ``window`` keys, the
query's own included), which has no default window, so ``kinds`` must give it one. Other names
may be defined in ``kinds``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dew.checks import count

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
BUILTIN_LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


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
