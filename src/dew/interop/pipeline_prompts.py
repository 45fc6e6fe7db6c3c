"""Prompts -> the conditions a published denoiser reads, as each diffusers pipeline's `encode_prompt`.

One class per pipeline family. Each is a text condition of `dew.inference.image.TextToImage`:
`encode_texts(entries)` takes prompts (None: the unconditional branch of classifier-free
guidance) and returns the denoiser's conditions keyed by the diffusers forward arguments.

    StableDiffusionPrompts  SD 1.x / 2.x   encoder_hidden_states = CLIP's last states
    SDXLPrompts             SDXL, refiner  encoder_hidden_states = both CLIPs' penultimate states
                                           side by side on features; text_embeds = the second
                                           CLIP's projected pooled state; time_ids = original
                                           size + crop corner + target size (refiner: + aesthetic
                                           score instead of the target size)
    SD3Prompts              SD3 / 3.5      encoder_hidden_states = [CLIP-L | CLIP-G penultimate,
                                           zero-padded to T5's width ; T5 states] along the
                                           sequence; pooled_projections = both projected pooled
    FluxPrompts             Flux           encoder_hidden_states = T5 states; pooled_projections =
                                           CLIP's pooled state; guidance (guidance-distilled models)

The unconditional rows follow the pipelines when no negative prompt is given: the encoding of
the empty prompt "", except SDXL with ``force_zeros_for_empty_prompt``, where the states and the
pooled embedding are zeros (and the refiner's time ids carry the negative aesthetic score).
An explicit "" is always encoded as text, as diffusers encodes ``prompt=""``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from dew.checks import count


@functools.partial(jax.jit, static_argnums=0)
def _apply(model: Any, variables: Any, ids: jax.Array) -> Any:
    return model.apply(variables, ids)


def _texts(entries: Sequence[str | None]) -> tuple[list[str], jax.Array]:
    """Prompts with None read as "", and a [B] mask of the None (unconditional) rows."""
    entries = list(entries)
    if not entries or not all(entry is None or isinstance(entry, str) for entry in entries):
        raise TypeError(
            f"encode_texts takes a non-empty sequence of prompts (str, or None for unconditional); got {entries!r}"
        )
    return ["" if entry is None else entry for entry in entries], jnp.asarray([entry is None for entry in entries])


def _encode(encoder: Any, texts: list[str]) -> Any:
    """One encoder's output for prompts tokenized by its own `CaptionTokens` (no attention mask,
    as every diffusers pipeline calls its text encoders)."""
    ids, _ = encoder.tokens(texts)
    return _apply(encoder.model, encoder.variables, jnp.asarray(ids))


def _require(encoder: Any, what: str, *, projection: bool = False) -> None:
    if encoder.tokens is None:
        raise ValueError(f"the {what} encoder has no tokenizer; load it with its pipeline's tokenizer folder")
    if projection and not getattr(encoder.model, "projection_dim", None):
        raise ValueError(
            f"the {what} encoder has no text projection, but this pipeline reads its projected pooled state "
            "(a CLIPTextModelWithProjection checkpoint holds text_projection.weight)"
        )


class StableDiffusionPrompts:
    """SD 1.x / 2.x: the CLIP text encoder's last hidden states (`StableDiffusionPipeline.encode_prompt`)."""

    def __init__(self, text_encoder: Any):
        _require(text_encoder, "text_encoder")
        self.text_encoder = text_encoder

    def encode_texts(self, entries: Sequence[str | None]) -> dict[str, jax.Array]:
        texts, _ = _texts(entries)
        return {"encoder_hidden_states": _encode(self.text_encoder, texts).last}


class SDXLPrompts:
    """SDXL (both encoders) and its refiner (``text_encoder=None``: the second encoder only).

    ``original_size``, ``crops_coords_top_left`` and ``target_size`` are (height, width) pairs in
    pixels; with ``aesthetic_score`` set (the refiner's ``requires_aesthetics_score``) the time ids
    end with it instead of the target size, and unconditional rows with ``negative_aesthetic_score``.
    """

    def __init__(self, text_encoder: Any, text_encoder_2: Any, *, force_zeros_for_empty_prompt: bool = True,
                 original_size: tuple[int, int] = (1024, 1024), crops_coords_top_left: tuple[int, int] = (0, 0),
                 target_size: tuple[int, int] | None = None, aesthetic_score: float | None = None,
                 negative_aesthetic_score: float = 2.5):
        if text_encoder is not None:
            _require(text_encoder, "text_encoder")
        _require(text_encoder_2, "text_encoder_2", projection=True)
        self.text_encoder = text_encoder
        self.text_encoder_2 = text_encoder_2
        self.force_zeros_for_empty_prompt = bool(force_zeros_for_empty_prompt)
        self.original_size = _pair(original_size, "original_size")
        self.crops_coords_top_left = _pair(crops_coords_top_left, "crops_coords_top_left", minimum=0)
        self.target_size = _pair(target_size or original_size, "target_size")
        self.aesthetic_score = aesthetic_score
        self.negative_aesthetic_score = negative_aesthetic_score

    def time_ids(self, unconditional: jax.Array) -> jax.Array:
        """[B, 6] (or [B, 5] with an aesthetic score): the size and crop conditions of each row."""
        head = self.original_size + self.crops_coords_top_left
        if self.aesthetic_score is None:
            ids = jnp.asarray(head + self.target_size, jnp.float32)
            return jnp.broadcast_to(ids, (unconditional.shape[0], ids.shape[0]))
        score = jnp.where(unconditional, self.negative_aesthetic_score, self.aesthetic_score)
        head = jnp.broadcast_to(jnp.asarray(head, jnp.float32), (unconditional.shape[0], len(head)))
        return jnp.concatenate([head, score[:, None].astype(jnp.float32)], axis=-1)

    def encode_texts(self, entries: Sequence[str | None]) -> dict[str, jax.Array]:
        texts, unconditional = _texts(entries)
        encoders = [encoder for encoder in (self.text_encoder, self.text_encoder_2) if encoder is not None]
        outputs = [_encode(encoder, texts) for encoder in encoders]
        states = jnp.concatenate([output.penultimate for output in outputs], axis=-1)
        pooled = outputs[-1].projected
        if self.force_zeros_for_empty_prompt:
            states = jnp.where(unconditional[:, None, None], 0.0, states)
            pooled = jnp.where(unconditional[:, None], 0.0, pooled)
        return {"encoder_hidden_states": states, "text_embeds": pooled, "time_ids": self.time_ids(unconditional)}


class SD3Prompts:
    """SD3 / 3.5: two CLIPs and T5 (`StableDiffusion3Pipeline.encode_prompt`).

    Without a T5 encoder (``text_encoder_3=None``, as the pipeline allows) its states are zeros of
    ``joint_attention_dim`` features, the transformer's text width.
    """

    def __init__(self, text_encoder: Any, text_encoder_2: Any, text_encoder_3: Any, *,
                 max_sequence_length: int = 256, joint_attention_dim: int | None = None):
        _require(text_encoder, "text_encoder", projection=True)
        _require(text_encoder_2, "text_encoder_2", projection=True)
        if text_encoder_3 is not None:
            _require(text_encoder_3, "text_encoder_3")
        elif joint_attention_dim is None:
            raise ValueError("SD3Prompts without a T5 encoder needs joint_attention_dim= (the transformer's text width)")
        self.text_encoder = text_encoder
        self.text_encoder_2 = text_encoder_2
        self.text_encoder_3 = text_encoder_3
        self.max_sequence_length = count(max_sequence_length, "max_sequence_length")
        self.joint_attention_dim = joint_attention_dim
        if text_encoder_3 is not None and text_encoder_3.tokens.max_length != self.max_sequence_length:
            raise ValueError(
                f"text_encoder_3's tokenizer pads to {text_encoder_3.tokens.max_length} tokens, not "
                f"max_sequence_length={max_sequence_length}; load it with max_length={max_sequence_length}"
            )

    def encode_texts(self, entries: Sequence[str | None]) -> dict[str, jax.Array]:
        texts, _ = _texts(entries)
        clip_l = _encode(self.text_encoder, texts)
        clip_g = _encode(self.text_encoder_2, texts)
        if self.text_encoder_3 is not None:
            t5 = _encode(self.text_encoder_3, texts)
        else:
            t5 = jnp.zeros((len(texts), self.max_sequence_length, self.joint_attention_dim), clip_l.last.dtype)
        clip = jnp.concatenate([clip_l.penultimate, clip_g.penultimate], axis=-1)
        if clip.shape[-1] > t5.shape[-1]:
            raise ValueError(f"the CLIP states ({clip.shape[-1]} features) are wider than T5's ({t5.shape[-1]}); "
                             "SD3 pads the CLIP states up to T5's width")
        clip = jnp.pad(clip, ((0, 0), (0, 0), (0, t5.shape[-1] - clip.shape[-1])))
        return {"encoder_hidden_states": jnp.concatenate([clip, t5], axis=1),
                "pooled_projections": jnp.concatenate([clip_l.projected, clip_g.projected], axis=-1)}


class FluxPrompts:
    """Flux: CLIP's pooled state and T5's states (`FluxPipeline.encode_prompt`). ``guidance`` (the
    scale a guidance-distilled model such as FLUX.1-dev reads; None for one without guidance
    embeddings) is handed to the transformer as ``"guidance"`` [B]."""

    def __init__(self, text_encoder: Any, text_encoder_2: Any, *, max_sequence_length: int = 512,
                 guidance: float | None = None):
        _require(text_encoder, "text_encoder")
        _require(text_encoder_2, "text_encoder_2")
        self.text_encoder = text_encoder
        self.text_encoder_2 = text_encoder_2
        self.max_sequence_length = count(max_sequence_length, "max_sequence_length")
        self.guidance = guidance
        if text_encoder_2.tokens.max_length != self.max_sequence_length:
            raise ValueError(
                f"text_encoder_2's tokenizer pads to {text_encoder_2.tokens.max_length} tokens, not "
                f"max_sequence_length={max_sequence_length}; load it with max_length={max_sequence_length}"
            )

    def encode_texts(self, entries: Sequence[str | None]) -> dict[str, jax.Array]:
        texts, _ = _texts(entries)
        conditions = {"encoder_hidden_states": _encode(self.text_encoder_2, texts),
                      "pooled_projections": _encode(self.text_encoder, texts).pooled}
        if self.guidance is not None:
            conditions["guidance"] = jnp.full((len(texts),), self.guidance, jnp.float32)
        return conditions


def _pair(value: Any, name: str, *, minimum: int = 1) -> tuple[int, int]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"{name} must be a (height, width) pair; got {value!r}")
    return (count(value[0], name, minimum=minimum), count(value[1], name, minimum=minimum))
