"""Post-training objectives for decoders: DPO on preference pairs, GRPO on sampled rollouts.

Both keep the policy they start from as a frozen reference in the "reference" collection of the
variables, beside "params": it is data to the trainer, so the optimizer never sees it and no
gradient flows into it. A policy that is a base with a LoRA adapter (an `AdaptedDecoder`) keeps no
copy: its reference is the frozen base it already holds, run with the adapter off. Token log-probabilities come after the next-token shift, as in
`LMObjective`: a row of `seq_len + 1` ids scores its last `seq_len` ids, and a per-token mask column
of the same width as the ids marks which of them count (its first entry is never a target).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew.checks import count
from dew import rl
from dew.inference.text import TextGeneration
from dew.objectives.base import Aux, Field, InputSpec, Objective, inference_variables
from dew.objectives.lm import decoder_parts
from dew.sampling.text import Sampling

REFERENCE = "reference"


# ----------------------------------------------------------------------------------------------
# The losses, as functions of log-probabilities (so they can be checked by hand)


def dpo_loss(policy_chosen, policy_rejected, reference_chosen, reference_rejected, beta: float,
             label_smoothing: float = 0.0):
    """DPO's sigmoid loss (Rafailov et al. 2023) over sequence log-probabilities `[batch]`:

        -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))

    averaged over the batch; `label_smoothing` > 0 is cDPO's conservative variant. Returns
    `(loss, metrics)` with the implicit rewards beta * (pi - ref) and their margin and accuracy.
    """
    chosen_reward = beta * (policy_chosen - reference_chosen)
    rejected_reward = beta * (policy_rejected - reference_rejected)
    margin = chosen_reward - rejected_reward
    losses = -(1.0 - label_smoothing) * jax.nn.log_sigmoid(margin) - label_smoothing * jax.nn.log_sigmoid(-margin)
    metrics = {
        "chosen_reward": jnp.mean(chosen_reward),
        "rejected_reward": jnp.mean(rejected_reward),
        "reward_margin": jnp.mean(margin),
        "reward_accuracy": jnp.mean((margin > 0).astype(jnp.float32)),
        "log_ratio": jnp.mean((policy_chosen - policy_rejected) - (reference_chosen - reference_rejected)),
    }
    return jnp.mean(losses), metrics


def grpo_loss(log_probs, old_log_probs, reference_log_probs, advantages, mask, *, clip: float = 0.2,
              beta: float = 0.0):
    """GRPO's loss (Shao et al. 2024) per token `[batch, tokens]`, averaged over all masked tokens:

        -min(r A, clip(r, 1 - clip, 1 + clip) A) + beta * KL_k3(pi || ref),   r = pi / pi_old

    `advantages` is one value per sequence `[batch]`. Returns `(loss, metrics)`.
    """
    advantages = jnp.asarray(advantages, jnp.float32)[:, None]
    log_ratio = log_probs - old_log_probs
    per_token = rl.clipped_surrogate(log_ratio, advantages, clip)
    metrics = {"clip_fraction": rl.masked_mean(rl.clip_fraction(log_ratio, advantages, clip), mask)}
    if reference_log_probs is not None:
        kl = rl.kl_k3(log_probs, reference_log_probs)
        per_token = per_token + beta * kl
        metrics["kl"] = rl.masked_mean(kl, mask)
    return rl.masked_mean(per_token, mask), metrics


# ----------------------------------------------------------------------------------------------
# A decoder policy with a frozen reference


class _PolicyObjective(Objective):
    """Shared by DPO and GRPO: the model, the reference collection and token log-probabilities."""

    keeps_reference = True

    def __init__(self, model, seq_len, *, variables=None, tokenizer=None, ema_decay=None):
        model, variables, tokenizer = decoder_parts(model, seq_len, variables, tokenizer)
        self.model = model
        self.seq_len = seq_len
        self.variables = variables
        self.tokenizer = tokenizer
        self.ema_decay = ema_decay

    @property
    def adapted(self) -> bool:
        """Whether the policy is a base with an adapter (`dew.nn.adapters.LoRADecoder`): its
        reference is then the base with the adapter off, and no copy of the weights is kept."""
        return callable(getattr(self.model, "base_variables", None))

    def init(self, key, variables=None):
        if variables is None:
            variables = self.model.init(key, jnp.zeros((1, self.seq_len), jnp.int32))
        # A new stage starts from these weights: they become its reference, whatever came before.
        policy = {name: value for name, value in variables.items() if name != REFERENCE}
        if not self.keeps_reference or self.adapted:
            return policy
        reference = jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), policy["params"])
        return {**policy, REFERENCE: reference}

    @staticmethod
    def policy_variables(variables):
        """The variables without the reference: what the model itself reads."""
        return {name: value for name, value in variables.items() if name != REFERENCE}

    def token_log_probs(self, variables, tokens, model=None):
        """log p(tokens[:, t + 1] | tokens[:, :t + 1]) for t < seq_len: `[batch, seq_len]`."""
        logits = (model or self.model).apply(variables, tokens[:, :-1]).astype(jnp.float32)
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        return jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1)[..., 0]

    def reference_log_probs(self, variables, tokens):
        if self.adapted:  # the base with the adapter off: the frozen weights the policy already holds
            base = self.model.base_variables(variables)
            return jax.lax.stop_gradient(self.token_log_probs(base, tokens, model=self.model.model))
        if REFERENCE not in variables:
            raise ValueError(
                f"{type(self).__name__} needs the frozen reference in variables['{REFERENCE}']; "
                "build the variables with objective.init(key, weights)."
            )
        frozen = {**self.policy_variables(variables),
                  "params": jax.lax.stop_gradient(variables[REFERENCE])}
        return jax.lax.stop_gradient(self.token_log_probs(frozen, tokens))

    def _check_ids(self, batch, names):
        vocab = getattr(self.model, "vocab_size", None)
        for name in names:
            tokens = np.asarray(batch[name])
            if vocab is not None and tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
                raise ValueError(
                    f"Batch field {name!r} holds token ids in [{tokens.min()}, {tokens.max()}], but the "
                    f"model's vocabulary has {vocab} ids. Tokenize with the model's tokenizer."
                )

    def policy(self, variables, sampling: Sampling = Sampling(), *, processor: Any = None) -> TextGeneration:
        """A TextGeneration task over the policy weights (the rollout policy); never the reference."""
        return TextGeneration(self.model, self.policy_variables(variables), sampling=sampling,
                              processor=processor if processor is not None else self.tokenizer)

    def pipeline(self, state, *, ema: bool = True, processor: Any = None,
                 sampling: Sampling | None = None) -> TextGeneration:
        """The trained policy as a TextGeneration task (greedy unless `sampling`); the frozen
        reference is never published. `ema` picks the policy's EMA copy as for a plain LM."""
        return self.policy(inference_variables(state, ema), sampling or Sampling(temperature=0.0), processor=processor)


class DPOObjective(_PolicyObjective):
    """Direct preference optimization against the frozen starting policy.

    Batches hold "chosen", "rejected", "chosen_mask", "rejected_mask", each `[seq_len + 1]` (what
    `PreferencePairs(seq_len=seq_len + 1)` writes); the masks mark the response ids the sequence
    log-probability sums over.
    """

    def __init__(self, model, seq_len, beta: float = 0.1, *, variables=None, label_smoothing: float = 0.0,
                 tokenizer=None, ema_decay=None):
        super().__init__(model, seq_len, variables=variables, tokenizer=tokenizer, ema_decay=ema_decay)
        if not beta > 0:
            raise ValueError(f"beta must be > 0; got {beta!r}.")
        if not 0 <= label_smoothing < 0.5:
            raise ValueError(f"label_smoothing must be in [0, 0.5); got {label_smoothing!r}.")
        self.beta = float(beta)
        self.label_smoothing = float(label_smoothing)
        width = (seq_len + 1,)
        self.inputs = InputSpec(Field("chosen", width), Field("rejected", width),
                                Field("chosen_mask", width), Field("rejected_mask", width))

    def settings(self) -> dict[str, Any]:
        return {"seq_len": self.seq_len, "beta": self.beta, "label_smoothing": self.label_smoothing,
                "ema_decay": self.ema_decay}

    def check(self, batch) -> None:
        if self.inputs is not None and "chosen" in batch and np.shape(batch["chosen"])[-1:] != (self.seq_len + 1,):
            raise ValueError(
                f"Batch field 'chosen' rows hold {np.shape(batch['chosen'])[-1]} ids, but "
                f"DPOObjective(seq_len={self.seq_len}) reads rows of seq_len + 1 = {self.seq_len + 1} "
                f"(the next-token shift scores one fewer). Use PreferencePairs(seq_len="
                f"{self.seq_len + 1}) or DPOObjective(seq_len={np.shape(batch['chosen'])[-1] - 1})."
            )
        super().check(batch)
        self._check_ids(batch, ("chosen", "rejected"))
        for side in ("chosen", "rejected"):
            counted = np.asarray(batch[f"{side}_mask"])[:, 1:].sum(axis=1)
            if (counted == 0).any():
                row = int(np.flatnonzero(counted == 0)[0])
                raise ValueError(f"Row {row} of '{side}_mask' marks no response token after the first id.")

    def sequence_log_probs(self, variables, batch):
        """Masked sums of token log-probs, `(policy, reference)`, each `[2 * batch]` (chosen first)."""
        tokens = jnp.concatenate([batch["chosen"], batch["rejected"]], axis=0)
        mask = jnp.concatenate([batch["chosen_mask"], batch["rejected_mask"]], axis=0)[:, 1:]
        mask = mask.astype(jnp.float32)
        policy = jnp.sum(self.token_log_probs(self.policy_variables(variables), tokens) * mask, axis=1)
        reference = jnp.sum(self.reference_log_probs(variables, tokens) * mask, axis=1)
        return policy, reference

    def loss(self, variables, batch, step):
        policy, reference = self.sequence_log_probs(variables, batch)
        rows = batch["chosen"].shape[0]
        loss, metrics = dpo_loss(policy[:rows], policy[rows:], reference[:rows], reference[rows:],
                                 self.beta, self.label_smoothing)
        return loss, Aux(metrics=metrics)


class GRPOObjective(_PolicyObjective):
    """Group relative policy optimization on rollouts (batches `SampledRollout` writes).

    Batches hold "text" `[seq_len + 1]` (prompt and response), "response_mask" and "old_log_probs"
    (per id, aligned with "text") and "advantages" (one per row); a "reward" column is logged.
    `beta` weighs the k3 KL estimate against the frozen reference (0 drops it, and the reference).
    """

    def __init__(self, model, seq_len, beta: float = 0.0, *, variables=None, clip: float = 0.2,
                 tokenizer=None, ema_decay=None):
        super().__init__(model, seq_len, variables=variables, tokenizer=tokenizer, ema_decay=ema_decay)
        if not beta >= 0:
            raise ValueError(f"beta (the KL coefficient) must be >= 0; got {beta!r}.")
        if not 0 < clip < 1:
            raise ValueError(f"clip must be in (0, 1); got {clip!r}.")
        self.beta = float(beta)
        self.clip = float(clip)
        self.keeps_reference = self.beta > 0
        width = (seq_len + 1,)
        self.inputs = InputSpec(Field("text", width), Field("response_mask", width),
                                Field("old_log_probs", width), Field("advantages", ()))

    def settings(self) -> dict[str, Any]:
        return {"seq_len": self.seq_len, "beta": self.beta, "clip": self.clip, "ema_decay": self.ema_decay}

    def check(self, batch) -> None:
        if "text" not in batch and "prompt" in batch:
            raise ValueError(
                "GRPOObjective trains on sampled responses, but this batch holds prompts: pass "
                "Trainer(..., rollout=SampledRollout(objective, reward=...)) to sample them."
            )
        super().check(batch)
        self._check_ids(batch, ("text",))

    def loss(self, variables, batch, step):
        tokens = batch["text"]
        mask = batch["response_mask"][:, 1:].astype(jnp.float32)
        log_probs = self.token_log_probs(self.policy_variables(variables), tokens)
        reference = self.reference_log_probs(variables, tokens) if self.beta > 0 else None
        loss, metrics = grpo_loss(log_probs, batch["old_log_probs"][:, 1:].astype(jnp.float32), reference,
                                  batch["advantages"], mask, clip=self.clip, beta=self.beta)
        metrics["response_tokens"] = jnp.mean(jnp.sum(mask, axis=1))
        if "reward" in batch:
            metrics["reward"] = jnp.mean(batch["reward"].astype(jnp.float32))
        return loss, Aux(metrics=metrics)


# ----------------------------------------------------------------------------------------------
# Sampling rollouts on the host


class SampledRollout:
    """Turn a batch of prompts into a GRPO batch sampled from the current policy.

    Called by the trainer as `rollout(variables, batch, key)` before each step. For each prompt
    (the `Prompts` layout: "prompt", "prompt_length" and UTF-8 byte columns "data_source",
    "ground_truth", "extra_info") it draws `groups` responses of at most `max_new_tokens` tokens,
    decodes each with `decode` (default: the objective's tokenizer), scores it with
    `reward(data_source, completion, ground_truth, extra_info) -> float`, and writes "text",
    "response_mask", "old_log_probs", "advantages" (group-relative) and "reward", with
    `prompts * groups` rows of `objective.seq_len + 1` ids. Shapes never change between steps.

    "old_log_probs" are the sampling weights' plain-softmax log-probabilities of the drawn tokens
    (`Generation.raw_log_probs`), the same quantity the loss computes, so the ratio starts at 1
    whatever filters `sampling` applies.
    """

    def __init__(self, objective: GRPOObjective, reward: Callable[[str, str, str, str], float], *,
                 groups: int = 4, max_new_tokens: int = 32, sampling: Sampling = Sampling(),
                 decode: Callable[[list[int]], str] | None = None, normalize: bool = True):
        if not callable(reward):
            raise TypeError(f"reward must be callable as reward(data_source, completion, ground_truth, extra_info); got {reward!r}.")
        groups = count(groups, "groups (advantages compare the responses to one prompt)", minimum=2)
        max_new_tokens = count(max_new_tokens, "max_new_tokens")
        if not isinstance(sampling, Sampling):
            raise TypeError(f"sampling must be a dew.sampling.Sampling; got {type(sampling).__name__}.")
        if decode is None:
            tokenizer = getattr(objective, "tokenizer", None)
            if tokenizer is None:
                raise ValueError("SampledRollout needs decode= (token ids -> text) or an objective with a tokenizer.")
            decode = tokenizer.decode
        self.objective = objective
        self.reward = reward
        self.groups = groups
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling
        self.decode = decode
        self.normalize = normalize

    def _prompts(self, batch) -> list[np.ndarray]:
        if "prompt" not in batch:
            raise ValueError(f"SampledRollout reads a 'prompt' column (the Prompts layout); the batch has {sorted(batch)}.")
        prompts = np.asarray(batch["prompt"])
        if prompts.ndim != 2:
            raise ValueError(f"'prompt' must be [batch, prompt_len] ids; got shape {prompts.shape}.")
        lengths = np.asarray(batch.get("prompt_length", np.full(len(prompts), prompts.shape[1])))
        width = self.objective.seq_len + 1
        if prompts.shape[1] + self.max_new_tokens > width:
            raise ValueError(
                f"prompts of {prompts.shape[1]} ids plus max_new_tokens={self.max_new_tokens} do not "
                f"fit rows of seq_len + 1 = {width}; build the objective with seq_len >= "
                f"{prompts.shape[1] + self.max_new_tokens - 1}."
            )
        rows = []
        for index, (row, length) in enumerate(zip(prompts, lengths)):
            if not 1 <= int(length) <= prompts.shape[1]:
                raise ValueError(f"prompt {index} has prompt_length {int(length)}, outside [1, {prompts.shape[1]}].")
            rows.append(row[: int(length)].astype(np.int32))
        return rows

    def _metadata(self, batch, name, count) -> list[str]:
        from dew.data.prompts import decode_text

        if name not in batch:
            return [""] * count
        return [decode_text(row) for row in np.asarray(batch[name])]

    def score(self, batch, completions: list[str]) -> np.ndarray:
        """The reward of each completion (prompt-major), checked to be a finite number."""
        count = len(completions) // self.groups
        meta = {name: self._metadata(batch, name, count) for name in ("data_source", "ground_truth", "extra_info")}
        rewards = np.zeros(len(completions), np.float32)
        for row, completion in enumerate(completions):
            index = row // self.groups
            args = (meta["data_source"][index], completion, meta["ground_truth"][index], meta["extra_info"][index])
            try:
                value = self.reward(*args)
            except Exception as error:
                raise RuntimeError(
                    f"the reward function raised on prompt {index} (response {row % self.groups}, "
                    f"data_source={args[0]!r}, completion={completion[:80]!r}): {type(error).__name__}: {error}"
                ) from error
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)) \
                    or not math.isfinite(float(value)):
                raise TypeError(
                    f"the reward function must return a finite number; on prompt {index} (response "
                    f"{row % self.groups}) it returned {value!r}."
                )
            rewards[row] = float(value)
        return rewards

    def __call__(self, variables: Mapping[str, Any], batch: Mapping[str, Any], key: jax.Array) -> dict[str, np.ndarray]:
        prompts = self._prompts(batch)
        policy = self.objective.policy(variables, self.sampling)
        generation = policy(prompts, self.max_new_tokens, key=key, n=self.groups).host()
        rows = len(prompts) * self.groups
        width = self.objective.seq_len + 1
        text = np.full((rows, width), self.sampling.pad_id, np.int32)
        response_mask = np.zeros((rows, width), np.int32)
        old_log_probs = np.zeros((rows, width), np.float32)
        completions = []
        for row in range(rows):
            prompt = prompts[row // self.groups]
            length = int(generation.lengths[row])
            response = generation.tokens[row, :length]
            start = prompt.size
            text[row, :start] = prompt
            text[row, start : start + length] = response
            response_mask[row, start : start + length] = 1
            old_log_probs[row, start : start + length] = generation.raw_log_probs[row, :length]
            shown = response[: length - 1] if bool(generation.terminated[row]) else response
            completions.append(self.decode([int(t) for t in shown]))
        rewards = self.score(batch, completions)
        advantages = np.asarray(rl.group_advantages(rewards, self.groups, normalize=self.normalize), np.float32)
        return {"text": text, "response_mask": response_mask, "old_log_probs": old_log_probs,
                "advantages": advantages, "reward": rewards}
