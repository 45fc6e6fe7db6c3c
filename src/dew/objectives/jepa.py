"""JEPA: learn an encoder by predicting, in representation space, the target blocks of an image
(I-JEPA, Assran et al. 2023, arXiv:2301.08243) or video clip (V-JEPA, Bardes et al. 2024).

One step:
    mask      = MultiBlockMask.sample(key)          context indices [B, Nc], target indices [B, M, Nt]
    h         = LayerNorm(target_encoder(x))        the full image, no gradient (an EMA copy)
    z         = context_encoder(x, keep=context)    only the context tokens
    loss      = smooth_l1(predictor(z, context, targets), h[targets])
    after the optimizer update: target <- m * target + (1 - m) * context_encoder,
    m rising linearly from momentum[0] to momentum[1] over momentum_steps.

The target encoder's weights live in variables["target"], a non-param collection: the optimizer
never sees them, they travel in the TrainState and are checkpointed with it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew.checks import count
from dew.eval.probes import KnnProbe, LinearProbe, effective_rank, feature_std
from dew.nn.backbones.jepa import JepaEncoder, JepaPredictor, gather_tokens
from dew.objectives.base import Aux, Field, InputSpec, Objective, Step, Variables
from dew.pixels import to_unit_range

__all__ = [
    "JepaEncoder",
    "JepaObjective",
    "JepaPredictor",
    "KnnProbe",
    "LinearProbe",
    "MaskIndices",
    "MultiBlockMask",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MaskIndices:
    """Token indices of one batch's masks: context [B, Nc] and targets [B, M, Nt], each row sorted."""

    context: jax.Array
    targets: jax.Array


def _pair(value, name: str, low: float, high: float) -> tuple[float, float]:
    try:
        a, b = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"MultiBlockMask {name} must be a (low, high) pair; got {value!r}.") from None
    if not (low <= a <= b <= high) or a <= 0:
        raise ValueError(f"MultiBlockMask {name} must satisfy 0 < low <= high <= {high}; got {value!r}.")
    return a, b


@dataclasses.dataclass(frozen=True)
class MultiBlockMask:
    """I-JEPA's multi-block masking with fixed token counts, sampled per example from a key.

    Each example gets `num_targets` target blocks (area `scale` of the grid, aspect ratio `aspect`
    = height / width, both uniform in their ranges) and one square context block (area
    `context_scale`) with every target token removed. Shapes are static, so the jitted step never
    recompiles:

    * each target block keeps exactly `target_tokens` = floor(scale[0] * grid tokens) tokens: a
      block that would be smaller is widened (then heightened) until it holds that many, and a
      larger one keeps its first tokens in raster order (I-JEPA's collator trims to the smallest
      block of the batch the same way);
    * the context keeps exactly `context_tokens` = floor(context_scale[0] * N * (1 - M * Nt / N))
      tokens, the expected size of the smallest context block after the targets are removed. They
      are drawn at random from the context block's free tokens; when the block has too few, free
      tokens outside it fill the rest. Context and target never share a token.

    A 3-axis grid (frames, height, width) gives the tube variant for video (V-JEPA): the spatial
    masks are sampled on (height, width) and repeated through every frame.
    """

    grid: tuple[int, ...]
    num_targets: int = 4
    scale: tuple[float, float] = (0.15, 0.2)
    aspect: tuple[float, float] = (0.75, 1.5)
    context_scale: tuple[float, float] = (0.85, 1.0)

    def __post_init__(self):
        grid = tuple(self.grid) if isinstance(self.grid, Sequence) else (self.grid,)
        if len(grid) not in (2, 3):
            raise ValueError(
                f"MultiBlockMask grid must be (height, width) or (frames, height, width) in tokens; "
                f"got {self.grid!r}."
            )
        object.__setattr__(self, "grid", tuple(count(g, "MultiBlockMask.grid entry") for g in grid))
        object.__setattr__(self, "num_targets", count(self.num_targets, "MultiBlockMask.num_targets"))
        object.__setattr__(self, "scale", _pair(self.scale, "scale", 0.0, 1.0))
        object.__setattr__(self, "aspect", _pair(self.aspect, "aspect", 0.0, math.inf))
        object.__setattr__(self, "context_scale", _pair(self.context_scale, "context_scale", 0.0, 1.0))
        n, free = self.spatial_tokens, self.spatial_tokens - self.num_targets * self._block_tokens
        if free < 1 or self._context_block_tokens < 1:
            raise ValueError(
                f"MultiBlockMask leaves no context: {self.num_targets} target block(s) of "
                f"{self._block_tokens} tokens (scale {self.scale[0]} of {n}) take "
                f"{n - max(free, 0)} of the grid's {n} tokens. Lower scale or num_targets."
            )

    @classmethod
    def for_grid(
        cls,
        grid: Sequence[int],
        num_targets: int = 4,
        scale: tuple[float, float] = (0.15, 0.2),
        aspect: tuple[float, float] = (0.75, 1.5),
        context_scale: tuple[float, float] = (0.85, 1.0),
    ) -> MultiBlockMask:
        """The mask for a token grid: (height, width) for images, (frames, height, width) for tubes."""
        return cls(tuple(grid), num_targets, scale, aspect, context_scale)

    # ---- fixed counts, computed from the grid and the scales ----

    @property
    def tube(self) -> bool:
        """True for a video grid: the same spatial mask in every frame."""
        return len(self.grid) == 3

    @property
    def frames(self) -> int:
        return self.grid[0] if self.tube else 1

    @property
    def spatial_grid(self) -> tuple[int, int]:
        return self.grid[-2:]

    @property
    def spatial_tokens(self) -> int:
        return self.grid[-2] * self.grid[-1]

    @property
    def _block_tokens(self) -> int:
        return max(1, int(self.scale[0] * self.spatial_tokens + 1e-9))

    @property
    def _context_block_tokens(self) -> int:
        n = self.spatial_tokens
        free = n - self.num_targets * self._block_tokens
        expected = int(self.context_scale[0] * n * free / n + 1e-9)
        return min(expected, free)

    @property
    def target_tokens(self) -> int:
        """Tokens per target block (times the frames for a tube)."""
        return self._block_tokens * self.frames

    @property
    def context_tokens(self) -> int:
        """Tokens in the context (times the frames for a tube)."""
        return self._context_block_tokens * self.frames

    # ---- sampling ----

    def sample(self, key: jax.Array, batch: int) -> MaskIndices:
        """Draw masks for `batch` examples, each from its own key; jit-friendly."""
        context, targets = jax.vmap(self._sample_one)(jax.random.split(key, batch))
        if self.tube:  # repeat the spatial mask through time: token t * H * W + s
            offsets = jnp.arange(self.frames, dtype=jnp.int32) * self.spatial_tokens

            def through_time(index):
                return (offsets[:, None] + index[..., None, :]).reshape(index.shape[:-1] + (-1,))

            context, targets = through_time(context), through_time(targets)
        return MaskIndices(context=context, targets=targets)

    def _block(self, key, scale, aspect, min_tokens):
        """A boolean [H, W] block of random area fraction `scale`, aspect ratio `aspect`, and
        random position, holding at least `min_tokens` tokens."""
        height, width = self.spatial_grid
        k_scale, k_aspect, k_top, k_left = jax.random.split(key, 4)
        area = jax.random.uniform(k_scale, minval=scale[0], maxval=scale[1]) * self.spatial_tokens
        ratio = jax.random.uniform(k_aspect, minval=aspect[0], maxval=aspect[1])
        h = jnp.clip(jnp.round(jnp.sqrt(area * ratio)), 1, height).astype(jnp.int32)
        w = jnp.clip(jnp.round(jnp.sqrt(area / ratio)), 1, width).astype(jnp.int32)
        w = jnp.clip(jnp.maximum(w, -(-min_tokens // h)), 1, width)  # ceil division
        h = jnp.clip(jnp.maximum(h, -(-min_tokens // w)), 1, height)
        top = jax.random.randint(k_top, (), 0, height - h + 1)
        left = jax.random.randint(k_left, (), 0, width - w + 1)
        rows = jnp.arange(height)[:, None]
        cols = jnp.arange(width)[None, :]
        return (rows >= top) & (rows < top + h) & (cols >= left) & (cols < left + w)

    def _sample_one(self, key):
        n, block_tokens = self.spatial_tokens, self._block_tokens
        keys = jax.random.split(key, self.num_targets + 2)
        taken = jnp.zeros((n,), bool)
        targets = []
        for m in range(self.num_targets):
            block = self._block(keys[m], self.scale, self.aspect, block_tokens).reshape(n)
            chosen = block & (jnp.cumsum(block) <= block_tokens)  # the block's first `block_tokens`
            targets.append(jnp.sort(jnp.argsort(~chosen, stable=True)[:block_tokens]))
            taken = taken | chosen
        context_block = self._block(keys[-2], self.context_scale, (1.0, 1.0), 0).reshape(n)
        # free tokens inside the context block first, then free tokens outside, random order
        # within each; target tokens never
        priority = jax.random.uniform(keys[-1], (n,)) + context_block.astype(jnp.float32)
        priority = jnp.where(taken, -1.0, priority)
        _, context = jax.lax.top_k(priority, self._context_block_tokens)
        return jnp.sort(context).astype(jnp.int32), jnp.stack(targets).astype(jnp.int32)


class JepaObjective(Objective):
    """I-JEPA / V-JEPA: predict the EMA target encoder's representations of masked blocks.

    `sample` names the batch field and one example's shape ([H, W, C] images, [T, H, W, C] clips
    with an encoder `tubelet_size`); values are uint8 and mapped to [-1, 1]. The target encoder's
    momentum rises linearly from `momentum[0]` to `momentum[1]` over `momentum_steps` updates
    (None keeps it at `momentum[0]`). `loss` is "smooth_l1" (I-JEPA) or "l2". `evaluate` returns
    the average-pooled target-encoder features as "features" and passes `label_key` through as
    "label" when the batch has it, for KnnProbe and LinearProbe.
    """

    no_task_hint = (
        "its product is the encoder: read its weights with Checkpoints(run).restore_variables() and "
        "score or use its features with KnnProbe / LinearProbe (dew.eval.probes)"
    )

    def __init__(
        self,
        encoder: JepaEncoder,
        predictor: JepaPredictor,
        *,
        mask: MultiBlockMask,
        sample: Field = Field("image", (224, 224, 3)),
        momentum: tuple[float, float] = (0.996, 1.0),
        momentum_steps: int | None = None,
        loss: str = "smooth_l1",
        label_key: str = "label",
    ):
        if not isinstance(encoder, JepaEncoder):
            raise TypeError(f"encoder must be a JepaEncoder; got {type(encoder).__name__}.")
        if not isinstance(predictor, JepaPredictor):
            raise TypeError(f"predictor must be a JepaPredictor; got {type(predictor).__name__}.")
        if not isinstance(mask, MultiBlockMask):
            raise TypeError(f"mask must be a MultiBlockMask; got {type(mask).__name__}.")
        if not isinstance(sample, Field) or any(d is None for d in sample.shape):
            raise ValueError(f"sample must be a Field with a fixed example shape; got {sample!r}.")
        grid = encoder.grid(sample.shape)  # raises when the shape does not fit the patches
        if mask.grid != grid:
            raise ValueError(
                f"The mask's token grid {mask.grid} does not match the encoder's: {sample.key!r} "
                f"examples of shape {sample.shape} with patch_size={encoder.patch_size}"
                + (f", tubelet_size={encoder.tubelet_size}" if encoder.tubelet_size else "")
                + f" give {grid}. Build the mask with MultiBlockMask.for_grid({grid}, ...)."
            )
        if predictor.grid != grid:
            raise ValueError(f"JepaPredictor grid {predictor.grid} does not match the encoder's token grid {grid}.")
        if predictor.emb_features != encoder.emb_features:
            raise ValueError(
                f"JepaPredictor emb_features ({predictor.emb_features}) must equal the encoder's "
                f"({encoder.emb_features}): it predicts the encoder's representations."
            )
        low, high = (float(m) for m in momentum)
        if not 0.0 <= low <= 1.0 or not 0.0 <= high <= 1.0:
            raise ValueError(f"momentum must be a (start, end) pair in [0, 1]; got {momentum!r}.")
        momentum_steps = count(momentum_steps, "JepaObjective.momentum_steps", optional=True)
        if loss not in ("smooth_l1", "l2"):
            raise ValueError(f"loss must be 'smooth_l1' or 'l2'; got {loss!r}.")
        self.encoder = encoder
        self.predictor = predictor
        self.mask = mask
        self.sample = sample
        self.inputs = InputSpec(sample)
        self.momentum = (low, high)
        self.momentum_steps = momentum_steps
        self.loss_kind = loss
        self.label_key = label_key

    # ---- setup ----

    def init(self, key: jax.Array, variables: Variables | None = None) -> Variables:
        """{"params": {"encoder", "predictor"}, "target": a copy of the encoder's params}."""
        if variables is not None:
            if "target" in variables:
                return dict(variables)
            return {**variables, "target": jax.tree_util.tree_map(jnp.copy, variables["params"]["encoder"])}
        k_encoder, k_predictor = jax.random.split(key)
        x = jnp.zeros((1,) + tuple(self.sample.shape), jnp.float32)
        encoder = self.encoder.init(k_encoder, x)["params"]
        indices = self.mask.sample(jax.random.fold_in(key, 2), 1)  # only its shapes reach the predictor
        context = jnp.zeros((1, self.mask.context_tokens, self.encoder.emb_features), jnp.float32)
        predictor = self.predictor.init(k_predictor, context, indices.context, indices.targets)["params"]
        return {
            "params": {"encoder": encoder, "predictor": predictor},
            "target": jax.tree_util.tree_map(jnp.copy, encoder),
        }

    def check(self, batch: Mapping[str, Any]) -> None:
        super().check(batch)
        dtype = np.asarray(batch[self.sample.key]).dtype
        if dtype != np.uint8:
            raise ValueError(
                f"Batch field {self.sample.key!r} has dtype {dtype}; JepaObjective expects uint8 "
                "pixels in [0, 255] (it maps them to [-1, 1]). Convert with .astype(np.uint8)."
            )

    # ---- the schedule and the EMA ----

    def momentum_at(self, step: Any) -> jax.Array:
        """The target momentum for the update that follows step `step` (0 for the first)."""
        low, high = self.momentum
        if self.momentum_steps is None:
            return jnp.asarray(low, jnp.float32)
        progress = jnp.minimum(jnp.asarray(step, jnp.float32) / self.momentum_steps, 1.0)
        return jnp.asarray(low, jnp.float32) + progress * (high - low)

    def after_update(self, variables: Variables, step: Step) -> Variables:
        m = self.momentum_at(step.step)
        target = jax.tree_util.tree_map(
            lambda t, p: (m * t + (1.0 - m) * p.astype(t.dtype)).astype(t.dtype),
            variables["target"],
            variables["params"]["encoder"],
        )
        return {**variables, "target": target}

    # ---- the loss ----

    def _pixels(self, batch) -> jax.Array:
        return to_unit_range(batch[self.sample.key])

    def _targets(self, variables, x):
        """The target encoder's tokens on the whole input, without gradient."""
        target_params = jax.lax.stop_gradient(variables["target"])
        return jax.lax.stop_gradient(self.encoder.apply({"params": target_params}, x))

    def _forward(self, variables, batch, step: Step):
        x = self._pixels(batch)
        masks = self.mask.sample(jax.random.fold_in(step.key, 0), x.shape[0])
        tokens = self._targets(variables, x)
        normed = _layer_norm(tokens)  # I-JEPA: F.layer_norm over features, no affine
        goal = gather_tokens(normed, masks.targets)  # [B, M, Nt, D]
        params = variables["params"]
        context = self.encoder.apply({"params": params["encoder"]}, x, keep=masks.context)
        predicted = self.predictor.apply({"params": params["predictor"]}, context, masks.context, masks.targets)
        error = predicted.astype(jnp.float32) - goal
        if self.loss_kind == "smooth_l1":  # torch's smooth_l1_loss with beta = 1
            elementwise = jnp.where(jnp.abs(error) < 1.0, 0.5 * error**2, jnp.abs(error) - 0.5)
        else:
            elementwise = error**2
        pooled = jnp.mean(tokens, axis=1)
        metrics = {
            "target_std": feature_std(pooled),
            "effective_rank": effective_rank(pooled),
        }
        return jnp.mean(elementwise), metrics, pooled

    def loss(self, variables: Variables, batch, step: Step):
        loss, metrics, _ = self._forward(variables, batch, step)
        return loss, Aux(metrics=metrics)

    def evaluate(self, variables: Variables, batch, step: Step):
        loss, metrics, pooled = self._forward(variables, batch, step)
        outputs = {"loss": loss, **metrics, "features": pooled}
        if self.label_key in batch:
            outputs["label"] = batch[self.label_key]
        return outputs

    def features(self, variables: Variables, images: jax.Array) -> jax.Array:
        """Average-pooled target-encoder features [B, D] of uint8 inputs (for probes)."""
        return jnp.mean(self._targets(variables, self._pixels({self.sample.key: images})), axis=1)


def _layer_norm(x: jax.Array, eps: float = 1e-5) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    variance = jnp.var(x, axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(variance + eps)
