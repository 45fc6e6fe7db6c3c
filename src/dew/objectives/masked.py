"""Masked diffusion language modeling: MDLM's negative ELBO on a bidirectional decoder.

Rows under "text" hold exactly `seq_len` ids; there is no next-token shift. Each step draws one
time per row, masks tokens with the process's probability, and scores the masked positions with
the ELBO weight. `evaluate` reports "_loss_sum" and "_tokens" so `Perplexity` gives exp of the
ELBO per token (an upper bound on the model's perplexity).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew.checks import count
from dew.diffusion.discrete import MaskedDiffusion, as_masked_process
from dew.inference.masked import MaskedGeneration
from dew.objectives.base import Aux, Field, InputSpec, Objective, inference_variables


class MaskedDiffusionObjective(Objective):
    """MDLM training for a bidirectional `CausalTransformer(causal=False)` whose vocabulary
    includes the process's mask id. Like `DiffusionObjective` it keeps an EMA copy of the weights
    (``ema_decay=0.999``; None keeps none), which its pipeline serves by default."""

    def __init__(self, model: Any, process: MaskedDiffusion, seq_len: int, *,
                 variables: Mapping[str, Any] | None = None, ema_decay: float | None = 0.999,
                 tokenizer: Any = None):
        process = as_masked_process(process)
        seq_len = count(seq_len, "seq_len")
        vocab = getattr(model, "vocab_size", None)
        if vocab is not None and process.mask_id >= vocab:
            raise ValueError(
                f"mask_id={process.mask_id} is outside the model's vocabulary of {vocab} ids; build "
                f"the model with vocab_size={process.mask_id + 1} so the mask token has an embedding."
            )
        if getattr(model, "causal", False):
            raise ValueError(
                "masked diffusion needs a bidirectional model: every position sees the whole row. "
                "Build it with causal=False (CausalTransformer(..., causal=False))."
            )
        limit = getattr(model, "max_seq_len", None)
        if limit is not None and seq_len > limit:
            raise ValueError(f"seq_len={seq_len} is longer than the model's max_seq_len={limit}.")
        if variables is not None and "params" not in variables:
            raise ValueError(f"variables must hold a 'params' collection; got {sorted(variables)}.")
        self.model = model
        self.process = process
        self.seq_len = seq_len
        self.variables = variables
        self.ema_decay = ema_decay
        self.tokenizer = tokenizer
        self.inputs = InputSpec(Field("text", (seq_len,)))

    def settings(self) -> dict[str, Any]:
        return {"process": self.process, "seq_len": self.seq_len, "ema_decay": self.ema_decay}

    def init(self, key, variables=None):
        if variables is not None:
            return variables
        return self.model.init(key, jnp.zeros((1, self.seq_len), jnp.int32))

    def check(self, batch) -> None:
        if "text" in batch and np.ndim(batch["text"]) == 2 and np.shape(batch["text"])[1] != self.seq_len:
            got = np.shape(batch["text"])[1]
            raise ValueError(
                f"Batch field 'text' rows hold {got} ids, but MaskedDiffusionObjective(seq_len="
                f"{self.seq_len}) reads exactly seq_len ids (no next-token shift). TokenWindows("
                f"seq_len={self.seq_len - 1}) writes rows of {self.seq_len}."
            )
        super().check(batch)
        tokens = np.asarray(batch["text"])
        vocab = getattr(self.model, "vocab_size", None)
        if vocab is not None and tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
            raise ValueError(f"Batch field 'text' holds ids in [{tokens.min()}, {tokens.max()}], outside [0, {vocab}).")
        if (tokens == self.process.mask_id).any():
            raise ValueError(
                f"Batch field 'text' contains the mask id {self.process.mask_id}; the data must be "
                "clean tokens. Pick a mask id the tokenizer never writes (its vocab_size)."
            )

    def token_losses(self, variables, batch, key):
        tokens = batch["text"]
        time_key, mask_key = jax.random.split(key)
        t = self.process.sample_times(time_key, tokens.shape[0])
        noisy, masked = self.process.corrupt(mask_key, tokens, t)
        logits = self.model.apply(variables, noisy)
        return self.process.token_losses(logits, tokens, masked, t), masked

    def loss(self, variables, batch, step):
        losses, masked = self.token_losses(variables, batch, step.key)
        return jnp.mean(losses), Aux(metrics={"masked_fraction": jnp.mean(masked.astype(jnp.float32))})

    def evaluate(self, variables, batch, step):
        losses, _ = self.token_losses(variables, batch, step.key)
        loss_sum = jnp.sum(losses)
        tokens = jnp.asarray(losses.size, jnp.float32)
        return {"loss": loss_sum / tokens, "_loss_sum": loss_sum, "_tokens": tokens}

    def generate(self, variables, prompts, length, *, key, steps=64, temperature=1.0):
        return self.process.generate(self.model, variables, prompts, length, key=key, steps=steps,
                                     temperature=temperature)

    def pipeline(self, state, *, ema: bool = True, processor: Any = None, steps: int = 64) -> MaskedGeneration:
        """A MaskedGeneration task over a trained state (EMA weights when `ema`, raising without)."""
        return MaskedGeneration(self.model, inference_variables(state, ema), self.process,
                                processor=processor if processor is not None else self.tokenizer, steps=steps)
