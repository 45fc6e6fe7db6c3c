"""Captions as a diffusion condition, encoded inside the training step by a frozen text encoder.

`TextCondition(encoder, tokenizer, max_length, layer=, pooled=)` is a condition of an `InputSpec`:
the batch carries each caption as ``max_length`` token ids (`tokenize` makes them, so data loading
does the string work once), and `encode(ids)` turns them into what the backbones take by their
call convention:

    "text"       [B, L, D]  the encoder's last states, or with ``layer="penultimate"`` the output of
                            its second-to-last block (CLIP; what SD 2.x and SDXL condition on)
    "text_mask"  [B, L]     True up to and including the end-of-text token (with ``mask=True``,
                            which also masks padding inside the encoder)
    "embedding"  [B, D']    with ``pooled="pooled"`` or ``"projected"``: CLIP's pooled (or
                            projected) end-of-text state, for adaLN / pooled conditioning

A row dropped for classifier-free guidance is encoded from the empty caption's ids, so the
unconditional input is the empty prompt's encoding, as in Stable Diffusion.

The encoder's weights travel in the training state as the frozen collection named by `collection`
(``"<key>_encoder"``, from `frozen_variables`), not as constants baked into the compiled step: a
T5-XXL-sized encoder would otherwise inflate compile time and memory and could not be sharded. In
the state they are sharded by their logical axis names like any weights, get no gradient or
optimizer state, and checkpoints leave them out. `encode` without ``weights`` falls back to the
encoder's own variables (drawing samples outside a training step).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.core import meta

from dew.data.caption_tokens import CaptionTokens
from dew.objectives.base import Field

LAYERS = ("last", "penultimate")
POOLED = (None, "pooled", "projected")


class TextCondition:
    """A caption condition (see the module doc). ``encoder`` holds ``model`` and ``variables``
    (a `dew.interop.text_encoders.PretrainedTextEncoder`); ``tokenizer`` defaults to its own
    `CaptionTokens`, ``max_length`` to that tokenizer's. ``key`` names the batch column of ids."""

    def __init__(self, encoder: Any, tokenizer: Any = None, max_length: int | None = None, *,
                 layer: str = "last", pooled: str | None = None, mask: bool = False,
                 key: str = "caption", truncate: bool = True):
        if not hasattr(encoder, "model") or not hasattr(encoder, "variables"):
            raise TypeError(
                f"TextCondition needs an encoder holding `model` and `variables` (PretrainedTextEncoder."
                f"load(directory)); got {type(encoder).__name__}"
            )
        if layer not in LAYERS:
            raise ValueError(f"layer must be one of {LAYERS}; got {layer!r}")
        if pooled not in POOLED:
            raise ValueError(f"pooled must be one of {POOLED}; got {pooled!r}")
        clip_like = hasattr(encoder.model, "eos_token_id")  # only CLIP has a pooled state and layers to pick
        if (layer == "penultimate" or pooled is not None) and not clip_like:
            raise ValueError(
                f"layer={layer!r}, pooled={pooled!r} need a CLIP encoder; {type(encoder.model).__name__} "
                "returns its last states only (use layer='last', pooled=None)"
            )
        if pooled == "projected" and not getattr(encoder.model, "projection_dim", None):
            raise ValueError("pooled='projected' needs a CLIP encoder with a text projection; this one has none")
        tokenizer = tokenizer if tokenizer is not None else getattr(encoder, "tokens", None)
        if tokenizer is None:
            raise ValueError("TextCondition needs a tokenizer: the encoder directory had no tokenizer.json; pass tokenizer=")
        if not isinstance(tokenizer, CaptionTokens) or (max_length is not None and max_length != tokenizer.max_length):
            base = tokenizer.tokenizer if isinstance(tokenizer, CaptionTokens) else tokenizer
            length = max_length or (tokenizer.max_length if isinstance(tokenizer, CaptionTokens) else None)
            if length is None:
                raise ValueError("TextCondition needs max_length= (the caption length in tokens) with this tokenizer")
            tokenizer = CaptionTokens(base, length, truncate=truncate)
        self.encoder = encoder
        self.tokens = tokenizer
        self.layer = layer
        self.pooled = pooled
        self.mask = mask
        self.field = Field(key, (tokenizer.max_length,), np.int32)
        self.eos_id = tokenizer.tokenizer.eos_id
        empty, _ = tokenizer([""])
        self.unconditional_ids = jnp.asarray(empty[0])

    # --- the Field an InputSpec checks ----------------------------------------------------------

    @property
    def key(self) -> str:
        return self.field.key

    @property
    def shape(self) -> tuple[int, ...]:
        return self.field.shape

    @property
    def dtype(self) -> Any:
        return self.field.dtype

    def check(self, array: Any, batch: int | None = None) -> None:
        if np.asarray(array).dtype.kind in "OUS":
            raise ValueError(
                f"Batch field {self.key!r} holds strings; the step reads token ids. Tokenize the captions "
                "when loading (TextCondition.tokenize(texts)) so the column is int32 "
                f"[batch, {self.shape[0]}]."
            )
        self.field.check(array, batch)

    # --- captions -> conditions -----------------------------------------------------------------

    def tokenize(self, texts: Sequence[str]) -> np.ndarray:
        """Captions -> int32 ids [len(texts), max_length], the column the batch carries."""
        return self.tokens(texts)[0]

    def token_mask(self, ids: jax.Array) -> jax.Array:
        """True for each position up to and including the first end-of-text token (the rest is padding)."""
        if self.eos_id is None:
            return jnp.ones(ids.shape, bool)
        seen = jnp.cumsum(ids == self.eos_id, axis=-1)
        return (seen == 0) | ((seen == 1) & (ids == self.eos_id))

    # --- the encoder's weights as a frozen collection of the training state ---------------------

    @property
    def collection(self) -> str:
        """The variable collection that holds the encoder's weights in a training state."""
        return f"{self.key}_encoder"

    def frozen_variables(self, weights: Any = None) -> Any:
        """The encoder's variables (``weights``, or its own) boxed with their logical axis names, so
        a trainer shards them like the model's weights."""
        weights = self.encoder.variables if weights is None else weights
        abstract = jax.eval_shape(self.encoder.model.init, jax.random.key(0), jax.ShapeDtypeStruct((1,) + self.shape, jnp.int32))
        boxed = lambda box, value: box.replace_boxed(value) if isinstance(box, meta.AxisMetadata) else value  # noqa: E731
        return jax.tree.map(boxed, abstract, dict(weights), is_leaf=lambda leaf: isinstance(leaf, meta.AxisMetadata))

    # --- ids -> conditions ---------------------------------------------------------------------

    def encode(self, ids: jax.Array, drop: jax.Array | None = None, weights: Any = None) -> dict[str, jax.Array]:
        """The conditions for ids [B, L]; rows where ``drop`` [B] is True read the empty caption.

        ``weights`` are the encoder's variables from the training state (its `collection`); without
        them the encoder's own variables are used, as constants of whatever traces this.
        """
        ids = jnp.asarray(ids, jnp.int32)
        if drop is not None:
            ids = jnp.where(drop[:, None], self.unconditional_ids[None, :], ids)
        mask = self.token_mask(ids)
        weights = self.encoder.variables if weights is None else weights
        out = self.encoder.model.apply(weights, ids, mask.astype(jnp.int32) if self.mask else None)
        out = jax.tree.map(jax.lax.stop_gradient, out)
        states = out if isinstance(out, jax.Array) else (out.penultimate if self.layer == "penultimate" else out.last)
        conditions = {"text": states}
        if self.mask:
            conditions["text_mask"] = mask
        if self.pooled is not None:
            conditions["embedding"] = getattr(out, self.pooled)
        return conditions

    def encode_texts(self, texts: Sequence[str]) -> dict[str, jax.Array]:
        """Prompts (None for the empty caption) -> conditions, for drawing samples."""
        texts = ["" if text is None else text for text in texts]
        return self.encode(jnp.asarray(self.tokenize(texts)))

    def examples(self, rows: int) -> dict[str, jax.ShapeDtypeStruct]:
        """Shapes of the conditions for ``rows`` captions, without running the encoder."""
        return jax.eval_shape(self.encode, jax.ShapeDtypeStruct((rows,) + self.shape, jnp.int32))

    def __repr__(self) -> str:
        return (f"TextCondition({type(self.encoder.model).__name__}, {self.tokens!r}, layer={self.layer!r}, "
                f"pooled={self.pooled!r}, mask={self.mask}, key={self.key!r})")
