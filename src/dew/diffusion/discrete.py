"""Masked (absorbing-state) diffusion over tokens: MDLM (Sahoo et al. 2024).

The forward process replaces each token by the mask id independently, with probability
1 - alpha_t at time t in [0, 1]. MDLM's log-linear schedule makes that probability linear in t:

    alpha_t = 1 - (1 - eps) t          (sigma(t) = -log(1 - (1 - eps) t), the "total noise")

The model sees the partly masked row z_t and predicts the clean token at every position; the
SUBS parameterization gives the mask id zero probability and scores only masked positions. The
continuous-time negative ELBO per sequence is

    NELBO = E_t [ -alpha'_t / (1 - alpha_t) * sum_{masked l} -log p(x_l | z_t) ]

and with this schedule -alpha'_t / (1 - alpha_t) = 1 / t. The loss divides by the row length,
so exp of it is an upper bound on the model's perplexity per token.

Sampling runs time backwards on a grid 1 = t_0 > ... > t_S = 0: from t to s, each masked position
is revealed with probability (alpha_s - alpha_t) / (1 - alpha_t), drawing its token from the
model; revealed tokens stay. At s = 0 that probability is 1, so nothing stays masked.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew.checks import count
from dew.data.tokens import prompt_rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MaskedSample:
    """What `MaskedDiffusion.generate` returns: `tokens [rows, length]`, the tokens after each
    prompt (none of them the mask id), and `lengths [rows]` (all `length`)."""

    tokens: jax.Array
    lengths: jax.Array

    def host(self) -> "MaskedSample":
        return jax.tree_util.tree_map(np.asarray, self)


@dataclasses.dataclass(frozen=True)
class MaskedDiffusion:
    """The MDLM process: log-linear masking schedule, ELBO weights, and the reverse sampler."""

    mask_id: int
    eps: float = 1e-3

    # --- the schedule ---------------------------------------------------------------------------

    def alpha(self, t):
        """The probability a token is still clean at time t."""
        return 1.0 - (1.0 - self.eps) * t

    def mask_probability(self, t):
        return 1.0 - self.alpha(t)

    def weight(self, t):
        """The ELBO's weight of the masked tokens' cross-entropy at time t: -alpha'_t / (1 - alpha_t)."""
        return (1.0 - self.eps) / self.mask_probability(t)

    def sample_times(self, key, rows: int):
        """t in [eps, 1], stratified over the batch (MDLM's low-discrepancy sampler): less variance."""
        u = jax.random.uniform(key, ())
        t = jnp.mod(u + jnp.arange(rows, dtype=jnp.float32) / rows, 1.0)
        return self.eps + (1.0 - self.eps) * t

    # --- training -------------------------------------------------------------------------------

    def corrupt(self, key, tokens, t):
        """`(z_t, masked)`: tokens with each replaced by the mask id with probability 1 - alpha_t."""
        p = self.mask_probability(t)[:, None]
        masked = jax.random.uniform(key, tokens.shape) < p
        return jnp.where(masked, self.mask_id, tokens), masked

    def subs_log_probs(self, logits):
        """SUBS: log-probabilities over clean tokens, the mask id excluded."""
        logits = logits.astype(jnp.float32)
        logits = logits.at[..., self.mask_id].set(-jnp.inf)
        return jax.nn.log_softmax(logits, axis=-1)

    def token_losses(self, logits, tokens, masked, t):
        """The weighted negative ELBO of each position `[rows, length]` (0 where unmasked)."""
        log_probs = self.subs_log_probs(logits)
        nll = -jnp.take_along_axis(log_probs, tokens[..., None], axis=-1)[..., 0]
        return jnp.where(masked, nll, 0.0) * self.weight(t)[:, None]

    # --- sampling -------------------------------------------------------------------------------

    def generate(self, model, variables, prompts, length: int, *, key, steps: int = 64,
                 temperature: float = 1.0) -> MaskedSample:
        """Continue each prompt by exactly `length` tokens, unmasked over `steps` reverse steps.

        `prompts` is a list of token-id lists (ragged is fine) or a `[batch, length]` array. Rows
        are laid out as prompt, then `length` masked slots; shorter rows are padded at the end in
        a segment of their own, so a bidirectional model never attends to padding.
        """

        length, steps = count(length, "length"), count(steps, "steps")
        if not temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 takes the most likely token); got {temperature}.")
        vocab = getattr(model, "vocab_size", None)
        if vocab is not None and self.mask_id >= vocab:
            raise ValueError(
                f"mask_id={self.mask_id} is outside the model's vocabulary of {vocab} ids; build the "
                f"model with vocab_size={self.mask_id + 1} (or more)."
            )
        rows = prompt_rows(prompts)
        for index, row in enumerate(rows):
            if vocab is not None and (row.min() < 0 or row.max() >= vocab):
                raise ValueError(f"prompt {index} holds ids outside [0, {vocab}).")
            if (row == self.mask_id).any():
                raise ValueError(f"prompt {index} contains the mask id {self.mask_id}; prompts must be clean tokens.")
        lengths = np.array([row.size for row in rows], np.int32)
        total = int(lengths.max()) + int(length)
        limit = getattr(model, "max_seq_len", None)
        if limit is not None and total > limit:
            raise ValueError(
                f"the longest prompt ({int(lengths.max())} tokens) plus length={length} is {total}, "
                f"more than the model's max_seq_len={limit}."
            )
        canvas = np.full((len(rows), total), self.mask_id, np.int32)
        for index, row in enumerate(rows):
            canvas[index, : row.size] = row
        return _reverse(self, model, variables, jnp.asarray(canvas), jnp.asarray(lengths), key,
                        length=int(length), steps=int(steps), temperature=float(temperature))


@partial(jax.jit, static_argnames=("process", "model", "length", "steps", "temperature"))
def _reverse(process, model, variables, canvas, prompt_lengths, key, *, length, steps, temperature):
    rows, total = canvas.shape
    columns = jnp.arange(total)[None, :]
    starts = prompt_lengths[:, None]
    slots = (columns >= starts) & (columns < starts + length)  # the positions to fill
    segment_ids = jnp.where(columns < starts + length, 1, 2).astype(jnp.int32)
    canvas = jnp.where(columns < starts, canvas, jnp.where(slots, process.mask_id, 0))
    grid = jnp.linspace(1.0, 0.0, steps + 1)

    def step(i, canvas):
        t, s = grid[i], grid[i + 1]
        logits = model.apply(variables, canvas, segment_ids=segment_ids)
        log_probs = process.subs_log_probs(logits)
        draw_key, reveal_key = jax.random.split(jax.random.fold_in(key, i))
        if temperature == 0:
            drawn = jnp.argmax(log_probs, axis=-1).astype(jnp.int32)
        else:
            drawn = jax.random.categorical(draw_key, log_probs / temperature, axis=-1).astype(jnp.int32)
        # reveal with probability (alpha_s - alpha_t) / (1 - alpha_t); at s = 0 that is 1
        reveal_p = (process.alpha(s) - process.alpha(t)) / (1.0 - process.alpha(t))
        reveal = jax.random.uniform(reveal_key, canvas.shape) < reveal_p
        reveal = reveal | (i == steps - 1)
        still_masked = canvas == process.mask_id
        return jnp.where(slots & still_masked & reveal, drawn, canvas)

    canvas = jax.lax.fori_loop(0, steps, step, canvas)
    index = starts + jnp.arange(length)[None, :]
    tokens = jnp.take_along_axis(canvas, index, axis=1)
    return MaskedSample(tokens=tokens, lengths=jnp.full((rows,), length, jnp.int32))


@dataclasses.dataclass(frozen=True)
class MDLM:
    """MDLM's settings; calling it builds the process (``MDLM(mask_id=mask_id)()``).

    `mask_id` is the id of the mask token, which the model's vocabulary must include (the spec
    takes the first id after the tokenizer's vocabulary and builds the model one id larger).
    `eps` keeps t away from 0, where the ELBO weight 1/t diverges.
    """

    mask_id: int
    eps: float = 1e-3

    def __call__(self) -> MaskedDiffusion:
        count(self.mask_id, "mask_id", minimum=0)
        if not 0 < self.eps < 1:
            raise ValueError(f"eps must be in (0, 1); got {self.eps!r}.")
        return MaskedDiffusion(mask_id=int(self.mask_id), eps=float(self.eps))


def as_masked_process(value: Any) -> MaskedDiffusion:
    """A MaskedDiffusion as is, or the one an `MDLM` preset builds."""
    if isinstance(value, MaskedDiffusion):
        return value
    if isinstance(value, MDLM):
        return value()
    raise TypeError(f"expected a masked diffusion process (MDLM(mask_id=...)()), got {value!r}.")
