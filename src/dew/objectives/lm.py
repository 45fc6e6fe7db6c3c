"""Language modeling: next-token loss, perplexity over a validation pass, and text previews.

A batch row under "text" holds `seq_len + 1` token ids: the model reads the first `seq_len` and is
scored on predicting the last `seq_len`. Optional columns shape which targets count:
- "segment_ids" / "positions" (packed documents): attention stays inside a document, and targets
  whose segment id is 0 (padding) are skipped;
- "mask" (1 for a real token, 0 for padding): targets on padding are skipped;
- "text_roles" (a `Role` per token): with `loss_role`, only targets of that role count.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew.checks import count
from dew.inference.text import TextGeneration
from dew.nn.moe import BALANCE_COLLECTION, ROUTER_COLLECTION, balanced_score_bias, router_metrics
from dew.objectives.base import Aux, Field, InputSpec, Objective, inference_variables
from dew.sampling.text import Sampling, generate
from dew.tracking.records import Artifact


@dataclasses.dataclass(frozen=True)
class Samples:
    """A text preview: continue `prompt` by `max_new_tokens` tokens, `n` times.

    `prompt` is token ids or, with a `tokenizer`, a string; the artifact holds decoded text when a
    tokenizer is given and token ids otherwise.
    """

    prompt: Any
    max_new_tokens: int = 32
    n: int = 1
    sampling: Sampling = Sampling(temperature=0.0)
    tokenizer: Any = None

    def prompt_ids(self) -> list[int]:
        if isinstance(self.prompt, str):
            if self.tokenizer is None:
                raise ValueError("Samples with a text prompt needs tokenizer=.")
            return list(self.tokenizer.encode(self.prompt))
        return [int(t) for t in self.prompt]


@dataclasses.dataclass(frozen=True)
class Perplexity:
    """exp of the token-weighted mean loss over the whole validation pass."""

    name: str = "perplexity"

    def empty(self):
        return 0.0, 0.0

    def update(self, accumulator, outputs):
        if "_loss_sum" not in outputs or "_tokens" not in outputs:
            raise ValueError(
                "Perplexity reads '_loss_sum' and '_tokens' from the objective's evaluate(); "
                f"this objective returned {sorted(outputs)}."
            )
        total, tokens = accumulator
        return total + float(outputs["_loss_sum"]), tokens + float(outputs["_tokens"])

    def result(self, accumulator):
        total, tokens = accumulator
        if tokens == 0:
            raise ValueError("Perplexity saw no scored tokens in the validation pass.")
        return {self.name: math.exp(total / tokens)}


def decoder_parts(model: Any, seq_len: int, variables: Any, tokenizer: Any) -> tuple[Any, Any, Any]:
    """Unwrap a pretrained bundle (`.model`, `.variables`, `.tokenizer`) and check the settings
    shared by the decoder objectives; returns `(model, variables, tokenizer)`."""
    if hasattr(model, "model") and hasattr(model, "variables"):  # a pretrained bundle
        variables = model.variables if variables is None else variables
        tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
        model = model.model
    seq_len = count(seq_len, "seq_len")
    limit = getattr(model, "max_seq_len", None)
    if limit is not None and seq_len > limit:
        raise ValueError(
            f"seq_len={seq_len} is longer than the model's max_seq_len={limit}; "
            f"use seq_len <= {limit} or build the model with a larger max_seq_len."
        )
    if variables is not None and "params" not in variables:
        raise ValueError(f"variables must hold a 'params' collection; got {sorted(variables)}.")
    return model, variables, tokenizer


class LMObjective(Objective):
    """Next-token cross-entropy for a decoder such as `CausalTransformer`.

    `model` may also be a loaded checkpoint bundle (anything with `.model` and `.variables`), in
    which case training starts from its weights. `variables=` starts from given weights.

    For a model with mixture-of-experts layers the router's metrics (`dew.nn.moe.router_metrics`:
    ``router/balance``, ``router/z`` and ``router/expert_{e}_tokens``) are logged, and
    ``balance_coef * balance + z_loss_coef * z`` is added to the loss (both 0 by default;
    transformers' Mixtral and Qwen-MoE train with ``router_aux_loss_coef=0.001``).

    ``bias_update_rate`` (gamma) turns on DeepSeek-V3's auxiliary-loss-free balancing for a model
    whose routers carry a ``score_bias`` (the ``balance`` collection): each training step moves
    every layer's bias by ``gamma * sign(mean_load - load_e)`` from the tokens that layer routed in
    the step (`dew.nn.moe.balanced_score_bias`), returned as an updated collection that the trainer
    writes into the state (so checkpoints hold it; it gets no gradient and no optimizer state).
    With gradient accumulation the rule runs once per microbatch. DeepSeek-V3 trained with
    gamma = 0.001 for most of its tokens.
    """

    def __init__(
        self,
        model: Any,
        seq_len: int,
        *,
        variables: Mapping[str, Any] | None = None,
        loss_role: int | None = None,
        ema_decay: float | None = None,
        samples: Samples | None = None,
        tokenizer: Any = None,
        balance_coef: float = 0.0,
        z_loss_coef: float = 0.0,
        bias_update_rate: float = 0.0,
    ):
        model, variables, tokenizer = decoder_parts(model, seq_len, variables, tokenizer)
        for name, value in (("balance_coef", balance_coef), ("z_loss_coef", z_loss_coef),
                            ("bias_update_rate", bias_update_rate)):
            if not value >= 0:
                raise ValueError(f"{name} must be a number >= 0; got {value!r}")
        self.balance_coef = float(balance_coef)
        self.z_loss_coef = float(z_loss_coef)
        self.bias_update_rate = float(bias_update_rate)
        self.model = model
        self.seq_len = seq_len
        self.variables = variables
        self.loss_role = None if loss_role is None else int(loss_role)
        self.ema_decay = ema_decay
        self.samples = samples
        self.tokenizer = tokenizer
        self.inputs = InputSpec(Field("text", (seq_len + 1,)))

    def settings(self) -> dict[str, Any]:
        """What a run record keeps to rebuild this objective around its model."""
        settings = {"seq_len": self.seq_len, "loss_role": self.loss_role, "ema_decay": self.ema_decay,
                    "balance_coef": self.balance_coef, "z_loss_coef": self.z_loss_coef,
                    "bias_update_rate": self.bias_update_rate}
        if self.samples is not None:  # the preview's policy and budget, prompt as ids (the run keeps the tokenizer)
            settings["samples"] = dataclasses.replace(self.samples, prompt=self.samples.prompt_ids(), tokenizer=None)
        return settings

    def init(self, key, variables=None):
        if variables is not None:
            return variables
        return self.model.init(key, jnp.zeros((1, self.seq_len), jnp.int32))

    def check(self, batch) -> None:
        super().check(batch)
        tokens = np.asarray(batch["text"])
        vocab = getattr(self.model, "vocab_size", None)
        if vocab is not None and tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
            raise ValueError(
                f"Batch field 'text' holds token ids in [{tokens.min()}, {tokens.max()}], but the "
                f"model's vocabulary has {vocab} ids (0..{vocab - 1}). Tokenize with the model's "
                "tokenizer, or build the model with a larger vocab_size."
            )
        if self.loss_role is not None and "text_roles" not in batch:
            raise ValueError(
                f"loss_role={self.loss_role} needs a 'text_roles' column beside 'text' "
                f"(the batch has {sorted(batch)})."
            )

    def token_losses(self, variables, batch, key=None):
        """Per-target cross-entropy `[B, seq_len]` and the float mask of targets that count.

        `key` (training only) is handed to the model as its "dropout" stream."""
        losses, mask, _ = self.token_losses_and_routing(variables, batch, key)
        return losses, mask

    def token_losses_and_routing(self, variables, batch, key=None):
        """`token_losses` and the router's metrics (empty for a model without mixture layers)."""
        losses, mask, recorded = self.token_losses_and_router(variables, batch, key)
        return losses, mask, router_metrics(recorded)

    def token_losses_and_router(self, variables, batch, key=None):
        """`token_losses` and the ``router`` collection the pass recorded (its per-layer counts)."""
        tokens = batch["text"]
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        kwargs = {}
        mask = jnp.ones(targets.shape, jnp.float32)
        if "segment_ids" in batch:
            kwargs["segment_ids"] = batch["segment_ids"][:, :-1]
            mask = mask * (batch["segment_ids"][:, 1:] > 0)
        if "positions" in batch:
            kwargs["positions"] = batch["positions"][:, :-1]
        if "mask" in batch:
            mask = mask * (batch["mask"][:, 1:] > 0)
        if self.loss_role is not None:
            mask = mask * (batch["text_roles"][:, 1:] == self.loss_role)
        if key is not None:
            kwargs["rngs"] = {"dropout": key}
        logits, recorded = self.model.apply(variables, inputs, mutable=[ROUTER_COLLECTION], **kwargs)
        log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        losses = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
        return losses, mask, recorded.get(ROUTER_COLLECTION, {})

    def loss(self, variables, batch, step):
        losses, mask, recorded = self.token_losses_and_router(variables, batch, None if step is None else step.key)
        routing = router_metrics(recorded)
        tokens = jnp.sum(mask)
        loss = jnp.sum(losses * mask) / jnp.maximum(tokens, 1.0)
        metrics = {"tokens": tokens}
        if routing:
            metrics.update({f"router/{name}": value for name, value in routing.items()}, cross_entropy=loss)
            loss = loss + self.balance_coef * routing["balance"] + self.z_loss_coef * routing["z"]
        changed = {}
        if self.bias_update_rate > 0:
            if BALANCE_COLLECTION not in variables:
                raise ValueError(
                    f"bias_update_rate={self.bias_update_rate} moves the routers' balancing bias, but the model's "
                    f"variables have no {BALANCE_COLLECTION!r} collection (collections: {sorted(variables)}); "
                    "build the mixture layers with score='sigmoid', score_bias=True (DeepSeek-V3's router) or "
                    "leave bias_update_rate at 0"
                )
            changed[BALANCE_COLLECTION] = balanced_score_bias(variables[BALANCE_COLLECTION], recorded,
                                                              self.bias_update_rate)
        return loss, Aux(metrics=metrics, variables=changed)

    def evaluate(self, variables, batch, step):
        losses, mask = self.token_losses(variables, batch)
        tokens = jnp.sum(mask)
        loss_sum = jnp.sum(losses * mask)
        # Names starting with "_" feed pass-level metrics and are not averaged on their own.
        return {"loss": loss_sum / jnp.maximum(tokens, 1.0), "_loss_sum": loss_sum, "_tokens": tokens}

    def preview(self, variables, key, step):
        if self.samples is None:
            return []
        samples = self.samples
        result = generate(
            self.model, variables, [samples.prompt_ids()], samples.max_new_tokens,
            key=key, sampling=samples.sampling, n=samples.n,
        ).host()
        rows = [tokens[: int(length)] for tokens, length in zip(result.tokens, result.lengths)]
        tokenizer = samples.tokenizer or self.tokenizer
        if tokenizer is not None:
            prompt = tokenizer.decode(samples.prompt_ids())
            lines = [prompt + tokenizer.decode([int(t) for t in row]) for row in rows]
        else:
            lines = [" ".join(str(int(t)) for t in samples.prompt_ids() + list(row)) for row in rows]
        return [Artifact("samples", "text", "\n".join(lines))]

    def policy(self, variables, sampling: Sampling = Sampling(), *, processor: Any = None) -> TextGeneration:
        """A TextGeneration task over `variables` (the rollout policy in post-training)."""
        return TextGeneration(self.model, variables, sampling=sampling,
                              processor=processor if processor is not None else self.tokenizer)

    def pipeline(self, state, *, ema: bool = True, processor: Any = None,
                 sampling: Sampling | None = None) -> TextGeneration:
        """The TextGeneration task over a trained state.

        Weights: the EMA copy when `ema` (raising when the run keeps none), else the live ones.
        The policy and budget come from the objective's `samples` preview when it has one (greedy,
        no default budget otherwise); `processor` lets a token-only run take strings.
        """
        samples = self.samples
        chosen = sampling if sampling is not None else samples.sampling if samples else Sampling(temperature=0.0)
        task = self.policy(inference_variables(state, ema), chosen, processor=processor)
        if samples is not None:
            task = dataclasses.replace(task, max_new_tokens=samples.max_new_tokens, n=samples.n)
        return task

