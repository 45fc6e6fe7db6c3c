"""Reinforcement-learning arithmetic: advantages, masked statistics, policy and value losses, KL.

Every function is a pure `jax.numpy` function of arrays, so it runs inside a jitted loss or on the
host alike. Time (or token) runs along the last axis; masks are 1 where an entry counts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dew.checks import count


def masked_mean(x, mask, axis=None):
    """The mean of `x` over entries where `mask` is nonzero (0 when there are none)."""
    x = jnp.asarray(x, jnp.float32)
    mask = jnp.broadcast_to(jnp.asarray(mask, jnp.float32), x.shape)
    return jnp.sum(x * mask, axis=axis) / jnp.maximum(jnp.sum(mask, axis=axis), 1.0)


def masked_var(x, mask, unbiased: bool = False):
    """The variance of `x` over the masked entries (Bessel-corrected when `unbiased`)."""
    x = jnp.asarray(x, jnp.float32)
    mask = jnp.broadcast_to(jnp.asarray(mask, jnp.float32), x.shape)
    mean = masked_mean(x, mask)
    var = masked_mean(jnp.square(x - mean), mask)
    if unbiased:
        entries = jnp.sum(mask)
        var = var * entries / jnp.maximum(entries - 1.0, 1.0)
    return var


def masked_whiten(x, mask, shift_mean: bool = True, eps: float = 1e-8):
    """`x` scaled to unit variance over the masked entries (and centred, with `shift_mean`)."""
    x = jnp.asarray(x, jnp.float32)
    mean = masked_mean(x, mask)
    whitened = (x - mean) * jax.lax.rsqrt(masked_var(x, mask) + eps)
    return whitened if shift_mean else whitened + mean


def gae(rewards, values, dones, gamma: float = 0.99, lam: float = 0.95):
    """Generalized advantage estimation (Schulman et al. 2016): `(advantages, returns)`.

    `rewards` and `dones` are `[..., T]`; `dones[t] = 1` when the episode ends after step t, so the
    value after it is not bootstrapped and the sum restarts. `values` is `[..., T + 1]` (the last
    entry bootstraps the step after the horizon) or `[..., T]` (nothing to bootstrap: 0).

        delta_t = r_t + gamma * V_{t+1} * (1 - done_t) - V_t
        A_t     = delta_t + gamma * lam * (1 - done_t) * A_{t+1}
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    values = jnp.asarray(values, jnp.float32)
    dones = jnp.asarray(dones, jnp.float32)
    steps = rewards.shape[-1]
    if values.shape[-1] == steps:
        values = jnp.concatenate([values, jnp.zeros_like(values[..., :1])], axis=-1)
    if values.shape[-1] != steps + 1:
        raise ValueError(
            f"values must have T or T + 1 entries on the last axis; rewards have T={steps}, "
            f"values have {values.shape[-1]}."
        )
    live = 1.0 - dones
    deltas = rewards + gamma * values[..., 1:] * live - values[..., :-1]

    def back(carry, inputs):
        delta, alive = inputs
        carry = delta + gamma * lam * alive * carry
        return carry, carry

    time_major = (jnp.moveaxis(deltas, -1, 0), jnp.moveaxis(live, -1, 0))
    _, advantages = jax.lax.scan(back, jnp.zeros(deltas.shape[:-1]), time_major, reverse=True)
    advantages = jnp.moveaxis(advantages, 0, -1)
    return advantages, advantages + values[..., :-1]


def _grouped(rewards, groups: int):
    groups = count(groups, "groups (responses per prompt)")
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.ndim != 1 or rewards.shape[0] % groups:
        raise ValueError(
            f"rewards must be a flat vector whose length is a multiple of groups={groups}; got "
            f"shape {rewards.shape}. Rows are prompt-major: prompt i's responses sit at "
            f"i * groups ... i * groups + groups - 1."
        )
    return rewards.reshape(-1, groups)


def group_advantages(rewards, groups: int, normalize: bool = True, eps: float = 1e-6):
    """GRPO's group-relative advantages (Shao et al. 2024): each reward minus its group's mean,
    divided by the group's standard deviation (population std, plus `eps`) when `normalize`.

    `rewards` is `[prompts * groups]`, prompt-major. Every group's advantages sum to zero.
    """
    grouped = _grouped(rewards, groups)
    centred = grouped - jnp.mean(grouped, axis=1, keepdims=True)
    if normalize:
        centred = centred / (jnp.std(grouped, axis=1, keepdims=True) + eps)
    return centred.reshape(-1)


def rloo_advantages(rewards, groups: int):
    """REINFORCE leave-one-out (Ahmadian et al. 2024): each reward minus the mean of the other
    responses to the same prompt."""
    groups = count(groups, "rloo_advantages groups (leave-one-out needs 2 responses per prompt)", minimum=2)
    grouped = _grouped(rewards, groups)
    others = (jnp.sum(grouped, axis=1, keepdims=True) - grouped) / (groups - 1)
    return (grouped - others).reshape(-1)


def clipped_surrogate(log_ratio, advantages, clip: float = 0.2):
    """PPO's clipped policy loss per entry (Schulman et al. 2017), to be minimized:

        -min(ratio * A, clip(ratio, 1 - clip, 1 + clip) * A),   ratio = exp(log_ratio)
    """
    ratio = jnp.exp(jnp.asarray(log_ratio, jnp.float32))
    advantages = jnp.asarray(advantages, jnp.float32)
    unclipped = ratio * advantages
    clipped = jnp.clip(ratio, 1.0 - clip, 1.0 + clip) * advantages
    return -jnp.minimum(unclipped, clipped)


def clip_fraction(log_ratio, advantages, clip: float = 0.2):
    """Where the clipped term is the one in force (1.0) per entry, for logging."""
    ratio = jnp.exp(jnp.asarray(log_ratio, jnp.float32))
    advantages = jnp.asarray(advantages, jnp.float32)
    return (jnp.clip(ratio, 1.0 - clip, 1.0 + clip) * advantages < ratio * advantages).astype(jnp.float32)


def value_loss(values, old_values, returns, clip: float | None = 0.2):
    """PPO's value loss per entry: half the squared error, and with `clip` the larger of it and the
    error of the value moved at most `clip` from `old_values`."""
    values = jnp.asarray(values, jnp.float32)
    returns = jnp.asarray(returns, jnp.float32)
    loss = jnp.square(values - returns)
    if clip is not None:
        old_values = jnp.asarray(old_values, jnp.float32)
        moved = old_values + jnp.clip(values - old_values, -clip, clip)
        loss = jnp.maximum(loss, jnp.square(moved - returns))
    return 0.5 * loss


# KL(pi || ref) estimators from samples of pi (Schulman, "Approximating KL divergence", 2020).
def kl_k1(logp, ref_logp):
    """log pi - log ref: unbiased, high variance, can be negative."""
    return jnp.asarray(logp, jnp.float32) - jnp.asarray(ref_logp, jnp.float32)


def kl_k2(logp, ref_logp):
    """(log pi - log ref)^2 / 2: biased, low variance, never negative."""
    return 0.5 * jnp.square(kl_k1(logp, ref_logp))


def kl_k3(logp, ref_logp):
    """ref/pi - 1 - log(ref/pi): unbiased, low variance, never negative (GRPO's KL term)."""
    log_ratio = jnp.asarray(ref_logp, jnp.float32) - jnp.asarray(logp, jnp.float32)
    return jnp.exp(log_ratio) - log_ratio - 1.0
